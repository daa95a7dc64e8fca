#!/usr/bin/env python3
"""qtx.cuda on one GPU, with PyTorch (>= 2.1) and CuPy (CTest label gpu).

Starts two qtxd: one on cuda:0 (--allow_client_shm) that the tests call
through qtx.cuda, and one on the CPU that computes the reference bytes
through the C++ client's plain inline Quantize (the CPU path is the
definition of correct; the GPU results must match it bit for bit).

  python3 tests/python/gpu_test_cuda.py --qtxd=build/server/qtxd \
      --python_dir=build/client/python
(CUDA_MODULE_LOADING=EAGER: the test parks its streams on qtxd.)
"""

import argparse
import os
import signal
import sys
import tempfile
import unittest

import numpy as np

import qtxd_child

ARGS = None
qtx = qcuda = torch = cupy = None
SERVERS = {}


def serving(target):
    """qtxd_child's probe: the C++ client's health check (no grpcio needed)."""
    return qcuda._native.Session(target, "host", "probe", 2.0).health() == "SERVING"


def start_qtxd(name, extra):
    """A qtxd named `name` (its log in the test's temporary folder), once
    SERVING; stopped by tearDownModule, killed with the test process."""
    child = qtxd_child.start(ARGS.qtxd, SERVERS["tmp"], extra, probe=serving, name=name,
                             timeout=60, log=os.path.join(SERVERS["tmp"], name + ".log"))
    SERVERS[name + "_proc"] = child
    return child.target


def setUpModule():
    global qtx, qcuda, torch, cupy
    sys.path.insert(0, ARGS.python_dir)
    import qtx as _qtx
    import qtx.cuda as _qcuda
    import torch as _torch
    import cupy as _cupy
    qtx, qcuda, torch, cupy = _qtx, _qcuda, _torch, _cupy
    SERVERS["tmp"] = tempfile.mkdtemp(prefix="qtx-pygpu-")
    SERVERS["gpu"] = start_qtxd("gpu", ["--device=cuda:0", "--allow_client_shm"])
    SERVERS["ref"] = qcuda._native.Session(start_qtxd("cpu", ["--device=cpu"]), "host", "ref",
                                           60.0)


def tearDownModule():
    # Every qtxd the test started (the GPU run of 2026-12-01 kept the GPU one
    # alive: its Popen was overwritten, and MPS then waited for it).
    for name in [k for k in SERVERS if k.endswith("_proc")]:
        SERVERS.pop(name).stop(timeout=10)


# ---- helpers ----------------------------------------------------------------------------------

DT = {"float32": 1, "bfloat16": 2, "float16": 3}


def host_bytes(x):
    """The bytes of a torch or CuPy tensor (a test-side copy)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().contiguous()
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        return x.cpu().numpy().tobytes()
    return cupy.asnumpy(x).tobytes()


def dtype_name(x):
    if isinstance(x, torch.Tensor):
        return str(x.dtype).replace("torch.", "")
    return str(x.dtype)


def reference(x, mode="1d", fmt="e4m3", rowwise=True, columnwise=True, pow2=True, eps=0.0):
    """{field: bytes} from the CPU qtxd for the same input bytes."""
    r = SERVERS["ref"].quantize_host(host_bytes(x), DT[dtype_name(x)], list(x.shape),
                                     {"1d": 1, "2d": 2, "tensor": 3}[mode],
                                     {"e4m3": 1, "e5m2": 2}[fmt],
                                     rowwise, columnwise, pow2, eps)
    return {k: bytes(v[0]) for k, v in r.items()}


def assert_matches(tc, q, ref, label):
    for f, want in ref.items():
        got = getattr(q, f)
        tc.assertIsNotNone(got, "%s: %s missing" % (label, f))
        gb = host_bytes(got)
        if gb != want:
            a, b = np.frombuffer(gb, np.uint8), np.frombuffer(want, np.uint8)
            bad = np.flatnonzero(a != b) if a.size == b.size else []
            tc.fail("%s: %s differs from the CPU reference (%d of %d bytes, first at %s)"
                    % (label, f, len(bad), b.size, bad[:5]))


def fp8_table(exp_bits, man_bits):
    bias = (1 << (exp_bits - 1)) - 1
    out = np.empty(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> man_bits) & ((1 << exp_bits) - 1), b & ((1 << man_bits) - 1)
        if exp_bits == 4 and e == 15 and m == 7:
            v = np.nan
        elif exp_bits == 5 and e == 31:
            v = np.inf if m == 0 else np.nan
        elif e == 0:
            v = m / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        out[b] = sign * v
    return out


TABLES = {"e4m3": fp8_table(4, 3), "e5m2": fp8_table(5, 2)}


def numpy_dequantize(q, which):
    """float32 [M, N] from the qtx bytes (docs/numerics.md §4.1 layouts)."""
    m = int(np.prod(q.shape[:-1]))
    n = q.shape[-1]
    data = np.frombuffer(host_bytes(getattr(q, which + "_data")), np.uint8)
    scale = np.frombuffer(host_bytes(getattr(q, which + "_scale_inv")), np.float32)
    lay = qcuda.layout(q.shape, q.mode)
    scale = scale.reshape(lay[which + "_scale_inv"])
    vals = TABLES[q.format][data]
    if q.mode == "tensor":  # one scale for the whole tensor (docs/numerics.md §9)
        vals = (vals * scale[0]).astype(np.float32)
        return vals.reshape(m, n) if which == "rowwise" else vals.reshape(n, m).T.copy()
    if which == "rowwise":
        vals = vals.reshape(m, n)
        i, j = np.meshgrid(np.arange(m), np.arange(n), indexing="ij")
        s = scale[j // 128, i] if q.mode == "1d" else scale[i // 128, j // 128]
        return (vals * s).astype(np.float32)
    vals = vals.reshape(n, m)  # [N, M]
    c, r = np.meshgrid(np.arange(n), np.arange(m), indexing="ij")
    s = scale[r // 128, c] if q.mode == "1d" else scale[c // 128, r // 128]
    return (vals * s).astype(np.float32).T.copy()


def session(**kw):
    return qcuda.Session(SERVERS["gpu"], **kw)


# ---- tests ------------------------------------------------------------------------------------


class TorchQuantizeTest(unittest.TestCase):
    def test_bit_exact_vs_cpu(self):
        g = torch.Generator(device="cuda").manual_seed(1)
        cases = [((256, 1024), torch.bfloat16, "1d", "e4m3"),
                 ((3, 100, 384), torch.float32, "1d", "e5m2"),
                 ((130, 260), torch.float16, "2d", "e4m3"),
                 ((512, 640), torch.bfloat16, "2d", "e5m2"),
                 ((300, 520), torch.bfloat16, "tensor", "e4m3"),
                 ((3, 100, 384), torch.float32, "tensor", "e5m2")]
        for alloc in ("framework", "pool"):
            self.check_bit_exact(g, cases, alloc)

    def check_bit_exact(self, g, cases, alloc):
        with session(allocator=alloc) as s:
            for k, (shape, dt, mode, fmt) in enumerate(cases):
                x = (torch.randn(shape, device="cuda", generator=g) * (10 ** (k - 2))).to(dt)
                ref = reference(x, mode, fmt)
                q = s.quantize(x, mode=mode, format=fmt, columnwise=True)
                self.assertIsInstance(q.rowwise_data, torch.Tensor)
                self.assertEqual(q.rowwise_data.dtype, torch.uint8)
                self.assertEqual(q.rowwise_scale_inv.dtype, torch.float32)
                if mode == "tensor":  # the [1] of docs/numerics.md §9, not [1, 1]
                    self.assertEqual(tuple(q.rowwise_scale_inv.shape), (1,))
                    self.assertEqual(tuple(q.columnwise_scale_inv.shape), (1,))
                # Where the outputs came from: the session's pool, or PyTorch's allocator.
                chunks = [(c.ptr, c.ptr + c.nbytes) for c in s.pool._chunks]
                in_pool = any(lo <= q.rowwise_data.data_ptr() < hi for lo, hi in chunks)
                self.assertEqual(in_pool, alloc == "pool")
                self.assertEqual(q._framework_alloc, alloc == "framework")
                assert_matches(self, q, ref, "%s %s %s %s %s" % (alloc, shape, dt, mode, fmt))
                # The same into caller tensors full of 0xFF: padding must be rewritten.
                lay = qcuda.layout(shape, mode)
                out = {f: torch.full(lay[f], -1 if "scale" in f else 255,
                                     dtype=torch.float32 if "scale" in f else torch.uint8,
                                     device="cuda") for f in qcuda.FIELDS}
                q2 = s.quantize(x, mode=mode, format=fmt, columnwise=True, out=out)
                for f in qcuda.FIELDS:
                    self.assertIs(getattr(q2, f), out[f])
                assert_matches(self, q2, ref, "out= %s %s" % (shape, dt))
            x = torch.randn(256, 512, device="cuda", generator=g)
            q = s.quantize(x, pow2_scales=False, amax_epsilon=1e-3)
            assert_matches(self, q, reference(x, "1d", "e4m3", True, False, False, 1e-3),
                           "pow2=False eps=1e-3 " + alloc)
            # TransformerEngine's current-scaling bytes: scales not rounded to powers of 2.
            q = s.quantize(x, mode="tensor", pow2_scales=False, columnwise=True)
            assert_matches(self, q, reference(x, "tensor", "e4m3", True, True, False),
                           "tensor pow2=False " + alloc)
            # float8 out= views and the stream= argument take the same fast path.
            lay = qcuda.layout((256, 512))
            out = {"rowwise_data": torch.empty(lay["rowwise_data"], dtype=torch.float8_e4m3fn,
                                               device="cuda"),
                   "rowwise_scale_inv": torch.empty(lay["rowwise_scale_inv"], device="cuda")}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            q = s.quantize(x, out=out, stream=side)
            self.assertEqual(q.stream, side.cuda_stream)
            self.assertIs(q.rowwise_data, out["rowwise_data"])
            torch.cuda.current_stream().wait_stream(side)
            chk = qcuda.QuantizedTensor((256, 512), "1d", "e4m3",
                                        rowwise_data=q.rowwise_data.view(torch.uint8),
                                        rowwise_scale_inv=q.rowwise_scale_inv)
            assert_matches(self, chk, reference(x, "1d", "e4m3", True, False),
                           "fp8 out= " + alloc)
            # Pooled outputs on a stream that is not the current one.
            q = s.quantize(x, stream=side)
            torch.cuda.current_stream().wait_stream(side)
            assert_matches(self, q, reference(x, "1d", "e4m3", True, False), "side " + alloc)

    def test_freed_and_reallocated_memory_is_registered_afresh(self):
        # PyTorch frees its cached segments on empty_cache(); a new tensor then
        # often gets the same address in a new cudaMalloc allocation. The
        # region cache must see that (the driver's buffer id changes) and
        # register the new allocation, never reuse the stale registration.
        g = torch.Generator(device="cuda").manual_seed(7)
        shape = (1024, 3072)  # 6 MiB of BF16: a segment of its own
        with session() as s:
            x = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
            assert_matches(self, s.quantize(x, columnwise=True), reference(x), "first")
            s.synchronize()
            p0, regs0 = x.data_ptr(), s.stats()["registrations"]
            same_address = 0
            for i in range(4):
                del x
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # cudaFree of the segments (inputs and outputs)
                x = torch.empty(shape, device="cuda", dtype=torch.bfloat16)  # one cudaMalloc
                x.normal_(generator=g)
                same_address += x.data_ptr() == p0
                q = s.quantize(x, columnwise=True)
                assert_matches(self, q, reference(x), "after empty_cache %d" % i)
                del q
                s.synchronize()
                p0 = x.data_ptr()
            regs = s.stats()["registrations"]
            # Each round's input (and outputs) are new allocations: registered afresh.
            self.assertGreaterEqual(regs - regs0, 4)
            print("stale-address rounds reusing the old address: %d of 4, registrations +%d"
                  % (same_address, regs - regs0), file=sys.stderr)

    def test_device_flags(self):
        x = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
        with session(flag_memory="device") as s:
            assert_matches(self, s.quantize(x, columnwise=True), reference(x), "device flags")

    def test_fp8_views(self):
        x = torch.randn(128, 256, device="cuda")
        with session() as s:
            q = s.quantize(x, columnwise=True)
            v = q.fp8()
            self.assertEqual(v.dtype, torch.float8_e4m3fn)
            self.assertEqual(v.data_ptr(), q.rowwise_data.data_ptr())
            self.assertEqual(q.fp8("columnwise").shape, (256, 128))
            q5 = s.quantize(x, format="e5m2")
            self.assertEqual(q5.fp8().dtype, torch.float8_e5m2)
            s.synchronize()
            self.assertTrue(torch.equal(v.view(torch.uint8), q.rowwise_data))

    def test_argument_errors_before_submission(self):
        with session() as s:
            x = torch.randn(64, 256, device="cuda")
            with self.assertRaises(qcuda.ArgumentError) as cm:
                s.quantize(x.t())
            self.assertIn("not contiguous", str(cm.exception))
            with self.assertRaises(qcuda.ArgumentError):
                s.quantize(x.to(torch.float64))
            bad = {f: torch.empty(qcuda.layout((64, 256))[f],
                                  dtype=torch.float32 if "scale" in f else torch.uint8,
                                  device="cuda") for f in qcuda.FIELDS}
            bad["rowwise_data"] = torch.empty(64, 255, dtype=torch.uint8, device="cuda")
            with self.assertRaises(qcuda.ArgumentError) as cm:
                s.quantize(x, out=bad)
            self.assertIn("out.rowwise_data: shape [64, 255], expected [64, 256]",
                          str(cm.exception))
            self.assertEqual(s.stats()["channels"], 0)


class CupyAndProtocolsTest(unittest.TestCase):
    def test_cupy_bit_exact(self):
        rs = cupy.random.RandomState(7)
        with session() as s:
            for dt, mode in ((cupy.float32, "1d"), (cupy.float16, "2d")):
                x = (rs.standard_normal((300, 384)) * 3).astype(dt)
                q = s.quantize(x, mode=mode, columnwise=True)
                self.assertIsInstance(q.rowwise_data, cupy.ndarray)
                assert_matches(self, q, reference(x, mode), "cupy %s %s" % (dt, mode))
                y = s.dequantize(q, dtype="float32")
                self.assertIsInstance(y, cupy.ndarray)
                s.synchronize()
                np.testing.assert_array_equal(cupy.asnumpy(y).reshape(300, 384),
                                              numpy_dequantize(q, "rowwise"))

    def test_cai_stream_is_honoured(self):
        # The producer writes x on its own stream behind a long matmul and
        # names that stream in __cuda_array_interface__ v3; the call runs on
        # another stream and must still see the new bytes.
        class Cai:
            def __init__(self, t, stream):
                self.t = t
                self.__cuda_array_interface__ = {
                    "version": 3, "data": (t.data_ptr(), False), "shape": tuple(t.shape),
                    "typestr": "<f4", "strides": None, "stream": stream}

        big = torch.randn(4096, 4096, device="cuda")
        src = torch.randn(256, 512, device="cuda")
        ref = reference(src)
        with session() as s:
            for _ in range(5):
                prod = torch.cuda.Stream()
                x = torch.zeros(256, 512, device="cuda")
                torch.cuda.synchronize()
                with torch.cuda.stream(prod):
                    for _ in range(8):
                        big = big @ big / 64
                    x.copy_(src)
                q = s.quantize(Cai(x, prod.cuda_stream), columnwise=True,
                               stream=torch.cuda.current_stream())
                self.assertIsInstance(q.rowwise_data, qcuda.DeviceArray)
                s.synchronize()
                got = qcuda.QuantizedTensor(q.shape, q.mode, q.format, **{
                    f: torch.as_tensor(getattr(q, f), device="cuda") for f in qcuda.FIELDS})
                assert_matches(self, got, ref, "CAI with stream")

    def test_dlpack_producer(self):
        class Dl:
            def __init__(self, t):
                self.t = t

            def __dlpack__(self, stream=None):
                return self.t.__dlpack__(stream=stream)

            def __dlpack_device__(self):
                return self.t.__dlpack_device__()

        x = torch.randn(128, 384, device="cuda", dtype=torch.bfloat16)
        with session() as s:
            q = s.quantize(Dl(x), mode="2d")
            s.synchronize()
            got = qcuda.QuantizedTensor(q.shape, "2d", "e4m3", **{
                f: torch.as_tensor(getattr(q, f), device="cuda")
                for f in ("rowwise_data", "rowwise_scale_inv")})
            assert_matches(self, got, reference(x, "2d", columnwise=False), "DLPack bf16")


class DequantizeTest(unittest.TestCase):
    def test_bit_exact(self):
        with session() as s:
            for mode in ("1d", "2d", "tensor"):
                x = torch.randn(260, 384, device="cuda") * 5
                q = s.quantize(x, mode=mode, columnwise=True)
                y32 = s.dequantize(q, dtype="float32")
                ybf = s.dequantize(q, dtype="bfloat16")
                col = qcuda.QuantizedTensor(q.shape, mode, "e4m3",
                                            columnwise_data=q.columnwise_data,
                                            columnwise_scale_inv=q.columnwise_scale_inv)
                out = torch.full((260, 384), float("nan"), device="cuda")
                yc = s.dequantize(col, dtype="float32", out=out)
                self.assertIs(yc, out)
                s.synchronize()
                want = numpy_dequantize(q, "rowwise")
                np.testing.assert_array_equal(y32.cpu().numpy(), want)
                self.assertTrue(torch.equal(ybf, torch.from_numpy(want).to("cuda").bfloat16()))
                np.testing.assert_array_equal(yc.cpu().numpy(), numpy_dequantize(q, "columnwise"))
                if mode == "tensor":
                    # A per-tensor scale of any one-element shape; two elements are refused.
                    q11 = qcuda.QuantizedTensor(q.shape, mode, "e4m3", rowwise_data=q.rowwise_data,
                                                rowwise_scale_inv=q.rowwise_scale_inv.view(1, 1))
                    y11 = s.dequantize(q11, dtype="float32")
                    s.synchronize()
                    np.testing.assert_array_equal(y11.cpu().numpy(), want)
                    q2 = qcuda.QuantizedTensor(q.shape, mode, "e4m3", rowwise_data=q.rowwise_data,
                                               rowwise_scale_inv=torch.ones(2, device="cuda"))
                    with self.assertRaises(qcuda.ArgumentError) as cm:
                        s.dequantize(q2)
                    self.assertIn("expected [1]", str(cm.exception))


class MakeColumnwiseTest(unittest.TestCase):
    """Session.make_columnwise: the columnwise copy made on the GPU from the
    rowwise one equals the CPU qtxd's columnwise copy, byte for byte (torch
    with both allocators and out=, CuPy); '1d' is refused."""

    def test_bit_exact_vs_cpu(self):
        g = torch.Generator(device="cuda").manual_seed(3)
        cases = [((1024, 2048), "2d"), ((3, 100, 384), "2d"), ((130, 260), "2d"),
                 ((512, 640), "tensor"), ((300, 520), "tensor")]
        for alloc in ("framework", "pool"):
            with session(allocator=alloc) as s:
                for shape, mode in cases:
                    x = (torch.randn(shape, device="cuda", generator=g) * 7).to(torch.bfloat16)
                    ref = reference(x, mode, "e4m3")
                    q = s.quantize(x, mode=mode, rowwise=True, columnwise=False)
                    c = s.make_columnwise(q)
                    self.assertIs(c.rowwise_data, q.rowwise_data)
                    s.synchronize()
                    torch.cuda.current_stream().synchronize()
                    assert_matches(self, c, ref, "%s %s %s" % (alloc, mode, shape))
                    lay = qcuda.layout(shape, mode)
                    out = (torch.full(lay["columnwise_data"], 0xCD, dtype=torch.uint8,
                                      device="cuda"),
                           torch.full(lay["columnwise_scale_inv"], -1.0, device="cuda"))
                    c2 = s.make_columnwise(q, out=out)
                    self.assertIs(c2.columnwise_data, out[0])
                    torch.cuda.current_stream().synchronize()
                    assert_matches(self, c2, ref, "out= %s %s" % (mode, shape))
        with session() as s:
            x = cupy.asarray(np.random.default_rng(4).standard_normal((256, 384)),
                             dtype=cupy.float32)
            ref = reference(x, "2d", "e4m3")
            q = s.quantize(x, mode="2d")
            c = s.make_columnwise(q)
            s.synchronize()
            cupy.cuda.get_current_stream().synchronize()
            assert_matches(self, c, ref, "cupy 2d")
            q1 = s.quantize(x, mode="1d")
            with self.assertRaises(qcuda.ArgumentError) as cm:
                s.make_columnwise(q1)
            self.assertIn("columnwise=True", str(cm.exception))


class StreamOrderTest(unittest.TestCase):
    ITERS = int(os.environ.get("QTX_PY_ORDER_ITERS", "300"))

    def test_producer_consumer_under_load(self):
        # Per iteration, on one side stream: a matmul (load), the producer
        # writes x, quantize(x), the consumer copies the outputs at once. Every
        # snapshot must be the reference of the pattern written just before.
        pats = [torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) * (i + 1)
                for i in range(4)]
        refs = [reference(p, columnwise=False) for p in pats]
        lay = qcuda.layout((512, 1024))
        outs = [{"rowwise_data": torch.empty(lay["rowwise_data"], dtype=torch.uint8,
                                             device="cuda"),
                 "rowwise_scale_inv": torch.empty(lay["rowwise_scale_inv"], device="cuda")}
                for _ in range(3)]
        a = torch.randn(2048, 2048, device="cuda")
        x = torch.empty(512, 1024, device="cuda", dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        snaps = []
        torch.cuda.synchronize()
        with session() as s, torch.cuda.stream(side):
            for i in range(self.ITERS):
                a = a @ a / 45.0
                x.copy_(pats[i % 4])
                q = s.quantize(x, out=outs[i % 3])
                snaps.append((q.rowwise_data.clone(), q.rowwise_scale_inv.clone()))
            s.synchronize()
            side.synchronize()
        bad = []
        for i, (d, sc) in enumerate(snaps):
            r = refs[i % 4]
            if host_bytes(d) != r["rowwise_data"] or host_bytes(sc) != r["rowwise_scale_inv"]:
                bad.append(i)
        self.assertEqual(bad, [], "iterations whose outputs were not the fresh input's")

    def test_call_returns_before_the_gpu_work(self):
        a = torch.randn(4096, 4096, device="cuda")
        x = torch.randn(256, 256, device="cuda")
        with session() as s:
            s.quantize(x)
            s.synchronize()  # channel open, regions registered
            for _ in range(40):
                a = a @ a / 64
            q = s.quantize(x)
            self.assertFalse(q.query(), "the op was done while the stream was still busy: "
                             "the call must not have waited on the host")
            s.synchronize()
            self.assertTrue(q.query())


class NoHostCopyTest(unittest.TestCase):
    def count_copies(self, fn):
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
        return [n for n in names if "memcpy" in n.lower() and
                ("htod" in n.lower() or "dtoh" in n.lower() or "memcpy hto" in n.lower()
                 or "memcpy dto" in n.lower())], names

    def test_no_device_to_host_copy(self):
        for alloc in ("pool", "framework"):
            self.check_no_device_to_host_copy(alloc)

    def check_no_device_to_host_copy(self, alloc):
        x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
        with session(allocator=alloc) as s:
            s.dequantize(s.quantize(x, columnwise=True))  # warm: channel + registrations
            s.synchronize()
            keep = []

            def calls():
                q = s.quantize(x, columnwise=True)
                keep.append(q)
                keep.append(s.dequantize(q, dtype="bfloat16"))
                s.synchronize()

            copies, names = self.count_copies(calls)
            self.assertEqual(copies, [], "host copies during qtx.cuda calls")
            # Positive control: the same counting sees a deliberate copy.
            control, _ = self.count_copies(lambda: x.cpu())
            self.assertGreaterEqual(len(control), 1, "the profiler saw no copy at all: %s"
                                    % sorted(set(names))[:20])
            # Pointers: pooled outputs are inside the session's pool chunks
            # (allocator='pool') or device memory of PyTorch's allocator.
            chunks = [(c.ptr, c.ptr + c.nbytes) for c in s.pool._chunks]
            for t in (keep[0].rowwise_data, keep[0].columnwise_scale_inv, keep[1]):
                p = t.data_ptr()
                self.assertTrue(t.is_cuda)
                self.assertEqual(any(lo <= p < hi for lo, hi in chunks), alloc == "pool", hex(p))


class PoolTest(unittest.TestCase):
    def test_churn_registers_nothing_new(self):
        self.check_churn("pool")

    def test_churn_with_the_framework_allocator(self):
        # Outputs from PyTorch's caching allocator: its segments are registered
        # once, then every call is a fast-path lookup; the pool is untouched.
        with session(allocator="framework") as s:
            for i in range(60):
                x = torch.randn(256 + 128 * (i % 3), 512, device="cuda")
                q = s.quantize(x, columnwise=True)
                y = s.dequantize(q)
                del q, y
                if i == 5:
                    s.synchronize()
                    first = s.stats()
                    hits = s._native.fast_hits()
            s.synchronize()
            last = s.stats()
            self.assertEqual(last["registrations"], first["registrations"])
            self.assertEqual(last["pool"]["allocs"], 0)
            self.assertEqual(last["pool"]["chunks"], 0)
            # 54 rounds x (quantize: input + 4 outputs, dequantize: 4 inputs + output).
            self.assertGreaterEqual(s._native.fast_hits() - hits, 54 * 10)

    def check_churn(self, alloc):
        with session(allocator=alloc) as s:
            for i in range(60):
                x = torch.randn(256 + 128 * (i % 3), 512, device="cuda")  # allocator churn
                q = s.quantize(x, columnwise=True)
                y = s.dequantize(q)
                del q, y
                if i == 5:
                    s.synchronize()
                    first = s.stats()
            s.synchronize()
            last = s.stats()
            self.assertEqual(last["registrations"], first["registrations"])
            self.assertEqual(last["pool"]["chunks"], first["pool"]["chunks"])
            self.assertGreaterEqual(last["pool"]["reuses"], 100)  # 120 allocations, 6 sizes
            self.assertEqual(last["pool"]["live_blocks"], 0)


class AllGatherTest(unittest.TestCase):
    def test_one_rank_group(self):
        x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
        ref = reference(x, columnwise=True)
        other = torch.cuda.Stream()
        with session() as s:
            s.create_group("py-ag", 0, 1, backend="nccl")
            h = s.all_gather(x, "py-ag", 0, columnwise=True)
            got = h.wait(other)
            with torch.cuda.stream(other):
                snap = {f: getattr(got, f).clone() for f in qcuda.FIELDS}
            other.synchronize()
            assert_matches(self, qcuda.QuantizedTensor((256, 512), "1d", "e4m3", **snap), ref,
                           "all_gather wait(other stream)")
            q = s.all_gather(x, "py-ag", 1, columnwise=True, async_op=False)
            s.synchronize()
            assert_matches(self, q, ref, "all_gather async_op=False")
            # Per-tensor current scaling: the channel's two-round path (the
            # amax reduced on the device), the scale_inv of shape [1].
            q = s.all_gather(x, "py-ag", 2, mode="tensor", columnwise=True, async_op=False)
            s.synchronize()
            self.assertEqual(tuple(q.rowwise_scale_inv.shape), (1,))
            assert_matches(self, q, reference(x, mode="tensor", columnwise=True),
                           "all_gather mode='tensor'")
            s.destroy_group("py-ag")


class BackgroundWriterTest(unittest.TestCase):
    """Session(background_writer=True, the default): the channel's stream
    writes start on a thread of its own; with False the calling thread
    writes. The results, and their stream order, are the same."""

    def test_many_calls_bit_exact_in_order(self):
        for bgw in (True, False):
            with self.subTest(background_writer=bgw):
                self.many_calls(bgw)

    def many_calls(self, bgw):
        g = torch.Generator(device="cpu").manual_seed(5)
        inputs = [(torch.randn(256, 640, generator=g) * (1 + i)).to(torch.bfloat16)
                  for i in range(24)]
        refs = [reference(x, columnwise=True) for x in inputs]
        lay = qcuda.layout((256, 640))
        got = []
        with session(background_writer=bgw) as s:
            for i, host in enumerate(inputs):
                x = host.cuda()
                if i % 2:
                    q = s.quantize(x, columnwise=True)  # framework outputs
                else:
                    out = {f: torch.empty(lay[f], device="cuda", dtype=torch.float32
                                          if "scale" in f else torch.uint8)
                           for f in qcuda.FIELDS}
                    q = s.quantize(x, columnwise=True, out=out)
                # Stream order: a copy queued right after the call sees the outputs,
                # and a write queued after it does not change what it read.
                got.append({f: getattr(q, f).clone() for f in qcuda.FIELDS})
                x.zero_()
            s.synchronize()
            torch.cuda.current_stream().synchronize()
        for i, snap in enumerate(got):
            assert_matches(self, qcuda.QuantizedTensor((256, 640), "1d", "e4m3", **snap),
                           refs[i], "background_writer=%s call %d" % (bgw, i))


class FailureTest(unittest.TestCase):
    def test_failed_op_raises_its_class(self):
        x = torch.randn(128, 256, device="cuda")
        s = session()
        try:
            lay = qcuda.layout((128, 256))
            d = torch.empty(lay["rowwise_data"], dtype=torch.uint8, device="cuda")
            sc = torch.empty(lay["rowwise_scale_inv"], device="cuda")
            st = torch.cuda.current_stream().cuda_stream
            # dtype 6 (uint8) is refused by qtxd (at submission or when the op
            # reaches its turn; then the next call / synchronize raises it).
            with self.assertRaises(qtx.errors.InvalidArgumentError) as cm:
                s._native.quantize(0, st, x.data_ptr(), 6, [128, 256], 1, 1, True, False, True,
                                   0.0, [(d.data_ptr(), d.numel()),
                                         (sc.data_ptr(), sc.numel() * 4), None, None])
                s.synchronize()
            print("failure as raised: %r" % cm.exception, file=sys.stderr)
            self.assertTrue(cm.exception.message)
            with self.assertRaises(qtx.errors.QtxError):
                s.quantize(x)  # the channel stays failed
        finally:
            try:
                s.close()
            except qtx.errors.QtxError:
                pass
        with session() as s2:  # a new session works
            assert_matches(self, s2.quantize(x), reference(x, columnwise=False), "after failure")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--qtxd", required=True)
    p.add_argument("--python_dir", required=True)
    ARGS, rest = p.parse_known_args()

    def on_term(*_):  # a timeout kills the test: stop the qtxd it started
        tearDownModule()
        os._exit(1)

    signal.signal(signal.SIGTERM, on_term)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
