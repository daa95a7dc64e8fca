"""qtx.torch_fp8: qtx QuantizedTensors as operands of PyTorch's block-scaled FP8 GEMM.

    from qtx import torch_fp8
    qx = session.quantize(x, mode="1d")          # activations, 1x128 blocks
    qw = session.quantize(w, mode="2d")          # weight [N, K], 128x128 tiles
    y = torch_fp8.scaled_mm(qx, qw)              # x @ w.T in FP8 on sm_90, BF16 out
    y = torch_fp8.matmul(qx, qw)                 # the same, or dequantize-then-matmul
                                                 # where PyTorch cannot

Every function computes ``A @ B.T`` where A and B are the *stored* matrices of the
chosen copies: the rowwise copy of an [M, K] tensor is A = [M, K]; the columnwise copy
is stored transposed, so it gives A = [K, M]. Hence, for a Linear layer Y = X W^T:

    fprop  Y  = X  W^T : scaled_mm(qx, qw)                                   1x128 x 128x128
    dgrad  dX = dY W   : scaled_mm(qdy, qw, b_usage="columnwise")            1x128 x 128x128
    wgrad  dW = dY^T X : scaled_mm(qdy, qx, "columnwise", "columnwise")      1x128 x 1x128

The QuantizedTensors may come from ``qtx.Client`` (torch CPU tensors) or from
``qtx.cuda.Session`` (CUDA tensors): only the fields shape, mode, format,
rowwise_data / rowwise_scale_inv / columnwise_data / columnwise_scale_inv are read.

What PyTorch takes on sm_90 (checked in ATen's ScaledBlas.cpp and on an H200;
client/README.md "FP8 GEMM with PyTorch"): ``a`` [M, K] float8_e4m3fn row-major;
``b`` [K, N] column-major, i.e. ``B.t()`` of a row-major B [N, K]; K and N multiples
of 16; FP32 decode scales (qtx's scale_inv):

    operand / recipe        public F.scaled_mm                 torch._scaled_mm
    a, 1x128                [M, L]  strides (1, M)             same
    a, 128x128              [L4, Mb] strides (1, L4)           [Mb, L] strides (L, 1)
    b, 1x128                [N, L]  strides (1, N)             [L, N]  strides (N, 1)
    b, 128x128              [L4, Nb] strides (1, L4)           [L, Nb] strides (1, L)

with L = ceil(K/128), L4 = L rounded up to a multiple of 4, Mb = ceil(M/128). qtx
stores a 1x128 copy's scale_inv as [L, pad4(outer)] and a 128x128 copy's as
[ceil(outer/128), L4], both row-major; so the operands are **views** (no copy of data or
scales) for every GEMM that cuBLASLt runs. Two layouts do not coincide:

* a 1x128 ``a`` whose M is not a multiple of 4: ATen wants the row stride M exactly,
  qtx's is pad4(M). operand_a then **copies** the L x M scales into a compact tensor
  (``Operand.copied``; the FP8 data is never copied) — but cuBLASLt refuses such an M
  anyway (CUBLAS_STATUS_NOT_SUPPORTED on an H200 for M = 1001 and 1002; M = 4, 1000 and
  1004 ran), so scaled_mm raises UnsupportedGemm for M % 4 != 0 and matmul falls back.
  (A 128x128 ``a`` needs M % 8 == 0, cuBLASLt's documented alignment; not probed.)
* torch._scaled_mm with a 128x128 operand and L % 4 != 0 (K not a multiple of 512): its
  check wants row stride L, qtx's (and cuBLAS's) is L4. Compacting passes the check but
  gives wrong numbers (relative error 13 on an H200, K = 640), so this raises
  UnsupportedGemm. The public API takes the padded layout as it is (verified for K = 640).

Unsupported (UnsupportedGemm, with what to do instead): 128x128 x 128x128; e5m2 x e5m2;
e4m3 x e5m2 through the public API (torch._scaled_mm takes it: 'auto' picks it for mixed
formats; verified for 1x128 x 128x128 and 1x128 x 1x128 on an H200); K or N not a
multiple of 16; M not a multiple of 4 (1x128 A) or 8 (128x128 A); tensors not on a CUDA device; a GPU that is not sm_90 (the
1x128/128x128 recipe is Hopper-only in PyTorch); a torch without float8 dtypes or without
either API. ``dequantized_mm`` (decode, scale, FP32 matmul) works everywhere, including
torch 1.13 on the CPU; ``matmul`` picks.

torch is an optional import: the module imports without it (its functions then raise).
"""

import dataclasses

try:  # torch is optional
    import torch
except Exception:  # pragma: no cover - depends on the machine
    torch = None

BLOCK = 128
USAGES = ("rowwise", "columnwise")
APIS = ("auto", "scaled_mm", "_scaled_mm")
RECIPES = {"1d": "1x128", "2d": "128x128"}


class UnsupportedGemm(ValueError):
    """PyTorch's block-scaled FP8 GEMM cannot take these operands (the message says
    why and what to do); ``dequantized_mm`` can."""


def cdiv(a, b):
    return -(-a // b)


def pad4(x):
    return (x + 3) // 4 * 4


def _need_torch():
    if torch is None:
        raise ImportError("qtx.torch_fp8 needs torch (pip install torch)")


def has_float8():
    """True when this torch has the float8_e4m3fn / float8_e5m2 dtypes (>= 2.1)."""
    return torch is not None and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e5m2")


@dataclasses.dataclass
class Operand:
    """One operand of the GEMM in the layout PyTorch wants.

    data: the FP8 matrix as the API takes it (float8 view of qtx's bytes, or the uint8
    bytes with as_float8=False): [M, K] row-major for ``a``, [K, N] column-major for
    ``b``. scale: the FP32 decode scales in the API's layout (see the module doc).
    recipe: '1x128' or '128x128'. copied: True when the scales had to be copied
    (compacted); the data is always a view of qtx's tensor."""
    data: object
    scale: object
    recipe: str
    format: str
    copied: bool


@dataclasses.dataclass
class QuantizedView:
    """A QuantizedTensor-like record (what to_device returns)."""
    shape: tuple
    mode: str
    format: str
    rowwise_data: object = None
    rowwise_scale_inv: object = None
    columnwise_data: object = None
    columnwise_scale_inv: object = None


def to_device(q, device):
    """A copy of q's tensors on `device` (e.g. CPU tensors from qtx.Client moved to
    'cuda'); layouts, strides and padding are kept. This is a copy (PCIe), by design."""
    _need_torch()
    out = QuantizedView(tuple(q.shape), q.mode, q.format)
    for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        t = getattr(q, f, None)
        if t is not None:
            setattr(out, f, t.to(device))
    return out


def _stored(q, usage):
    """(data [outer, K] uint8 bytes, scale_inv, recipe, format) of one copy, checked
    against qtx's layout (docs/numerics.md §4)."""
    _need_torch()
    if usage not in USAGES:
        raise ValueError("usage=%r: must be 'rowwise' or 'columnwise'" % (usage,))
    if getattr(q, "mode", None) not in RECIPES:
        raise ValueError("QuantizedTensor.mode=%r: must be '1d' or '2d'" % (getattr(q, "mode", None),))
    if getattr(q, "format", None) not in ("e4m3", "e5m2"):
        raise ValueError("QuantizedTensor.format=%r: must be 'e4m3' or 'e5m2'"
                         % (getattr(q, "format", None),))
    data = getattr(q, usage + "_data", None)
    scale = getattr(q, usage + "_scale_inv", None)
    if data is None or scale is None:
        raise ValueError("the QuantizedTensor has no %s copy: quantize with %s=True"
                         % (usage, usage))
    if not isinstance(data, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError("%s_data / %s_scale_inv must be torch tensors (got %s, %s); "
                        "numpy results: torch.from_numpy them" % (usage, usage,
                                                                  type(data).__name__,
                                                                  type(scale).__name__))
    if data.dim() != 2:
        raise ValueError("%s_data must be 2-D, got shape %s" % (usage, tuple(data.shape)))
    if data.dtype != torch.uint8 and not (has_float8() and data.dtype in (torch.float8_e4m3fn,
                                                                         torch.float8_e5m2)):
        raise TypeError("%s_data must be uint8 (or float8) bytes, got %s" % (usage, data.dtype))
    if not data.is_contiguous():
        raise ValueError("%s_data must be contiguous (qtx's row-major layout)" % usage)
    if scale.dtype != torch.float32:
        raise TypeError("%s_scale_inv must be float32, got %s" % (usage, scale.dtype))
    outer, k = data.shape
    if q.mode == "1d":
        want = (cdiv(k, BLOCK), pad4(outer))
    else:
        want = (cdiv(outer, BLOCK), pad4(cdiv(k, BLOCK)))
    if tuple(scale.shape) != want:
        raise ValueError("%s_scale_inv has shape %s; qtx's %s layout of a %s copy [%d, %d] is %s"
                         % (usage, tuple(scale.shape), q.mode, usage, outer, k, want))
    if scale.stride(-1) != 1 or scale.stride(0) != want[1]:
        raise ValueError("%s_scale_inv must be row-major (strides %s), got %s"
                         % (usage, (want[1], 1), tuple(scale.stride())))
    if data.device != scale.device:
        raise ValueError("%s_data is on %s but its scale_inv on %s" % (usage, data.device,
                                                                      scale.device))
    return data, scale, RECIPES[q.mode], q.format


def _float8_view(data, fmt, as_float8):
    if not as_float8 or data.dtype != torch.uint8:
        return data
    if not has_float8():
        raise UnsupportedGemm("torch %s has no float8 dtypes (needs >= 2.1): use "
                              "dequantized_mm, or as_float8=False for the uint8 layout"
                              % torch.__version__)
    return data.view(torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2)


def _check_api(api):
    if api not in ("scaled_mm", "_scaled_mm"):
        raise ValueError("api=%r: must be 'scaled_mm' (torch.nn.functional.scaled_mm) or "
                         "'_scaled_mm' (torch._scaled_mm)" % (api,))


def operand_a(q, usage="rowwise", api="scaled_mm", as_float8=True):
    """The left operand (A [M, K] = the stored matrix of q's `usage` copy) of
    A @ B.T as `api` takes it: an Operand. See the module doc for the layouts."""
    _check_api(api)
    data, s, recipe, fmt = _stored(q, usage)
    m, k = data.shape
    nblk = cdiv(k, BLOCK)
    copied = False
    if recipe == "1x128":
        # qtx: s [L, pad4(M)] row-major. Both APIs: [M, L] with strides (1, M).
        if s.shape[1] == m or nblk == 1:  # (a size-1 dim's stride is not checked)
            scale = s[:, :m].t()
        else:
            scale = s[:, :m].contiguous().t()
            copied = True
    else:
        # qtx: s [Mb, L4] row-major.
        l4 = s.shape[1]
        if api == "scaled_mm":
            scale = s.t()  # [L4, Mb], strides (1, L4)
        else:
            if l4 != nblk and s.shape[0] > 1:
                raise UnsupportedGemm(
                    "torch._scaled_mm cannot take a 128x128 scale whose ceil(K/128) = %d is not "
                    "a multiple of 4 (K = %d; it wants row stride %d, cuBLASLt reads %d): use "
                    "K a multiple of 512, torch.nn.functional.scaled_mm, or dequantized_mm"
                    % (nblk, k, nblk, l4))
            scale = s[:, :nblk]  # [Mb, L], strides (L, 1)
    return Operand(_float8_view(data, fmt, as_float8), scale, recipe, fmt, copied)


def operand_b(q, usage="rowwise", api="scaled_mm", as_float8=True):
    """The right operand of A @ B.T, where B [N, K] is the stored matrix of q's
    `usage` copy, as `api` takes it: data = B.t() ([K, N], column-major, a view)."""
    _check_api(api)
    data, s, recipe, fmt = _stored(q, usage)
    n, k = data.shape
    nblk = cdiv(k, BLOCK)
    copied = False
    if recipe == "1x128":
        # qtx: s [L, pad4(N)] row-major.
        if s.shape[1] != n and nblk > 1:
            s = s[:, :n].contiguous()
            copied = True
        if api == "scaled_mm":
            scale = s[:, :n].t()  # [N, L], strides (1, N)
        else:
            scale = s[:, :n]      # [L, N], strides (N, 1)
    else:
        # qtx: s [Nb, L4] row-major.
        l4 = s.shape[1]
        if api == "scaled_mm":
            scale = s.t()  # [L4, Nb], strides (1, L4)
        else:
            if l4 != nblk and s.shape[0] > 1:
                raise UnsupportedGemm(
                    "torch._scaled_mm cannot take a 128x128 scale whose ceil(K/128) = %d is not "
                    "a multiple of 4 (K = %d; it wants stride %d, cuBLASLt reads %d): use K a "
                    "multiple of 512, torch.nn.functional.scaled_mm, or dequantized_mm"
                    % (nblk, k, nblk, l4))
            scale = s[:, :nblk].t()  # [L, Nb], strides (1, L)
    return Operand(_float8_view(data, fmt, as_float8).t(), scale, recipe, fmt, copied)


def check_supported(qa, qb, a_usage="rowwise", b_usage="rowwise", api="auto",
                    check_device=True):
    """Raises UnsupportedGemm (saying why and what to do) unless PyTorch's block-scaled
    FP8 GEMM can compute A @ B.T for these copies through `api` ('auto', 'scaled_mm',
    '_scaled_mm'); returns the API that will be used."""
    _need_torch()
    if api not in APIS:
        raise ValueError("api=%r: must be one of %s" % (api, APIS))
    da, _, ra, fa = _stored(qa, a_usage)
    db, _, rb, fb = _stored(qb, b_usage)
    m, k = da.shape
    n, kb = db.shape
    if k != kb:
        raise ValueError("A is [%d, %d] and B is [%d, %d]: A @ B.T needs the same K"
                         % (m, k, n, kb))
    if ra == "128x128" and rb == "128x128":
        raise UnsupportedGemm("128x128 x 128x128: cuBLASLt (and so PyTorch) has no 2D x 2D "
                              "block-scaled GEMM; quantize one operand (the activations) with "
                              "mode='1d', or use dequantized_mm")
    if fa == "e5m2" and fb == "e5m2":
        raise UnsupportedGemm("e5m2 x e5m2: cuBLASLt multiplies no two E5M2 matrices; quantize "
                              "one operand with format='e4m3', or use dequantized_mm")
    mixed = fa != fb
    if m == 0 or k == 0 or n == 0:
        raise UnsupportedGemm("empty GEMM (M, K, N) = (%d, %d, %d): use dequantized_mm"
                              % (m, k, n))
    if k % 16 or n % 16:
        raise UnsupportedGemm("K = %d, N = %d: the FP8 GEMM needs K and N multiples of 16; "
                              "use dequantized_mm" % (k, n))
    align = 4 if ra == "1x128" else 8
    if m % align:
        raise UnsupportedGemm("M = %d (A's outer dimension) is not a multiple of %d: cuBLASLt "
                              "refuses this block-scaled GEMM (CUBLAS_STATUS_NOT_SUPPORTED on an "
                              "H200 for a 1x128 A with M = 1001 and 1002, compact scales too; "
                              "M = 4 and 1004 ran); pad A's rows or use dequantized_mm"
                              % (m, align))
    if not has_float8():
        raise UnsupportedGemm("torch %s has no float8 dtypes: use dequantized_mm"
                              % torch.__version__)
    chosen = _pick_api(api, mixed)
    if chosen is None:
        raise UnsupportedGemm("torch %s has neither torch.nn.functional.scaled_mm nor "
                              "torch._scaled_mm: use dequantized_mm" % torch.__version__)
    if chosen == "scaled_mm" and not (hasattr(torch.nn.functional, "scaled_mm")
                                      and _scaling_type() is not None):
        raise UnsupportedGemm("torch %s has no torch.nn.functional.scaled_mm" % torch.__version__)
    if chosen == "_scaled_mm" and not hasattr(torch, "_scaled_mm"):
        raise UnsupportedGemm("torch %s has no torch._scaled_mm" % torch.__version__)
    if mixed and chosen == "scaled_mm":
        raise UnsupportedGemm("formats %s x %s: torch.nn.functional.scaled_mm takes e4m3 x e4m3 "
                              "only for 1x128/128x128 blocks; use api='_scaled_mm' (e4m3 x e5m2 "
                              "works there) or dequantized_mm" % (fa, fb))
    # The layouts (raises for torch._scaled_mm with a padded 128x128 scale).
    operand_a(qa, a_usage, chosen, as_float8=False)
    operand_b(qb, b_usage, chosen, as_float8=False)
    if not check_device:
        return chosen
    if da.device.type != "cuda" or db.device.type != "cuda":
        raise UnsupportedGemm("operands on %s and %s: the FP8 GEMM runs on CUDA; move them "
                              "with qtx.torch_fp8.to_device(q, 'cuda') (a copy) or use "
                              "dequantized_mm" % (da.device, db.device))
    if da.device != db.device:
        raise UnsupportedGemm("operands on different devices (%s, %s)" % (da.device, db.device))
    major, minor = torch.cuda.get_device_capability(da.device)
    if major != 9:
        raise UnsupportedGemm("sm_%d%d: PyTorch runs the 1x128/128x128 block-scaled GEMM on "
                              "sm_90 (Hopper) only; use dequantized_mm" % (major, minor))
    return chosen


def unsupported_reason(qa, qb, a_usage="rowwise", b_usage="rowwise", api="auto"):
    """None when scaled_mm can run on these operands, else the reason (a string)."""
    try:
        check_supported(qa, qb, a_usage, b_usage, api)
    except UnsupportedGemm as e:
        return str(e)
    return None


def _scaling_type():
    f = torch.nn.functional
    for owner, name in ((f, "ScalingType"), (f, "_ScalingType")):
        t = getattr(owner, name, None)
        if t is not None:
            return t
    try:
        from torch.nn.functional import ScalingType  # noqa: F401
        return ScalingType
    except Exception:
        return None


def _pick_api(api, mixed_formats=False):
    """'auto': the public torch.nn.functional.scaled_mm when present (and the formats are
    both e4m3), else torch._scaled_mm when present, else None."""
    if api != "auto":
        return api
    if torch is None:
        return None
    if (not mixed_formats and hasattr(torch.nn.functional, "scaled_mm")
            and _scaling_type() is not None):
        return "scaled_mm"
    if hasattr(torch, "_scaled_mm"):
        return "_scaled_mm"
    return None


def gemm_operands(qa, qb, a_usage="rowwise", b_usage="rowwise", api="scaled_mm",
                  as_float8=True):
    """(Operand a, Operand b) for A @ B.T through `api` ('scaled_mm' or '_scaled_mm'),
    without running anything: layouts only, no shape/pair/device checks (check_supported
    does those)."""
    return (operand_a(qa, a_usage, api, as_float8), operand_b(qb, b_usage, api, as_float8))


def scaled_mm(qa, qb, out_dtype=None, a_usage="rowwise", b_usage="rowwise", api="auto"):
    """A @ B.T with PyTorch's block-scaled FP8 GEMM (sm_90): [M, N] in out_dtype
    (torch.bfloat16 by default, or torch.float32). api: 'auto' (the public
    torch.nn.functional.scaled_mm when present and both operands are e4m3, else
    torch._scaled_mm), 'scaled_mm' or '_scaled_mm'. Raises UnsupportedGemm where
    PyTorch cannot (module doc)."""
    _need_torch()
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("out_dtype=%s: the block-scaled GEMM writes bfloat16 or float32"
                         % (out_dtype,))
    chosen = check_supported(qa, qb, a_usage, b_usage, api)
    a = operand_a(qa, a_usage, chosen)
    b = operand_b(qb, b_usage, chosen)
    if chosen == "scaled_mm":
        st = _scaling_type()
        recipe = {"1x128": st.BlockWise1x128, "128x128": st.BlockWise128x128}
        return torch.nn.functional.scaled_mm(a.data, b.data, a.scale, recipe[a.recipe],
                                             b.scale, recipe[b.recipe],
                                             output_dtype=out_dtype)
    return torch._scaled_mm(a.data, b.data, a.scale, b.scale, out_dtype=out_dtype)


# ---- the fallback: dequantize, then matmul -------------------------------------------------


def fp8_values(fmt):
    """The 256 values of the FP8 bytes of `fmt` ('e4m3' = e4m3fn, 'e5m2'), as a list of
    Python floats (NaN/Inf included): sign, exponent and mantissa decoded by hand."""
    exp_bits, man_bits = (4, 3) if fmt == "e4m3" else (5, 2)
    bias = (1 << (exp_bits - 1)) - 1
    out = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        e = (byte >> man_bits) & ((1 << exp_bits) - 1)
        m = byte & ((1 << man_bits) - 1)
        if fmt == "e4m3" and e == 15 and m == 7:
            v = float("nan")
        elif fmt == "e5m2" and e == 31:
            v = float("inf") if m == 0 else float("nan")
        elif e == 0:
            v = m / float(1 << man_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / float(1 << man_bits)) * 2.0 ** (e - bias)
        out.append(sign * v)
    return out


_TABLES = {}


def _table(fmt, device):
    key = (fmt, str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(fp8_values(fmt), dtype=torch.float32, device=device)
    return _TABLES[key]


def dequantize(q, usage="rowwise", dtype=None):
    """The FP32 (or `dtype`) values of q's `usage` copy, as stored ([M, N] rowwise,
    [N, M] columnwise): float(byte) * scale_inv of its block, one FP32 rounding, as
    qtxd's Dequantize (bit-identical). Works on any torch, CPU or CUDA."""
    data, s, recipe, fmt = _stored(q, usage)
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    outer, k = data.shape
    vals = _table(fmt, data.device)[data.long()]
    if recipe == "1x128":
        per_row = s[:, :outer].t()                           # [outer, L]
        scale = per_row.repeat_interleave(BLOCK, dim=1)[:, :k]
    else:
        tiles = s[:, :cdiv(k, BLOCK)]                        # [Ob, L]
        scale = tiles.repeat_interleave(BLOCK, dim=0)[:outer]
        scale = scale.repeat_interleave(BLOCK, dim=1)[:, :k]
    out = vals * scale
    return out if dtype is None or dtype == torch.float32 else out.to(dtype)


def dequantized_mm(qa, qb, out_dtype=None, a_usage="rowwise", b_usage="rowwise"):
    """A @ B.T from the dequantized operands: FP32 matmul, then out_dtype
    (torch.bfloat16 by default). Works everywhere (CPU, any GPU, any torch >= 1.13)."""
    _need_torch()
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    a = dequantize(qa, a_usage)
    b = dequantize(qb, b_usage)
    if a.shape[1] != b.shape[1]:
        raise ValueError("A is %s and B is %s: A @ B.T needs the same K"
                         % (tuple(a.shape), tuple(b.shape)))
    return (a @ b.t()).to(out_dtype)


def matmul(qa, qb, out_dtype=None, a_usage="rowwise", b_usage="rowwise", api="auto"):
    """scaled_mm where PyTorch can run it, else dequantized_mm. Returns (result, path)
    with path 'fp8' or 'dequantized: <why the FP8 GEMM could not run>'."""
    try:
        return scaled_mm(qa, qb, out_dtype, a_usage, b_usage, api), "fp8"
    except UnsupportedGemm as e:
        return dequantized_mm(qa, qb, out_dtype, a_usage, b_usage), "dequantized: %s" % e
