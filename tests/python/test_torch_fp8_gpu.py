#!/usr/bin/env python3
"""GPU test (CTest label gpu): qtx-quantized operands through PyTorch's block-scaled FP8
GEMM (qtx.torch_fp8, sm_90) against the matmul of the dequantized operands.

Quantizes with qtxd through the qtx CLI (`qtx quantize --save`; the GPU machine's
Python has no grpcio), so the bytes are the CPU reference's. For every (M, K, N):

* torch_fp8.dequantize == qtxd's Dequantize, bit for bit (the fallback's decode);
* fprop   X W^T  (1x128 x 128x128), through torch.nn.functional.scaled_mm and
  torch._scaled_mm; dgrad dY W (1x128 x 128x128, W's columnwise copy); wgrad-shaped
  X^T X (1x128 x 1x128, columnwise copies); W X^T (128x128 x 1x128) — each compared with
  the FP32 matmul of the dequantized operands (tolerance argued at TOLERANCE below);
* E5M2 gradients x E4M3 operands (dgrad, wgrad) through 'auto' (torch._scaled_mm);
* M % 4 != 0: matmul falls back to the dequantized matmul;
* a deliberately mis-laid scale (scale_a rolled by one row, scale_b rolled by one tile)
  must break that tolerance — so the check can fail;
* probes that record what PyTorch accepts: which M cuBLASLt takes, scale_a with qtx's pad4(M) row stride
  uncompacted, torch._scaled_mm with a compacted 128x128 scale when ceil(K/128) % 4 != 0,
  E5M2 operands.

Prints one JSON line per result; exits 1 if any check fails.

  python3 tests/python/test_torch_fp8_gpu.py --qtxd=build/server/qtxd \
      --qtx_cli=build/client/cli/qtx --python_dir=client/python [--json=out.jsonl]
"""

import argparse
import importlib.util
import json
import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import qtx_cli_io  # noqa: E402

# ---- tolerance ---------------------------------------------------------------------------------
# The reference C = A_deq @ B_deq^T is computed in FP64 from the exact dequantized
# operands (FP8 value x power-of-two scale_inv: exact in FP32). The GEMM differs from it by
#  (1) output rounding: BF16 keeps 8 significant bits, so |round(c) - c| <= 2^-8 |c|
#      (half an ulp; FP32 output: 2^-24 |c|, negligible);
#  (2) accumulation: FP8 products are exact; partial sums are rounded in the tensor
#      core's accumulator and promoted to FP32 per 128-element K block (the block scales
#      are applied at that point), in an order we do not control. Hopper's FP8 MMA
#      accumulator keeps fewer bits than FP32 (about 2^-14 relative per addition is the
#      figure DeepSeek-V3 reports for H800); a chain of at most 128 such additions inside a
#      block, then FP32 across blocks, is bounded by about 128 * 2^-14 * S = 2^-7 * S
#      in the worst case, where S = |A| @ |B|^T (the sum of absolute products); errors of
#      random sign grow like sqrt(128), so 2^-10 * S covers it with margin.
# Elementwise: |gemm - ref| <= 2^-8 |ref| * (1 + 2^-4) + 2^-10 * S. Over the whole result:
# relative L2 error <= 4e-3 (BF16 rounding alone gives an RMS of about 2^-8/sqrt(3) =
# 2.3e-3 at worst, 1.1e-3 to 1.7e-3 typically).
# A mis-laid scale multiplies whole 128-blocks by wrong powers of two (the test data has
# block magnitudes spread over 2^-3..2^3), giving errors of the size of C itself:
# relative L2 >> 4e-3 and many elements outside the elementwise bound.
REL_L2_TOL = 4e-3
ELEM_REL = 2.0 ** -8 * (1 + 2.0 ** -4)
ELEM_ABS_S = 2.0 ** -10

RESULTS = []
FAILURES = []


def emit(**kw):
    RESULTS.append(kw)
    print(json.dumps(kw), flush=True)
    if ARGS.json:
        with open(ARGS.json, "a") as f:
            f.write(json.dumps(kw) + "\n")


def fail(what, **kw):
    FAILURES.append(what)
    emit(check=what, ok=False, **kw)


def load_torch_fp8(python_dir):
    """qtx/torch_fp8.py by path: importing the qtx package needs grpcio, which this
    host's Python may not have; torch_fp8 needs only torch."""
    path = os.path.join(python_dir, "qtx", "torch_fp8.py")
    spec = importlib.util.spec_from_file_location("qtx_torch_fp8", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def varied(rows, cols, gen, tile_rows):
    """N(0,1) data whose magnitude changes by powers of two per (tile_rows x 128)
    block, so that block scales differ and a mis-laid scale shows."""
    x = torch.randn(rows, cols, generator=gen)
    rb, cb = -(-rows // tile_rows), -(-cols // 128)
    e = torch.randint(-3, 4, (rb, cb), generator=gen).float()
    mag = torch.pow(2.0, e).repeat_interleave(tile_rows, 0)[:rows].repeat_interleave(128, 1)
    return x * mag[:, :cols]


def compare(name, got, a_deq, b_deq, case, extra=None):
    """got vs A_deq @ B_deq^T; returns (ok, rel_l2, n_bad)."""
    ref64 = a_deq.double() @ b_deq.double().t()
    s = a_deq.double().abs() @ b_deq.double().abs().t()
    ref32 = a_deq @ b_deq.t()
    diff = got.double() - ref64
    rel_l2 = (diff.norm() / ref64.norm()).item()
    rel_l2_vs_fp32 = ((got.double() - ref32.double()).norm() / ref32.double().norm()).item()
    bound = ELEM_REL * ref64.abs() + ELEM_ABS_S * s
    n_bad = int((diff.abs() > bound).sum().item())
    ok = rel_l2 <= REL_L2_TOL and n_bad == 0
    row = dict(check=name, case=case, ok=ok, rel_l2=rel_l2, rel_l2_vs_fp32_matmul=rel_l2_vs_fp32,
               elements_out_of_bound=n_bad, elements=got.numel(),
               fp32_matmul_rel_l2=((ref32.double() - ref64).norm() / ref64.norm()).item(),
               cosine=torch.nn.functional.cosine_similarity(
                   got.double().flatten(), ref64.flatten(), dim=0).item())
    if extra:
        row.update(extra)
    return ok, row


def to_cuda(q):
    return TF.to_device(q, "cuda")


def run_case(server, m, k, n, gen):
    case = "M=%d,K=%d,N=%d" % (m, k, n)
    x = varied(m, k, gen, 1)
    w = varied(n, k, gen, 128) * 0.05
    dy = varied(m, n, gen, 1)
    qx_h = qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, x, "1d", rowwise=True,
                                   columnwise=True)
    qw_h = qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, w, "2d", rowwise=True,
                                   columnwise=True)
    qdy_h = qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, dy, "1d")
    qx, qw, qdy = to_cuda(qx_h), to_cuda(qw_h), to_cuda(qdy_h)

    # The fallback's decode is qtxd's Dequantize, bit for bit.
    for name, q, qh in (("x", qx, qx_h), ("w", qw, qw_h), ("dy", qdy, qdy_h)):
        mine = TF.dequantize(q).cpu()
        same = torch.equal(mine.view(torch.int32), qh.dequantized.view(torch.int32))
        emit(check="dequantize_bit_exact_vs_qtxd", case=case, tensor=name, ok=same)
        if not same:
            fail("dequantize_bit_exact_vs_qtxd", case=case, tensor=name)
    # 2-D: the columnwise copy is the transpose of the rowwise copy.
    if not torch.equal(TF.dequantize(qw, "columnwise"), TF.dequantize(qw).t()):
        fail("2d_columnwise_is_transpose", case=case)

    xd, xcd = TF.dequantize(qx), TF.dequantize(qx, "columnwise")
    wd, wcd = TF.dequantize(qw), TF.dequantize(qw, "columnwise")
    dyd = TF.dequantize(qdy)

    gemms = [
        ("fprop X W^T 1x128x128x128", qx, qw, "rowwise", "rowwise", xd, wd),
        ("dgrad dY W 1x128x128x128", qdy, qw, "rowwise", "columnwise", dyd, wcd),
        ("X^T X 1x128x1x128", qx, qx, "columnwise", "columnwise", xcd, xcd),
        ("W X^T 128x128x1x128", qw, qx, "rowwise", "rowwise", wd, xd),
    ]
    for label, qa, qb, ua, ub, ad, bd in gemms:
        for api in ("scaled_mm", "_scaled_mm"):
            name = "%s via %s" % (label, api)
            try:
                ops = TF.gemm_operands(qa, qb, ua, ub, api=api)
                copied = [ops[0].copied, ops[1].copied]
            except Exception as e:  # noqa: BLE001 - recorded
                copied = None
            try:
                got = TF.scaled_mm(qa, qb, torch.bfloat16, ua, ub, api=api)
                torch.cuda.synchronize()
            except TF.UnsupportedGemm as e:
                emit(check=name, case=case, ran=False, raised="UnsupportedGemm", message=str(e))
                expected = _expect_unsupported(label, api, qa, qb, ua, ub)
                if not expected:
                    fail(name + " raised unexpectedly", case=case, message=str(e))
                continue
            except Exception as e:  # noqa: BLE001 - PyTorch refused: a finding, and a failure
                fail(name, case=case, ran=False, raised=type(e).__name__, message=str(e)[:600])
                continue
            ok, row = compare(name, got, ad, bd, case, dict(api=api, scale_copied=copied))
            emit(ran=True, **row)
            if not ok:
                FAILURES.append(name + " " + case)
            del got

    # Where cuBLASLt cannot run (here: M % 4 != 0), matmul falls back to the dequantized
    # matmul and says so.
    if m % 4:
        got, path = TF.matmul(qx, qw)
        same = torch.equal(got, TF.dequantized_mm(qx, qw))
        emit(check="matmul falls back", case=case, path=path, ok=same and
             path.startswith("dequantized: M = %d" % m))
        if not (same and path.startswith("dequantized: M = %d" % m)):
            FAILURES.append("matmul fallback " + case)
        return
    # The check can fail: mis-lay a scale and expect the tolerance to be broken.
    for which in ("scale_a rolled by one row", "scale_b rolled by one N tile"):
        a, b = TF.operand_a(qx), TF.operand_b(qw)
        st = TF._scaling_type()
        sa, sb = a.scale, b.scale
        if which.startswith("scale_a"):
            sa = _restride(sa, torch.roll(sa, 1, dims=0))
        else:
            if sb.shape[1] < 2:
                continue
            sb = _restride(sb, torch.roll(sb, 1, dims=1))
        got = torch.nn.functional.scaled_mm(a.data, b.data, sa, st.BlockWise1x128, sb,
                                            st.BlockWise128x128, output_dtype=torch.bfloat16)
        ok, row = compare("mis-laid " + which, got, xd, wd, case)
        row["ok"] = not ok  # this check passes when the comparison fails
        row["detected"] = not ok
        emit(**row)
        if ok:
            FAILURES.append("mis-laid scale not detected " + case)
    return qx, qw, xd, wd


def _restride(like, values):
    """`values` in a tensor with `like`'s strides (what PyTorch checks)."""
    out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
    out.copy_(values)
    return out


def _expect_unsupported(label, api, qa, qb, ua, ub):
    """Whether UnsupportedGemm is the documented answer for this GEMM."""
    da = getattr(qa, ua + "_data")
    db = getattr(qb, ub + "_data")
    n, k = db.shape
    if k % 16 or n % 16 or da.shape[0] % (4 if qa.mode == "1d" else 8):
        return True
    if api == "_scaled_mm":
        l = -(-k // 128)
        two_d = qa.mode == "2d" or qb.mode == "2d"
        rows_2d = da.shape[0] if qa.mode == "2d" else db.shape[0]
        if two_d and l % 4 and rows_2d > 128:
            return True
    return False


def as_finding(row):
    """A probe's comparison row: 'matches_reference' instead of a pass/fail 'ok'."""
    row["matches_reference"] = row.pop("ok")
    return row


def hybrid(server, gen):
    """E5M2 gradients (TE's HYBRID format) x E4M3 operands: 'auto' takes torch._scaled_mm."""
    m, k, n = 1024, 4096, 2048
    case = "M=%d,K=%d,N=%d e5m2 dY" % (m, k, n)
    x, w, dy = varied(m, k, gen, 1), varied(n, k, gen, 128) * 0.05, varied(m, n, gen, 1)
    qx = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, x, "1d", rowwise=True,
                                         columnwise=True))
    qw = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, w, "2d", rowwise=True,
                                         columnwise=True))
    qdy = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, dy, "1d", fmt="e5m2",
                                          rowwise=True, columnwise=True))
    for label, ua, qb, ub in (("dgrad dY(e5m2) W", "rowwise", qw, "columnwise"),
                              ("wgrad dY^T(e5m2) X", "columnwise", qx, "columnwise")):
        try:
            got = TF.scaled_mm(qdy, qb, torch.bfloat16, ua, ub)
        except Exception as e:  # noqa: BLE001
            fail(label + " via auto", case=case, message=str(e)[:400])
            continue
        ok, row = compare(label + " via auto (_scaled_mm)", got, TF.dequantize(qdy, ua),
                          TF.dequantize(qb, ub), case)
        emit(**row)
        if not ok:
            FAILURES.append(label + " " + case)
    try:
        TF.scaled_mm(qdy, qw, torch.bfloat16, "rowwise", "columnwise", api="scaled_mm")
        fail("e5m2 through the public API did not raise", case=case)
    except TF.UnsupportedGemm as e:
        emit(check="e5m2 through the public API raises UnsupportedGemm", ok=True, message=str(e))


def probes(server, gen):
    """What PyTorch 2.11 accepts beyond the documented layouts (findings, not checks)."""
    st = TF._scaling_type()
    # (0) Which M does cuBLASLt take for a 1x128 a? (H200, torch 2.11: 4, 8, 1000 and 1004
    # ran; 1001 and 1002 did not -> torch_fp8 requires M % 4 == 0.)
    for m in (1004, 1002, 1000, 8, 4):
        k, n = 512, 256
        x, w = varied(m, k, gen, 1), varied(n, k, gen, 128) * 0.05
        qx = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, x, "1d"))
        qw = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, w, "2d"))
        a, b = TF.operand_a(qx), TF.operand_b(qw)
        name = "probe: 1x128 a with M=%d (scale copied: %s)" % (m, a.copied)
        try:
            got = torch.nn.functional.scaled_mm(a.data, b.data, a.scale, st.BlockWise1x128,
                                                b.scale, st.BlockWise128x128,
                                                output_dtype=torch.bfloat16)
            torch.cuda.synchronize()
            ok, row = compare(name, got, TF.dequantize(qx), TF.dequantize(qw),
                              "M=%d,K=512,N=256" % m)
            emit(accepted=True, **as_finding(row))
        except Exception as e:  # noqa: BLE001
            emit(check=name, accepted=False, message=str(e).splitlines()[0][:200])
    # (1) scale_a with qtx's pad4(M) row stride, uncompacted (M % 4 != 0).
    m, k, n = 1001, 512, 256
    x, w = varied(m, k, gen, 1), varied(n, k, gen, 128) * 0.05
    qx = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, x, "1d"))
    qw = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, w, "2d"))
    a, b = TF.operand_a(qx), TF.operand_b(qw)
    padded = qx.rowwise_scale_inv[:, :m].t()  # strides (1, pad4(M))
    try:
        got = torch.nn.functional.scaled_mm(a.data, b.data, padded, st.BlockWise1x128, b.scale,
                                            st.BlockWise128x128, output_dtype=torch.bfloat16)
        ok, row = compare("probe: scale_a with row stride pad4(M)", got, TF.dequantize(qx),
                          TF.dequantize(qw), "M=1001,K=512,N=256",
                          dict(stride=list(padded.stride())))
        emit(accepted=True, **as_finding(row))
    except Exception as e:  # noqa: BLE001
        emit(check="probe: scale_a with row stride pad4(M)", accepted=False,
             stride=list(padded.stride()), message=str(e).splitlines()[0][:300])
    # (2) torch._scaled_mm, K = 640 (L = 5, L4 = 8), compacted 128x128 scale.
    m, k, n = 256, 640, 256
    x, w = varied(m, k, gen, 1), varied(n, k, gen, 128) * 0.05
    qx = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, x, "1d"))
    qw = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, w, "2d"))
    a = TF.operand_a(qx, api="_scaled_mm")
    l = 5
    compact = qw.rowwise_scale_inv[:, :l].contiguous().t()  # [L, Nb] strides (1, L)
    bdata = qw.rowwise_data.view(torch.float8_e4m3fn).t()
    try:
        got = torch._scaled_mm(a.data, bdata, a.scale, compact, out_dtype=torch.bfloat16)
        ok, row = compare("probe: _scaled_mm, K=640, compacted 128x128 scale", got,
                          TF.dequantize(qx), TF.dequantize(qw), "M=256,K=640,N=256")
        emit(accepted=True, **as_finding(row))
    except Exception as e:  # noqa: BLE001
        emit(check="probe: _scaled_mm, K=640, compacted 128x128 scale", accepted=False,
             message=str(e).splitlines()[0][:300])
    # (3) E5M2: a e4m3 x b e5m2 and e5m2 x e4m3, both APIs.
    m, k, n = 256, 512, 256
    x, w = varied(m, k, gen, 1), varied(n, k, gen, 128) * 0.05
    for fa, fb in (("e4m3", "e5m2"), ("e5m2", "e4m3")):
        qx = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, x, "1d", fmt=fa))
        qw = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, w, "2d", fmt=fb))
        a = TF.operand_a(qx)
        b = TF.operand_b(qw)
        for api in ("scaled_mm", "_scaled_mm"):
            name = "probe: %s x %s via %s" % (fa, fb, api)
            try:
                if api == "scaled_mm":
                    got = torch.nn.functional.scaled_mm(
                        a.data, b.data, a.scale, st.BlockWise1x128, b.scale,
                        st.BlockWise128x128, output_dtype=torch.bfloat16)
                else:
                    a1, b1 = TF.operand_a(qx, api=api), TF.operand_b(qw, api=api)
                    got = torch._scaled_mm(a1.data, b1.data, a1.scale, b1.scale,
                                           out_dtype=torch.bfloat16)
                ok, row = compare(name, got, TF.dequantize(qx), TF.dequantize(qw),
                                  "M=256,K=512,N=256")
                emit(accepted=True, **as_finding(row))
            except Exception as e:  # noqa: BLE001
                emit(check=name, accepted=False, message=str(e).splitlines()[0][:300])
    # (4) the error messages of torch_fp8 for 2D x 2D and a non-multiple-of-16 K.
    qw2 = to_cuda(qtx_cli_io.cli_quantize(ARGS.qtx_cli, server.target, w, "2d"))
    try:
        TF.scaled_mm(qw2, qw2)
        fail("2d x 2d did not raise")
    except TF.UnsupportedGemm as e:
        emit(check="2d x 2d raises UnsupportedGemm", ok=True, message=str(e))


def main():
    global ARGS, TF
    p = argparse.ArgumentParser()
    p.add_argument("--qtxd", required=True)
    p.add_argument("--qtx_cli", required=True)
    p.add_argument("--python_dir", required=True, help="folder holding qtx/torch_fp8.py")
    p.add_argument("--qtxd_device", default="cpu")
    p.add_argument("--cases", default="256x512x256,1000x4096x2048,1001x4096x2048,"
                                      "4096x7168x4096,256x640x256,1000x640x2000")
    p.add_argument("--json", default="")
    ARGS = p.parse_args()
    TF = load_torch_fp8(ARGS.python_dir)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    env = dict(check="environment", torch=torch.__version__, cuda=torch.version.cuda,
               device=torch.cuda.get_device_name(0),
               capability=list(torch.cuda.get_device_capability(0)),
               has_F_scaled_mm=hasattr(torch.nn.functional, "scaled_mm"),
               scaling_type=repr(TF._scaling_type()), has__scaled_mm=hasattr(torch, "_scaled_mm"),
               api_auto=TF._pick_api("auto"), python=sys.version.split()[0])
    for mod in ("numpy", "grpc", "google.protobuf", "cupy"):
        try:
            importlib.import_module(mod)
            env[mod] = True
        except Exception:
            env[mod] = False
    emit(**env)
    gen = torch.Generator().manual_seed(13)
    with qtx_cli_io.Qtxd(ARGS.qtxd, ARGS.qtxd_device, cli=ARGS.qtx_cli) as server:
        for c in ARGS.cases.split(","):
            m, k, n = (int(v) for v in c.split("x"))
            try:
                run_case(server, m, k, n, gen)
            except Exception:  # noqa: BLE001
                fail("case crashed", case=c, trace=traceback.format_exc()[-1500:])
            torch.cuda.empty_cache()
        try:
            hybrid(server, gen)
        except Exception:  # noqa: BLE001
            fail("hybrid crashed", trace=traceback.format_exc()[-1500:])
        try:
            probes(server, gen)
        except Exception:  # noqa: BLE001
            fail("probes crashed", trace=traceback.format_exc()[-1500:])
    emit(check="summary", failures=FAILURES, ok=not FAILURES)
    return 1 if FAILURES else 0


ARGS = None
TF = None

if __name__ == "__main__":
    sys.exit(main())
