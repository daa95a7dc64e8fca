#!/usr/bin/python3
"""qtx.torch_fp8 on the CPU (Debian's torch 1.13: no float8 dtypes, no scaled_mm),
against a qtxd the test starts:

* operand layouts: for both PyTorch APIs and every operand role / block kind, the
  operands built from qtx.Client QuantizedTensors (uint8 data, as_float8=False) pass an
  independent transcription of ATen's shape/stride checks (ScaledBlas.cpp), are views of
  qtx's tensors (same storage) except in the documented copy case, and hold the right
  scale for every (row, block) — checked against qtx's layout formulas;
* an emulation of the GEMM that reads the operands the way PyTorch defines them
  (uint8 decoded by a numpy decoder written here) equals the FP64 matmul of qtxd's
  Dequantize outputs; a mis-laid scale makes it differ (the check can fail);
* torch_fp8.dequantize equals qtxd's Dequantize bit for bit; dequantized_mm and matmul's
  fallback path; UnsupportedGemm / ValueError for unsupported combinations;
* the qtx CLI's --save output (tests/python/qtx_cli_io.py, used by the GPU test) equals
  qtx.Client's bytes.

  /usr/bin/python3 tests/python/test_torch_fp8.py --qtxd=build/server/qtxd \
      --qtx_cli=build/client/cli/qtx --python_dir=build/client/python
"""

import argparse
import os
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import qtx_cli_io  # noqa: E402

ARGS = None
qtx = None
TF = None
SERVER = None
CLIENT = None


def cdiv(a, b):
    return -(-a // b)


def pad4(x):
    return (x + 3) // 4 * 4


def decode(data_u8, fmt):
    """float64 values of FP8 bytes (numpy uint8 array), by bit arithmetic."""
    b = data_u8.astype(np.int64)
    exp_bits, man_bits = (4, 3) if fmt == "e4m3" else (5, 2)
    bias = (1 << (exp_bits - 1)) - 1
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> man_bits) & ((1 << exp_bits) - 1)
    m = (b & ((1 << man_bits) - 1)).astype(np.float64)
    val = np.where(e == 0, m * 2.0 ** (1 - bias - man_bits),
                   (1.0 + m / (1 << man_bits)) * np.exp2(e - bias))
    if fmt == "e4m3":
        val = np.where((e == 15) & (m == 7), np.nan, val)
    else:
        val = np.where(e == 31, np.where(m == 0, np.inf, np.nan), val)
    return sign * val


# ---- ATen's checks, transcribed (aten/src/ATen/native/cuda/ScaledBlas.cpp) ----------------------


def size_stride(scale, dim, size, stride):
    return scale.shape[dim] == size and (size <= 1 or scale.stride(dim) == stride)


def v1_is_1x128(t_shape, scale):
    """is_blockwise_1x128_scaling(t, scale) of torch._scaled_mm."""
    return (scale.dtype == torch.float32 and scale.dim() == 2
            and size_stride(scale, 0, t_shape[0], 1)
            and size_stride(scale, 1, cdiv(t_shape[1], 128), t_shape[0]))


def v1_is_128x128(t_shape, scale):
    """is_blockwise_128x128_scaling(t, scale) of torch._scaled_mm."""
    return (scale.dtype == torch.float32 and scale.dim() == 2
            and size_stride(scale, 0, cdiv(t_shape[0], 128), cdiv(t_shape[1], 128))
            and size_stride(scale, 1, cdiv(t_shape[1], 128), 1))


def v1_accepts(recipe_a, a_shape, scale_a, recipe_b, b_shape, scale_b):
    """get_joint_scaling: a with scale_a, and b.t() with scale_b.t()."""
    bt = (b_shape[1], b_shape[0])
    ok_a = (v1_is_1x128 if recipe_a == "1x128" else v1_is_128x128)(a_shape, scale_a)
    ok_b = (v1_is_1x128 if recipe_b == "1x128" else v1_is_128x128)(bt, scale_b.t())
    return ok_a and ok_b


def v2_accepts(recipe_a, a_shape, scale_a, recipe_b, b_shape, scale_b):
    """The _scaled_block*_block* checks of torch.nn.functional.scaled_mm."""
    m, k = a_shape
    n = b_shape[1]
    l, l4 = cdiv(k, 128), pad4(cdiv(k, 128))

    def one_x_128(s, outer):
        return (tuple(s.shape) == (outer, l) and s.stride(0) == 1
                and (s.stride(1) == outer or (s.shape[1] == 1 and s.stride(1) == 1)))

    def tile(s, outer):
        return (tuple(s.shape) == (l4, cdiv(outer, 128)) and s.stride(0) == 1
                and (s.stride(1) == l4 or (s.shape[1] == 1 and s.stride(1) == 1)))

    ok_a = one_x_128(scale_a, m) if recipe_a == "1x128" else tile(scale_a, m)
    ok_b = one_x_128(scale_b, n) if recipe_b == "1x128" else tile(scale_b, n)
    return ok_a and ok_b and k % 16 == 0 and n % 16 == 0


# ---- the GEMM as PyTorch defines it, from the operands -----------------------------------------


def logical_scale(op, api, role, outer, k):
    """The operand's scale as an [outer, L] (1x128) or [ceil(outer/128), L] (128x128)
    float64 array, read through the API's documented index order."""
    s = op.scale.numpy().astype(np.float64)
    l = cdiv(k, 128)
    if op.recipe == "1x128":
        if api == "_scaled_mm" and role == "b":
            return s.T[:outer, :l]        # scale_b is [L, N]
        return s[:outer, :l]              # [M, L] / [N, L]
    if api == "_scaled_mm" and role == "a":
        return s[:, :l]                   # [Mb, L]
    return s.T[:, :l]                     # [L4, Ob] -> [Ob, L]


def emulate(a, b, api, m, k, n):
    """sum over K-blocks of (A_block @ B_block) * scale_a * scale_b, FP64."""
    a_val = decode(a.data.numpy(), a.format)               # [M, K]
    b_val = decode(b.data.t().contiguous().numpy(), b.format)  # [N, K]
    sa = logical_scale(a, api, "a", m, k)
    sb = logical_scale(b, api, "b", n, k)
    out = np.zeros((m, n))
    for blk in range(cdiv(k, 128)):
        cols = slice(128 * blk, min(k, 128 * blk + 128))
        part = a_val[:, cols] @ b_val[:, cols].T
        ra = sa[:, blk] if a.recipe == "1x128" else np.repeat(sa[:, blk], 128)[:m]
        rb = sb[:, blk] if b.recipe == "1x128" else np.repeat(sb[:, blk], 128)[:n]
        out += part * ra[:, None] * rb[None, :]
    return out


def varied(rows, cols, rng, tile_rows):
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    e = rng.integers(-3, 4, (cdiv(rows, tile_rows), cdiv(cols, 128)))
    mag = np.repeat(np.repeat(np.exp2(e), tile_rows, 0)[:rows], 128, 1)[:, :cols]
    return torch.from_numpy((x * mag).astype(np.float32))


def shares_storage(view, base):
    start = base.storage().data_ptr()
    end = start + base.storage().size() * base.element_size()
    return start <= view.data_ptr() < end


class LayoutTest(unittest.TestCase):
    """Operands of A @ B.T for every role, block kind and API."""

    def quantize(self, x, mode, **kw):
        return CLIENT.quantize(x, mode=mode, rowwise=True, columnwise=True, **kw)

    def check_gemm(self, qa, qb, ua, ub, api, expect_copy_a=False):
        a_stored = getattr(qa, ua + "_data")
        b_stored = getattr(qb, ub + "_data")
        m, k = a_stored.shape
        n = b_stored.shape[0]
        a, b = TF.gemm_operands(qa, qb, ua, ub, api=api, as_float8=False)
        name = "%s %s(%s) x %s(%s) M=%d K=%d N=%d" % (api, qa.mode, ua, qb.mode, ub, m, k, n)
        # Data: views, never copies; a row-major [M, K], b column-major [K, N].
        self.assertEqual(a.data.data_ptr(), a_stored.data_ptr(), name)
        self.assertEqual(tuple(a.data.shape), (m, k))
        self.assertEqual(tuple(a.data.stride()), (k, 1))
        self.assertEqual(b.data.data_ptr(), b_stored.data_ptr(), name)
        self.assertEqual(tuple(b.data.shape), (k, n))
        self.assertEqual(tuple(b.data.stride()), (1, k))
        # Scales: accepted by ATen's checks; views unless documented.
        accepts = v2_accepts if api == "scaled_mm" else v1_accepts
        self.assertTrue(accepts(a.recipe, (m, k), a.scale, b.recipe, (k, n), b.scale),
                        "%s: shapes %s %s strides %s %s" % (name, tuple(a.scale.shape),
                                                            tuple(b.scale.shape),
                                                            a.scale.stride(), b.scale.stride()))
        self.assertEqual(a.copied, expect_copy_a, name)
        self.assertFalse(b.copied, name)
        self.assertEqual(shares_storage(a.scale, getattr(qa, ua + "_scale_inv")),
                         not expect_copy_a, name)
        self.assertTrue(shares_storage(b.scale, getattr(qb, ub + "_scale_inv")), name)
        # Numbers: the GEMM as PyTorch reads the operands == FP64 matmul of qtxd's
        # dequantized operands (the same products and sums: FP64 rounding only).
        got = emulate(a, b, api, m, k, n)
        want = self.dequantized(qa, ua).astype(np.float64) @ \
            self.dequantized(qb, ub).astype(np.float64).T
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max(),
                                   err_msg=name)
        return a, b, got, want

    def dequantized(self, q, usage):
        """qtxd's Dequantize of the stored matrix of `usage` (numpy float32)."""
        if usage == "rowwise":
            return CLIENT.dequantize(q).numpy()
        # The columnwise copy of X is the rowwise quantization of X^T (1-D), or the
        # transpose of the rowwise copy (2-D): ask qtxd through that identity.
        if q.mode == "2d":
            return CLIENT.dequantize(q).numpy().T
        xt = self._source[id(q)].t().contiguous()
        qt = CLIENT.quantize(xt, mode="1d", rowwise=True)
        self.assertTrue(torch.equal(qt.rowwise_data, q.columnwise_data))
        self.assertTrue(torch.equal(qt.rowwise_scale_inv, q.columnwise_scale_inv))
        return CLIENT.dequantize(qt).numpy()

    def setUp(self):
        self._source = {}
        self.rng = np.random.default_rng(7)

    def pair(self, m, k, n):
        x = varied(m, k, self.rng, 1)
        w = varied(n, k, self.rng, 128) * 0.05
        qx, qw = self.quantize(x, "1d"), self.quantize(w, "2d")
        self._source[id(qx)] = x
        self._source[id(qw)] = w
        return qx, qw

    def test_fprop_1x128_by_128x128(self):
        # (M, K, N): aligned; M % 4 == 0 but not % 128; M % 4 != 0 (scale copy);
        # L = 5 (L4 = 8); a single K block.
        for m, k, n in ((256, 512, 256), (200, 1024, 384), (130, 512, 256), (131, 640, 144),
                        (4, 128, 16)):
            qx, qw = self.pair(m, k, n)
            copy = m % 4 != 0 and cdiv(k, 128) > 1
            self.check_gemm(qx, qw, "rowwise", "rowwise", "scaled_mm", expect_copy_a=copy)
            if cdiv(k, 128) % 4 == 0 or n <= 128:
                self.check_gemm(qx, qw, "rowwise", "rowwise", "_scaled_mm", expect_copy_a=copy)
            else:
                with self.assertRaisesRegex(TF.UnsupportedGemm, "multiple of 512"):
                    TF.gemm_operands(qx, qw, api="_scaled_mm", as_float8=False)

    def test_dgrad_wgrad_and_2d_as_a(self):
        m, k, n = 256, 512, 384
        qx, qw = self.pair(m, k, n)
        dy = varied(m, n, self.rng, 1)
        qdy = self.quantize(dy, "1d")
        self._source[id(qdy)] = dy
        for api in ("scaled_mm", "_scaled_mm"):
            # dgrad dY W: W's columnwise copy [K, N] is B; contraction over N = 384 (L = 3).
            if api == "scaled_mm":
                self.check_gemm(qdy, qw, "rowwise", "columnwise", api)
            else:
                with self.assertRaises(TF.UnsupportedGemm):
                    TF.gemm_operands(qdy, qw, "rowwise", "columnwise", api=api, as_float8=False)
            # wgrad-shaped dY^T X: both columnwise 1x128 copies; contraction over M.
            self.check_gemm(qdy, qx, "columnwise", "columnwise", api)
            # 128x128 x 1x128: W X^T.
            self.check_gemm(qw, qx, "rowwise", "rowwise", api)

    def test_mislaid_scale_changes_the_result(self):
        qx, qw = self.pair(256, 512, 256)
        a, b, got, want = self.check_gemm(qx, qw, "rowwise", "rowwise", "scaled_mm")
        # Reading qtx's [L, M] scale as if it were [M, L] row-major (no transpose) —
        # the mistake the layout mapping exists to avoid — must change the numbers.
        s = qx.rowwise_scale_inv
        wrong = s.reshape(-1)[: 256 * 4].reshape(256, 4)[:, :4]
        bad = TF.Operand(a.data, wrong, a.recipe, a.format, False)
        self.assertFalse(v2_accepts("1x128", (256, 512), wrong, "128x128", (512, 256), b.scale))
        bad_out = emulate(bad, b, "scaled_mm", 256, 512, 256)
        rel = np.linalg.norm(bad_out - want) / np.linalg.norm(want)
        self.assertGreater(rel, 0.1)

    def test_uncompacted_padded_scale_is_rejected(self):
        # M % 4 != 0: qtx's row stride pad4(M) is not what ATen accepts: the copy is needed.
        qx, qw = self.pair(131, 512, 256)
        s = qx.rowwise_scale_inv
        self.assertEqual(tuple(s.shape), (4, 132))
        padded = s[:, :131].t()
        b = TF.operand_b(qw, as_float8=False)
        self.assertFalse(v2_accepts("1x128", (131, 512), padded, "128x128", (512, 256), b.scale))
        self.assertFalse(v1_accepts("1x128", (131, 512), padded, "128x128", (512, 256),
                                    TF.operand_b(qw, api="_scaled_mm", as_float8=False).scale))
        a = TF.operand_a(qx, as_float8=False)
        self.assertTrue(a.copied)
        self.assertEqual(tuple(a.scale.stride()), (1, 131))
        self.assertTrue(torch.equal(a.scale, padded))


class ErrorsTest(unittest.TestCase):
    def test_unsupported(self):
        rng = np.random.default_rng(3)
        x = varied(64, 256, rng, 1)
        w = varied(64, 256, rng, 128)
        q2a = CLIENT.quantize(x, mode="2d")
        q2b = CLIENT.quantize(w, mode="2d")
        with self.assertRaisesRegex(TF.UnsupportedGemm, "2D x 2D"):
            TF.check_supported(q2a, q2b)
        q1 = CLIENT.quantize(x, mode="1d")
        q5 = CLIENT.quantize(w, mode="2d", format="e5m2")
        q15 = CLIENT.quantize(x, mode="1d", format="e5m2")
        with self.assertRaisesRegex(TF.UnsupportedGemm, "e5m2 x e5m2"):
            TF.check_supported(q15, q5)
        with self.assertRaisesRegex(TF.UnsupportedGemm, "(e4m3 x e4m3 only|float8)"):
            TF.check_supported(q1, q5, api="scaled_mm")
        with self.assertRaisesRegex(TF.UnsupportedGemm, "M = 102 .* not a multiple of 4"):
            TF.check_supported(CLIENT.quantize(varied(102, 256, rng, 1), mode="1d"), q2b)
        with self.assertRaisesRegex(TF.UnsupportedGemm, "M = 100 .* not a multiple of 8"):
            TF.check_supported(CLIENT.quantize(varied(100, 256, rng, 128), mode="2d"),
                               CLIENT.quantize(varied(64, 256, rng, 1), mode="1d"))
        with self.assertRaisesRegex(ValueError, "api="):
            TF.check_supported(q1, q2b, api="cublas")
        odd = CLIENT.quantize(varied(64, 200, rng, 1), mode="1d")
        oddw = CLIENT.quantize(varied(64, 200, rng, 128), mode="2d")
        with self.assertRaisesRegex(TF.UnsupportedGemm, "multiples of 16"):
            TF.check_supported(odd, oddw)
        with self.assertRaisesRegex(ValueError, "same K"):
            TF.check_supported(q1, oddw)
        with self.assertRaisesRegex(ValueError, "no columnwise copy"):
            TF.check_supported(q1, q2b, "columnwise")
        # Debian's torch 1.13: no float8 dtypes -> the FP8 GEMM is refused, clearly.
        if not TF.has_float8():
            with self.assertRaisesRegex(TF.UnsupportedGemm, "float8"):
                TF.scaled_mm(q1, q2b)
        else:  # a torch with float8 on a CPU-only host: the device is refused
            with self.assertRaisesRegex(TF.UnsupportedGemm, "CUDA"):
                TF.scaled_mm(q1, q2b)
        with self.assertRaisesRegex(ValueError, "out_dtype"):
            TF.scaled_mm(q1, q2b, out_dtype=torch.float16)
        bad = TF.QuantizedView(q1.shape, "1d", "e4m3", q1.rowwise_data,
                               q1.rowwise_scale_inv[:, :-4])
        with self.assertRaisesRegex(ValueError, "qtx's 1d layout"):
            TF.operand_a(bad, as_float8=False)


class DequantizeTest(unittest.TestCase):
    def test_bit_exact_with_qtxd(self):
        rng = np.random.default_rng(11)
        for shape in ((200, 300), (130, 130), (256, 1024), (1, 5)):
            x = varied(shape[0], shape[1], rng, 1)
            for mode in ("1d", "2d"):
                for fmt in ("e4m3", "e5m2"):
                    q = CLIENT.quantize(x, mode=mode, format=fmt, rowwise=True, columnwise=True)
                    want = CLIENT.dequantize(q)
                    got = TF.dequantize(q)
                    self.assertTrue(torch.equal(got.view(torch.int32), want.view(torch.int32)),
                                    "%s %s %s" % (shape, mode, fmt))
                    # Independent decode of the columnwise copy.
                    col = TF.dequantize(q, "columnwise").numpy()
                    s = q.columnwise_scale_inv.numpy().astype(np.float64)
                    vals = decode(q.columnwise_data.numpy(), fmt)
                    n, m = vals.shape
                    r, c = np.arange(n)[:, None], np.arange(m)[None, :]
                    sc = s[c // 128, r] if mode == "1d" else s[r // 128, c // 128]
                    np.testing.assert_array_equal(col, (vals * sc).astype(np.float32))
                    self.assertEqual(TF.dequantize(q, dtype=torch.bfloat16).dtype,
                                     torch.bfloat16)

    def test_dequantized_mm_and_matmul_fallback(self):
        rng = np.random.default_rng(5)
        x = varied(96, 384, rng, 1)
        w = varied(48, 384, rng, 128)
        qx = CLIENT.quantize(x, mode="1d")
        qw = CLIENT.quantize(w, mode="2d")
        ref = CLIENT.dequantize(qx).double() @ CLIENT.dequantize(qw).double().t()
        out32 = TF.dequantized_mm(qx, qw, torch.float32)
        self.assertEqual(tuple(out32.shape), (96, 48))
        rel = ((out32.double() - ref).norm() / ref.norm()).item()
        self.assertLess(rel, 1e-6)
        out16 = TF.dequantized_mm(qx, qw)
        self.assertEqual(out16.dtype, torch.bfloat16)
        self.assertTrue(torch.equal(out16, out32.to(torch.bfloat16)))
        got, path = TF.matmul(qx, qw)
        self.assertTrue(path.startswith("dequantized: "), path)
        self.assertIn("float8" if not TF.has_float8() else "CUDA", path)
        self.assertTrue(torch.equal(got, out16))
        # and the same through CPU -> CPU to_device (a copy with the same layout)
        moved = TF.to_device(qx, "cpu")
        self.assertTrue(torch.equal(TF.dequantized_mm(moved, qw), out16))


class CliSaveTest(unittest.TestCase):
    def test_cli_save_matches_client(self):
        rng = np.random.default_rng(9)
        x = varied(130, 300, rng, 1)
        for mode in ("1d", "2d"):
            q = qtx_cli_io.cli_quantize(ARGS.qtx_cli, SERVER.target, x, mode, rowwise=True,
                                        columnwise=True)
            want = CLIENT.quantize(x, mode=mode, rowwise=True, columnwise=True)
            for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                      "columnwise_scale_inv"):
                self.assertTrue(torch.equal(getattr(q, f), getattr(want, f)), "%s %s" % (mode, f))
            self.assertTrue(torch.equal(q.dequantized, CLIENT.dequantize(want)))
        # The npy writer/reader round trip (uint8 and float32).
        with tempfile.TemporaryDirectory() as d:
            for t in (torch.arange(12, dtype=torch.uint8).reshape(3, 4), x):
                qtx_cli_io.write_npy(os.path.join(d, "t.npy"), t)
                self.assertTrue(torch.equal(qtx_cli_io.read_npy(os.path.join(d, "t.npy")), t))
                np.testing.assert_array_equal(np.load(os.path.join(d, "t.npy")), t.numpy())


def main():
    global ARGS, qtx, TF, SERVER, CLIENT
    parser = argparse.ArgumentParser()
    parser.add_argument("--qtxd", required=True)
    parser.add_argument("--qtx_cli", required=True)
    parser.add_argument("--python_dir", required=True, help="build dir of the qtx package")
    ARGS, rest = parser.parse_known_args()
    sys.path.insert(0, ARGS.python_dir)
    import qtx as qtx_pkg
    from qtx import torch_fp8
    qtx, TF = qtx_pkg, torch_fp8
    with qtx_cli_io.Qtxd(ARGS.qtxd, "cpu", cli=ARGS.qtx_cli) as server:
        SERVER = server
        with qtx.Client(server.target) as client:
            CLIENT = client
            prog = unittest.main(argv=[sys.argv[0]] + rest, verbosity=2, exit=False)
    sys.exit(0 if prog.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
