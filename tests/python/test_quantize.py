#!/usr/bin/python3
"""Python client test: the generated qtx.v1 stubs against a running qtxd.

Starts qtxd on a temporary unix socket, quantizes through the generated stubs
and checks the FP8 bytes with a decoder written here with numpy (independent
of the C++ kernels): E4M3/E5M2 decode, dequantization error within half an FP8
step of each element's block, power-of-two scale_inv with amax*scale in
(max/2, max], zeroed padding, GEMM-ready layouts; plus error statuses.

  /usr/bin/python3 tests/python/test_quantize.py --qtxd=build/server/qtxd \
      --python_dir=build/client/python
"""

import argparse
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

import qtxd_child

ARGS = None
qtx = None  # the package, imported once --python_dir is on sys.path
SERVER = None  # qtxd_child.Child
TMP = None

E4M3_MAX = 448.0
E5M2_MAX = 57344.0


# ---- independent FP8 decoding -------------------------------------------------------------------


def fp8_table(exp_bits, man_bits):
    """float64 value of every byte 0..255 of an FP8 format (e4m3fn or e5m2)."""
    bias = (1 << (exp_bits - 1)) - 1
    table = np.empty(256, dtype=np.float64)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        e = (byte >> man_bits) & ((1 << exp_bits) - 1)
        m = byte & ((1 << man_bits) - 1)
        if exp_bits == 4 and e == 15 and m == 7:
            v = np.nan  # e4m3fn: only S.1111.111 is NaN, no Inf
        elif exp_bits == 5 and e == 31:
            v = np.inf if m == 0 else np.nan
        elif e == 0:
            v = m / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        table[byte] = sign * v
    return table


E4M3 = fp8_table(4, 3)
E5M2 = fp8_table(5, 2)


def fp8_step(a, fmt):
    """Spacing of the FP8 grid in the binade of |a| (float64 array)."""
    man_bits, min_exp = (3, -6) if fmt == "e4m3" else (2, -14)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.abs(a)))
    e = np.where(np.isfinite(e), np.maximum(e, min_exp), min_exp)
    return 2.0 ** (e - man_bits)


def pad4(x):
    return (x + 3) // 4 * 4


def cdiv(a, b):
    return -(-a // b)


# ---- server -------------------------------------------------------------------------------------


def setUpModule():
    global SERVER, TMP
    TMP = tempfile.mkdtemp(prefix="qtx-py-")

    def ready(target):
        with qtx.channel(target) as ch:
            qtx.memory_pb2_grpc.MemoryStub(ch).ListRegions(
                qtx.memory_pb2.ListRegionsRequest(), timeout=2)
        return True
    SERVER = qtxd_child.start(ARGS.qtxd, TMP, ["--device=cpu", "--allow_client_shm"], probe=ready)


def tearDownModule():
    try:
        code = SERVER.stop(timeout=20)
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
    if code != 0:
        raise AssertionError("qtxd exited with %d after SIGTERM" % code)


# ---- tests --------------------------------------------------------------------------------------


class QuantizeTest(unittest.TestCase):
    def setUp(self):
        self.channel = qtx.channel(SERVER.target)
        self.quantizer = qtx.quantizer_pb2_grpc.QuantizerStub(self.channel)
        self.memory = qtx.memory_pb2_grpc.MemoryStub(self.channel)
        self.t = qtx.tensor_pb2
        self.q = qtx.quantizer_pb2

    def tearDown(self):
        self.channel.close()

    def tensor(self, x):
        dtype = {np.dtype("<f4"): self.t.FLOAT32, np.dtype("<f2"): self.t.FLOAT16}[x.dtype]
        return self.t.TensorRef(dtype=dtype, shape=list(x.shape),
                                inline_data=np.ascontiguousarray(x).tobytes())

    def quantize(self, x, mode, fmt, rowwise=True, columnwise=True, pow2=True):
        cfg = self.q.QuantizeConfig(
            scaling_mode=self.q.BLOCK_2D if mode == "2d" else self.q.BLOCK_1D,
            format=self.q.E5M2 if fmt == "e5m2" else self.q.E4M3,
            rowwise=rowwise, columnwise=columnwise, force_pow2_scales=pow2)
        return self.quantizer.Quantize(
            self.q.QuantizeRequest(input=self.tensor(x), config=cfg), timeout=60).result

    def check_copy(self, x, data_ref, scale_ref, mode, fmt, columnwise):
        """Checks one copy (rowwise or columnwise) of quantize(x) independently."""
        m, n = x.shape
        table, fmax = (E4M3, E4M3_MAX) if fmt == "e4m3" else (E5M2, E5M2_MAX)
        want_dtype = self.t.FLOAT8_E4M3 if fmt == "e4m3" else self.t.FLOAT8_E5M2
        self.assertEqual(data_ref.dtype, want_dtype)
        self.assertEqual(scale_ref.dtype, self.t.FLOAT32)
        if mode == "1d":
            want_scale_shape = [cdiv(m, 128), pad4(n)] if columnwise else [cdiv(n, 128), pad4(m)]
        else:
            want_scale_shape = ([cdiv(n, 128), pad4(cdiv(m, 128))] if columnwise
                                else [cdiv(m, 128), pad4(cdiv(n, 128))])
        self.assertEqual(list(scale_ref.shape), want_scale_shape)
        data = np.frombuffer(data_ref.inline_data, dtype=np.uint8)
        scales = np.frombuffer(scale_ref.inline_data, dtype="<f4").reshape(want_scale_shape)
        # Bring data and scales to x's [m, n] orientation.
        if columnwise:
            self.assertEqual(list(data_ref.shape), [n, m])
            q = table[data.reshape(n, m)].T
        else:
            self.assertEqual(list(data_ref.shape), [m, n])
            q = table[data.reshape(m, n)]
        rows, cols = np.arange(m)[:, None], np.arange(n)[None, :]
        if mode == "1d" and not columnwise:      # Sr[n/128, m]
            s_inv = scales[cols // 128, rows]
            valid = scales[:, :m]
            padding = scales[:, m:]
            block_id = (cols // 128) * m + rows
        elif mode == "1d":                       # Sc[m/128, n]
            s_inv = scales[rows // 128, cols]
            valid = scales[:, :n]
            padding = scales[:, n:]
            block_id = (rows // 128) * n + cols
        elif not columnwise:                     # Sr[m/128, n/128]
            s_inv = scales[rows // 128, cols // 128]
            valid = scales[:, :cdiv(n, 128)]
            padding = scales[:, cdiv(n, 128):]
            block_id = (rows // 128) * cdiv(n, 128) + cols // 128
        else:                                    # Sc[n/128, m/128]
            s_inv = scales[cols // 128, rows // 128]
            valid = scales[:, :cdiv(m, 128)]
            padding = scales[:, cdiv(m, 128):]
            block_id = (rows // 128) * cdiv(n, 128) + cols // 128
        self.assertTrue(np.all(padding == 0), "scale padding must be 0")

        # scale_inv: positive powers of two.
        mant, _ = np.frexp(valid.astype(np.float64))
        self.assertTrue(np.all(valid > 0) and np.all(mant == 0.5),
                        "scale_inv not powers of two: %s" % valid[mant != 0.5][:5])

        # amax * scale in (max/2, max] for every block with a non-zero amax.
        x64 = x.astype(np.float64)
        ids = block_id.astype(np.int64).ravel()
        amax = np.zeros(ids.max() + 1)
        np.maximum.at(amax, ids, np.abs(x64).ravel())
        sinv_block = np.zeros(ids.max() + 1)
        sinv_block[ids] = s_inv.astype(np.float64).ravel()
        nz = amax > 0
        ratio = amax[nz] / sinv_block[nz]
        self.assertTrue(np.all(ratio > fmax / 2) and np.all(ratio <= fmax * (1 + 2**-20)),
                        "amax*scale outside (max/2, max]: %s" % ratio[(ratio <= fmax / 2) |
                                                                      (ratio > fmax)][:5])

        # Every element within half an FP8 step of x*scale (round to nearest).
        y = x64 / s_inv.astype(np.float64)
        err = np.abs(y - q)
        bound = 0.5 * fp8_step(np.maximum(np.abs(y), np.abs(q)), fmt) * (1 + 1e-6)
        worst = np.argmax(err - bound)
        self.assertTrue(np.all(err <= bound),
                        "element %s: x*scale=%r decoded %r" % (np.unravel_index(worst, y.shape),
                                                              y.ravel()[worst], q.ravel()[worst]))
        return q.astype(np.float32) * s_inv.astype(np.float32)  # the dequantized copy

    def test_block1d_e4m3_fp32(self):
        rng = np.random.default_rng(1)
        x = (rng.standard_normal((200, 300)) * np.exp(rng.uniform(-6, 6, (200, 1)))).astype("<f4")
        r = self.quantize(x, "1d", "e4m3")
        self.assertEqual(list(r.shape), [200, 300])
        self.assertEqual(r.source_dtype, self.t.FLOAT32)
        xhat = self.check_copy(x, r.rowwise_data, r.rowwise_scale_inv, "1d", "e4m3", False)
        self.check_copy(x, r.columnwise_data, r.columnwise_scale_inv, "1d", "e4m3", True)
        # The server's dequantization equals ours, bit for bit.
        out = self.quantizer.Dequantize(
            self.q.DequantizeRequest(input=r, output_dtype=self.t.FLOAT32), timeout=60).output
        self.assertEqual(list(out.shape), [200, 300])
        got = np.frombuffer(out.inline_data, dtype="<f4").reshape(200, 300)
        np.testing.assert_array_equal(got, xhat)

    def test_block2d_e5m2_fp16(self):
        rng = np.random.default_rng(2)
        x = (rng.standard_normal((130, 257)) * 50).astype("<f2")
        r = self.quantize(x, "2d", "e5m2")
        self.assertEqual(r.source_dtype, self.t.FLOAT16)
        self.check_copy(x, r.rowwise_data, r.rowwise_scale_inv, "2d", "e5m2", False)
        self.check_copy(x, r.columnwise_data, r.columnwise_scale_inv, "2d", "e5m2", True)
        # 2-D: the columnwise copy is the byte transpose of the rowwise copy.
        rd = np.frombuffer(r.rowwise_data.inline_data, np.uint8).reshape(130, 257)
        cd = np.frombuffer(r.columnwise_data.inline_data, np.uint8).reshape(257, 130)
        np.testing.assert_array_equal(rd.T, cd)

    def test_block1d_e5m2_with_zero_rows_and_small_values(self):
        x = np.zeros((3, 129), dtype="<f4")
        x[1, :] = np.linspace(-1e-3, 1e-3, 129, dtype=np.float32)
        x[2, 5] = 7.0
        r = self.quantize(x, "1d", "e5m2", rowwise=True, columnwise=False)
        self.assertFalse(r.HasField("columnwise_data"))
        self.check_copy(x, r.rowwise_data, r.rowwise_scale_inv, "1d", "e5m2", False)

    def test_shm_region_input(self):
        from multiprocessing import shared_memory
        rng = np.random.default_rng(3)
        x = rng.standard_normal((64, 256)).astype("<f4")
        shm = shared_memory.SharedMemory(create=True, size=x.nbytes)
        try:
            np.ndarray(x.shape, dtype=x.dtype, buffer=shm.buf)[:] = x
            name = "py-shm-%d" % os.getpid()
            self.memory.RegisterRegion(qtx.memory_pb2.RegisterRegionRequest(
                name=name, shm=qtx.memory_pb2.ShmRegion(shm_name="/" + shm.name,
                                                        byte_size=x.nbytes)), timeout=10)
            listed = self.memory.ListRegions(qtx.memory_pb2.ListRegionsRequest(), timeout=10)
            self.assertIn(name, [g.name for g in listed.regions])
            ref = self.t.TensorRef(dtype=self.t.FLOAT32, shape=[64, 256],
                                   region=self.t.RegionSlice(region=name, offset=0,
                                                             size=x.nbytes))
            r = self.quantizer.Quantize(self.q.QuantizeRequest(input=ref), timeout=60).result
            self.check_copy(x, r.rowwise_data, r.rowwise_scale_inv, "1d", "e4m3", False)
            inline = self.quantize(x, "1d", "e4m3", columnwise=False)
            self.assertEqual(r.rowwise_data.inline_data, inline.rowwise_data.inline_data)
            self.memory.UnregisterRegion(qtx.memory_pb2.UnregisterRegionRequest(name=name),
                                         timeout=10)
        finally:
            shm.close()
            shm.unlink()

    def test_bad_inputs_get_statuses(self):
        import grpc
        bad = self.t.TensorRef(dtype=self.t.FLOAT32, shape=[2, 3], inline_data=b"\0" * 16)
        with self.assertRaises(grpc.RpcError) as cm:
            self.quantizer.Quantize(self.q.QuantizeRequest(input=bad), timeout=10)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertTrue(cm.exception.details())
        missing = self.t.TensorRef(dtype=self.t.FLOAT32, shape=[1, 4],
                                   region=self.t.RegionSlice(region="py-no-such", size=16))
        with self.assertRaises(grpc.RpcError) as cm:
            self.quantizer.Quantize(self.q.QuantizeRequest(input=missing), timeout=10)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn("py-no-such", cm.exception.details())


class DecoderSelfTest(unittest.TestCase):
    """The decoder used above, on the values docs/numerics.md §1 fixes."""

    def test_known_bytes(self):
        self.assertEqual(E4M3[0x7E], 448.0)
        self.assertEqual(E4M3[0x38], 1.0)
        self.assertEqual(E4M3[0x01], 2.0**-9)
        self.assertTrue(np.isnan(E4M3[0x7F]) and np.isnan(E4M3[0xFF]))
        self.assertEqual(E4M3[0xFE], -448.0)
        self.assertEqual(E5M2[0x7B], 57344.0)
        self.assertEqual(E5M2[0x3C], 1.0)
        self.assertEqual(E5M2[0x01], 2.0**-16)
        self.assertEqual(E5M2[0x7C], np.inf)
        self.assertTrue(np.isnan(E5M2[0x7D]))
        self.assertEqual(fp8_step(np.array([1.0]), "e4m3")[0], 0.125)
        self.assertEqual(fp8_step(np.array([0.0]), "e5m2")[0], 2.0**-16)


def main():
    global ARGS, qtx
    parser = argparse.ArgumentParser()
    parser.add_argument("--qtxd", required=True)
    parser.add_argument("--python_dir", required=True, help="build dir of the qtx package")
    ARGS, rest = parser.parse_known_args()
    sys.path.insert(0, ARGS.python_dir)
    import qtx as qtx_pkg
    qtx = qtx_pkg
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
