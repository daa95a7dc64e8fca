#!/usr/bin/python3
"""qtx.cuda's host-side parts, on a machine without a GPU (CI).

Argument checking, dtype and layout mapping, __cuda_array_interface__ and
DLPack parsing with fake objects (and real DLPack capsules of CPU tensors),
stream handles, the status -> exception mapping (including a real failure of
the compiled module), the DevicePool's bookkeeping with a fake CUDA backend,
`python -m qtx health` (with --wait, against a CPU qtxd started after it), and
`import qtx` without grpcio.

  /usr/bin/python3 tests/python/test_cuda_cpu.py --python_dir=build/client/python \
      --qtxd=build/server/qtxd
"""

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import qtxd_child

ARGS = None
qtx = None
qcuda = None
torch = None


def setUpModule():
    global qtx, qcuda, torch
    sys.path.insert(0, ARGS.python_dir)
    import qtx as _qtx
    import qtx.cuda as _qcuda
    import torch as _torch
    qtx, qcuda, torch = _qtx, _qcuda, _torch


class FakeCai:
    def __init__(self, **cai):
        self.__cuda_array_interface__ = cai


def cai(shape=(4, 256), typestr="<f4", ptr=0x10000, strides=None, version=3, **extra):
    d = {"version": version, "data": (ptr, False), "shape": shape, "typestr": typestr,
         "strides": strides}
    d.update(extra)
    return d


class ErrorMappingTest(unittest.TestCase):
    def test_every_code_maps_to_its_class(self):
        names = {3: "InvalidArgumentError", 4: "DeadlineExceededError", 5: "NotFoundError",
                 9: "FailedPreconditionError", 8: "ResourceExhaustedError", 13: "InternalError",
                 14: "UnavailableError", 16: "UnauthenticatedError", 1: "CancelledError"}
        for code, name in names.items():
            e = qtx.errors.from_status(code, "msg %d" % code)
            self.assertEqual(type(e).__name__, name)
            self.assertEqual(e.code.value[0], code)
            self.assertEqual(e.message, "msg %d" % code)
            self.assertIn("msg %d" % code, str(e))

    def test_unknown_code(self):
        e = qtx.errors.from_status(77, "odd")
        self.assertIs(type(e), qtx.errors.QtxError)
        self.assertIn("77", str(e))

    def test_argument_errors_are_both_kinds(self):
        self.assertTrue(issubclass(qcuda.ArgumentError, qtx.errors.InvalidArgumentError))
        self.assertTrue(issubclass(qcuda.ArgumentError, ValueError))
        self.assertTrue(issubclass(qcuda.ArgumentTypeError, TypeError))

    def test_native_status_becomes_the_class(self):
        # A real failure inside the compiled module: a bad flag memory name is
        # refused by NativeSession with INVALID_ARGUMENT.
        with self.assertRaises(qtx.errors.InvalidArgumentError) as cm:
            qcuda._native.Session("unix:///nonexistent/qtxd.sock", "sideways", "t", 1.0)
        self.assertIn("flag_memory='sideways'", str(cm.exception))

    def test_unreachable_qtxd_is_unavailable(self):
        s = qcuda.Session("unix:///nonexistent/dir/qtxd.sock", timeout=2.0)
        with self.assertRaises(qtx.errors.UnavailableError):
            s.health()
        s.close()


class ConfigAndLayoutTest(unittest.TestCase):
    def test_config_checks(self):
        self.assertEqual(qcuda.quantize_config("2d", "e5m2", True, True, False, 0.5),
                         (2, 2, True, True, False, 0.5))
        for kwargs, text in (({"mode": "3d"}, "mode='3d'"), ({"format": "e3m4"}, "format="),
                             ({"rowwise": False}, "at least one"),
                             ({"amax_epsilon": -1.0}, "amax_epsilon"),
                             ({"amax_epsilon": float("nan")}, "amax_epsilon")):
            with self.assertRaises(qcuda.ArgumentError) as cm:
                qcuda.quantize_config(**kwargs)
            self.assertIn(text, str(cm.exception))

    def test_layout_1d(self):
        lay = qcuda.layout([256, 1024], "1d")
        self.assertEqual(lay["rowwise_data"], (256, 1024))
        self.assertEqual(lay["rowwise_scale_inv"], (8, 256))  # [N/128, pad4(M)]
        self.assertEqual(lay["columnwise_data"], (1024, 256))
        self.assertEqual(lay["columnwise_scale_inv"], (2, 1024))  # [M/128, pad4(N)]

    def test_layout_2d_and_flattening(self):
        lay = qcuda.layout([2, 150, 520], "2d")  # M = 300
        self.assertEqual((lay["m"], lay["n"]), (300, 520))
        self.assertEqual(lay["rowwise_scale_inv"], (3, 8))     # [ceil(M/128), pad4(ceil(N/128))]
        self.assertEqual(lay["columnwise_scale_inv"], (5, 4))  # [ceil(N/128), pad4(ceil(M/128))]
        with self.assertRaises(qcuda.ArgumentError):
            qcuda.layout([], "1d")
        with self.assertRaises(qcuda.ArgumentError):
            qcuda.layout([4, -1], "1d")

    def test_layout_tensor(self):
        # Per-tensor current scaling: one scale_inv of shape [1] per copy
        # (docs/numerics.md §9), not the (1, 1) of the C++ QuantizedLayout.
        lay = qcuda.layout([2, 150, 520], "tensor")
        self.assertEqual((lay["m"], lay["n"]), (300, 520))
        self.assertEqual(lay["rowwise_data"], (300, 520))
        self.assertEqual(lay["columnwise_data"], (520, 300))
        self.assertEqual(lay["rowwise_scale_inv"], (1,))
        self.assertEqual(lay["columnwise_scale_inv"], (1,))
        empty = qcuda.layout([0, 128], "tensor")  # still one scale per copy
        self.assertEqual((empty["rowwise_data"], empty["rowwise_scale_inv"]), ((0, 128), (1,)))
        self.assertEqual(qcuda.layout([128, 128], qcuda._MODES["tensor"]), qcuda.layout(
            [128, 128], "tensor"))
        self.assertEqual(qcuda.quantize_config("tensor", "e5m2", True, True, False),
                         (3, 2, True, True, False, 0.0))

    def test_field_dtypes(self):
        self.assertTrue(qcuda._field_dtype_ok("rowwise_data", qcuda.UINT8, 1))
        self.assertTrue(qcuda._field_dtype_ok("rowwise_data", qcuda.FLOAT8_E4M3, 1))
        self.assertFalse(qcuda._field_dtype_ok("rowwise_data", qcuda.FLOAT8_E5M2, 1))
        self.assertTrue(qcuda._field_dtype_ok("columnwise_scale_inv", qcuda.FLOAT32, 2))
        self.assertFalse(qcuda._field_dtype_ok("columnwise_scale_inv", qcuda.UINT8, 2))


class CudaArrayInterfaceTest(unittest.TestCase):
    dev = staticmethod(lambda ptr: 3)

    def parse(self, d):
        return qcuda.from_cuda_array_interface(d, "x", device_of=self.dev)

    def test_v3_with_stream(self):
        a = self.parse(cai(shape=(2, 3, 256), typestr="<f2", ptr=0xABC00, stream=0x55))
        self.assertEqual((a.ptr, a.shape, a.dtype, a.device, a.stream_hint, a.contiguous),
                         (0xABC00, (2, 3, 256), qcuda.FLOAT16, 3, 0x55, True))
        self.assertEqual(a.nbytes, 2 * 3 * 256 * 2)

    def test_v2_ignores_stream(self):
        self.assertIsNone(self.parse(cai(version=2, stream=7)).stream_hint)

    def test_strides(self):
        self.assertTrue(self.parse(cai(shape=(4, 8), strides=(32, 4))).contiguous)
        self.assertFalse(self.parse(cai(shape=(4, 8), strides=(4, 16))).contiguous)  # transposed
        self.assertFalse(self.parse(cai(shape=(4, 8), strides=(64, 4))).contiguous)  # row gap
        self.assertTrue(self.parse(cai(shape=(1, 8), strides=(999, 4))).contiguous)  # size-1 dim

    def test_rejections(self):
        for d, text in ((cai(stream=0), "disallowed"), (cai(mask=object()), "mask"),
                        (cai(typestr="<f8"), "typestr '<f8'"), (cai(version=1), "version 1"),
                        ({"version": 3, "shape": (2,)}, "'data'"),
                        (cai(ptr=0), "null data pointer")):
            with self.assertRaises(qcuda.ArgumentError) as cm:
                self.parse(d)
            self.assertIn(text, str(cm.exception))
        with self.assertRaises(qcuda.ArgumentTypeError):
            qcuda.from_cuda_array_interface([1, 2], "x", device_of=self.dev)

    def test_as_cuda_array_dispatch(self):
        orig = qcuda._pointer_device
        qcuda._pointer_device = lambda ptr: 1
        try:
            a = qcuda.as_cuda_array(FakeCai(**cai(typestr="|u1")), "x")
        finally:
            qcuda._pointer_device = orig
        self.assertEqual((a.dtype, a.device, a.framework), (qcuda.UINT8, 1, None))
        with self.assertRaises(qcuda.ArgumentTypeError) as cm:
            qcuda.as_cuda_array(object(), "x")
        self.assertIn("not a CUDA array", str(cm.exception))


class DlpackTest(unittest.TestCase):
    def test_parse_real_capsule(self):
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        ptr, shape, strides, dt, dev = qcuda._native.parse_dlpack(torch.utils.dlpack.to_dlpack(t))
        self.assertEqual(ptr, t.data_ptr())
        self.assertEqual(list(shape), [3, 4])
        self.assertEqual(tuple(dt), (2, 32, 1))
        self.assertEqual(tuple(dev), (1, 0))  # kDLCPU
        self.assertIn(strides, (None, [4, 1]))

    def test_cpu_capsule_rejected(self):
        cap = torch.utils.dlpack.to_dlpack(torch.zeros(2, 2))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            qcuda.from_dlpack_capsule(cap, "x")
        self.assertIn("device type 1", str(cm.exception))

    def test_fake_cuda_producer(self):
        # A producer that claims CUDA and hands out a real capsule: the parse
        # must read pointer, dtype, strides and pass the consumer's stream.
        class Producer:
            def __init__(self, t):
                self.t, self.streams = t, []

            def __dlpack_device__(self):
                return (2, 5)

            def __dlpack__(self, stream=None):
                self.streams.append(stream)
                return torch.utils.dlpack.to_dlpack(self.t)

        def fake_parse(cap):
            ptr, shape, strides, dt, _ = qcuda._native.parse_dlpack(cap)
            return ptr, shape, strides, dt, (2, 5)

        orig = qcuda.from_dlpack_capsule
        qcuda.from_dlpack_capsule = lambda cap, what, obj=None: orig(cap, what, obj, fake_parse)
        try:
            b = torch.zeros(8, 256, dtype=torch.bfloat16)
            p = Producer(b)
            a = qcuda.as_cuda_array(p, "x", lambda dev: 0x1234 + dev)
            self.assertEqual((a.ptr, a.shape, a.dtype, a.device, a.contiguous),
                             (b.data_ptr(), (8, 256), qcuda.BFLOAT16, 5, True))
            self.assertEqual(p.streams, [0x1234 + 5])
            tr = Producer(torch.zeros(256, 8).t())  # a transposed view: strides (1, 8)
            self.assertFalse(qcuda.as_cuda_array(tr, "x").contiguous)
            bad = Producer(torch.zeros(4, dtype=torch.float64))
            with self.assertRaises(qcuda.ArgumentError) as cm:
                qcuda.as_cuda_array(bad, "x")
            self.assertIn("bits 64", str(cm.exception))
        finally:
            qcuda.from_dlpack_capsule = orig

    def test_consumed_capsule_rejected(self):
        cap = torch.utils.dlpack.to_dlpack(torch.zeros(2))
        torch.utils.dlpack.from_dlpack(cap)  # consumes: renamed "used_dltensor"
        with self.assertRaises(qtx.errors.InvalidArgumentError) as cm:
            qcuda._native.parse_dlpack(cap)
        self.assertIn("used_dltensor", str(cm.exception))


class StreamTest(unittest.TestCase):
    def test_handles(self):
        class TorchLike:
            cuda_stream = 0x77

        class Protocol:
            def __cuda_stream__(self):
                return (0, 0x99)

        self.assertEqual(qcuda.stream_handle(0x42), 0x42)
        self.assertEqual(qcuda.stream_handle(TorchLike()), 0x77)
        self.assertEqual(qcuda.stream_handle(Protocol()), 0x99)
        self.assertEqual(qcuda.stream_handle(None, None, 0, hint=0x31), 0x31)
        self.assertEqual(qcuda.stream_handle(None), qcuda.LEGACY_STREAM)
        with self.assertRaises(qcuda.ArgumentError):
            qcuda.stream_handle(-1)
        with self.assertRaises(qcuda.ArgumentTypeError):
            qcuda.stream_handle(True)
        with self.assertRaises(qcuda.ArgumentTypeError) as cm:
            qcuda.stream_handle("s")
        self.assertIn("not a stream", str(cm.exception))


class TorchCpuInputTest(unittest.TestCase):
    def test_cpu_tensor_refused_before_submission(self):
        s = qcuda.Session("unix:///nonexistent/dir/qtxd.sock", timeout=1.0)
        with self.assertRaises(qcuda.ArgumentError) as cm:
            s.quantize(torch.zeros(4, 128))
        self.assertIn("CUDA tensors", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError):
            s.quantize(torch.zeros(4, 128), mode="4d")
        self.assertEqual(s.stats()["channels"], 0)  # nothing was opened
        q = qcuda.QuantizedTensor((4, 128), "1d", "e4m3")
        with self.assertRaises(qcuda.ArgumentError) as cm:
            s.dequantize(q)
        self.assertIn("needs rowwise_data", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError):
            s.dequantize(q, dtype="float64")
        s.close()

    def test_optimizer_arguments_checked_before_any_call(self):
        s = qcuda.Session("unix:///nonexistent/dir/qtxd.sock", timeout=1.0)
        with self.assertRaises(qcuda.ArgumentError) as cm:
            s.step("never-offloaded", 1, {"w": torch.zeros(4, 4)})
        self.assertIn("not offloaded through this session", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            s.offload_optimizer_state("g", {"w": torch.zeros(4, 4, dtype=torch.float64)})
        self.assertIn("masters are float32", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError):
            s.offload_optimizer_state("g", {"w": torch.zeros(4, 4)}, mode="3d")
        # Per-parameter settings: qtx.optimizer.per_parameter's checks, as qtx.Client's.
        with self.assertRaises(qcuda.ArgumentError) as cm:
            s.offload_optimizer_state("g", {"w": torch.zeros(4, 4)}, weight_decays=[0.1, 0.2])
        self.assertIn("weight_decays: 2 values for 1 parameters", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            s.offload_optimizer_state("g", {"w": torch.zeros(4, 4)}, lr_scales={"v": 2.0})
        self.assertIn("lr_scales: ['v']: not a parameter of the group", str(cm.exception))
        # Shard ranges: checked against the whole shape and the master.
        for kw, msg in (
                (dict(shards={"w": (0, 16)}), "needs shapes[w]"),
                (dict(shards={"w": (0, 16)}, shapes={"w": (2, 4)}), "0 <= begin <= end <= 8"),
                (dict(shards={"w": (0, 15)}, shapes={"w": (4, 8)}),
                 "the master has 16 elements; shards=(0, 15) owns 15"),
                (dict(shards={"w": (0, 16)}, shapes={"w": (4, 8)}, mode="1d"), "mode='2d'"),
                (dict(shards={"w": "ab"}, shapes={"w": (4, 8)}), "(begin, end) pair"),
                (dict(shapes={"w": (4, 8)}), "only for a parameter with a shard range"),
                (dict(shards={"x": (0, 1)}), "not a parameter of the group")):
            with self.assertRaises(qcuda.ArgumentError) as cm:
                s.offload_optimizer_state("g", {"w": torch.zeros(4, 4)}, **kw)
            self.assertIn(msg, str(cm.exception))
        # A known group (as offload would record it): gradient checks.
        cfg = qcuda.quantize_config("2d", "e4m3", True, True)
        s._groups["g"] = ("2d", "e4m3", cfg, {"w": (4, 256)})
        with self.assertRaises(qcuda.ArgumentError) as cm:
            s.step("g", 1, {})
        self.assertIn("empty", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            s.step("g", 1, {"w": torch.zeros(4, 256)})  # a CPU tensor
        self.assertIn("CUDA tensors", str(cm.exception))
        self.assertEqual(s.stats()["channels"], 0)
        s.close()

    def test_query_needs_a_channel_op(self):
        q = qcuda.QuantizedTensor((4, 128), "1d", "e4m3")
        with self.assertRaises(qcuda.ArgumentError) as cm:
            q.query()
        self.assertIn("not a channel operation", str(cm.exception))

    def test_record_stream_reaches_the_blocks(self):
        pool = qcuda.DevicePool(FakeBackend(), chunk_bytes=1 << 20)
        b = pool.alloc(0, 7, 512)
        q = qcuda.QuantizedTensor((4, 128), "1d", "e4m3")
        q._blocks = (b,)
        q.record_stream(9)
        q.record_stream(7)  # the block's own stream
        self.assertEqual(b.streams, {9})

    def test_torch_dtype_map(self):
        m = qcuda._torch_dtype_map(torch)
        self.assertEqual(m[torch.bfloat16], qcuda.BFLOAT16)
        self.assertEqual(m[torch.uint8], qcuda.UINT8)
        self.assertNotIn(torch.float64, m)

    def test_fp8_view_needs_the_dtype(self):
        q = qcuda.QuantizedTensor((4, 128), "1d", "e4m3",
                                  rowwise_data=torch.zeros(4, 128, dtype=torch.uint8))
        if hasattr(torch, "float8_e4m3fn"):
            self.assertEqual(q.fp8().dtype, torch.float8_e4m3fn)
        else:
            with self.assertRaises(qcuda.ArgumentTypeError) as cm:
                q.fp8()
            self.assertIn("float8_e4m3fn", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError):
            q.fp8("columnwise")


class FakeNative:
    """Stands in for qtx._native.Session: records the submissions."""

    def __init__(self):
        self.calls = []
        self.plans = []

    def dequantize(self, *args):
        self.calls.append(("dequantize", args))
        return 19

    def quantize_plan(self, *args):
        self.plans.append(args)
        return len(self.plans) - 1

    def submit_quantize(self, session, plan, device, stream, x, rd, rs, cd, cs):
        """Stands in for qtx._native.submit_quantize: records the call with
        its plan's fields spelled out: (device, stream, x, dtype, shape, mode,
        format, rowwise, columnwise, pow2, eps, then (pointer, bytes) x 4)."""
        assert session is self, "submit_quantize got another session"
        dtype, shape, mode, fmt, row, col, pow2, eps, rdb, rsb, cdb, csb = self.plans[plan]
        self.calls.append(("submit_quantize", (device, stream, x, dtype, shape, mode, fmt, row,
                                               col, pow2, eps, rd, rdb if rd else 0, rs,
                                               rsb if rs else 0, cd, cdb if cd else 0, cs,
                                               csb if cs else 0)))
        return 17

    def quantize(self, *args):
        self.calls.append(("quantize", args))
        return 18

    def offload_optimizer_state(self, *args):
        self.calls.append(("offload_optimizer_state", args))
        return len(args[1])

    def step(self, *args):
        self.calls.append(("step", args))
        return {"step": args[3]}

    def close(self):
        pass


def fake_cuda_class():
    class FakeCuda(torch.Tensor):
        """A CPU tensor that says it is on cuda:0 (what the fast path reads)."""
        @property
        def is_cuda(self):
            return True

        @property
        def device(self):
            return torch.device("cuda", 0)

        def get_device(self):
            return 0
    return FakeCuda


class FastPathTest(unittest.TestCase):
    """Session.quantize's PyTorch fast path and its memos, with a fake native
    session and CPU tensors posing as CUDA ones."""

    def setUp(self):
        self.FakeCuda = fake_cuda_class()
        self.s = qcuda.Session("unix:///nonexistent/dir/qtxd.sock", timeout=1.0)
        self.native = FakeNative()
        self.s._native = self.native
        self.s._submit = self.native.submit_quantize

    def tearDown(self):
        self.s.close()

    def cuda(self, t):
        return t.as_subclass(self.FakeCuda)

    def outs(self, shape, mode="1d", **override):
        lay = qcuda.layout(shape, mode)
        o = {f: self.cuda(torch.zeros(lay[f], dtype=torch.float32 if "scale" in f
                                      else torch.uint8)) for f in qcuda.FIELDS}
        o.update(override)
        return o

    def test_config_memo_keeps_only_valid_configs(self):
        c1 = qcuda._config("2d", "e5m2", True, True, False, 0.5)
        self.assertEqual(c1, qcuda.quantize_config("2d", "e5m2", True, True, False, 0.5))
        self.assertIs(qcuda._config("2d", "e5m2", True, True, False, 0.5), c1)
        self.assertNotEqual(qcuda._config("1d", "e5m2", True, True, False, 0.5), c1)
        for _ in range(2):  # a bad argument raises every time: nothing was memoized
            with self.assertRaises(qcuda.ArgumentError):
                qcuda._config("3d", "e4m3", True, False, True, 0.0)
            with self.assertRaises(qcuda.ArgumentError):
                qcuda._config("1d", "e4m3", True, False, True, float("nan"))
        self.assertNotIn(("3d", "e4m3", True, False, True, 0.0), qcuda._CONFIGS)
        # -0.0 equals 0.0 as a key but not in its bits (AllGather compares them).
        qcuda._config("1d", "e4m3", True, False, True, 0.0)
        neg = qcuda._config("1d", "e4m3", True, False, True, -0.0)
        self.assertEqual(str(neg[5]), "-0.0")

    def test_plan_matches_the_layout(self):
        cfg = qcuda.quantize_config("1d", "e4m3", True, True)
        lay, parts = qcuda._plan(torch.Size([3, 100, 384]), cfg)
        self.assertEqual(lay, qcuda.layout((3, 100, 384)))
        self.assertEqual([p[0] for p in parts], list(qcuda.FIELDS))
        for f, shp, nbytes, scale, i in parts:
            self.assertEqual(shp, tuple(lay[f]))
            self.assertEqual(nbytes, shp[0] * shp[1] * (4 if scale else 1))
            self.assertEqual(qcuda.FIELDS[i], f)
        self.assertIs(qcuda._plan((3, 100, 384), cfg)[1], parts)  # torch.Size == tuple key
        _, row = qcuda._plan((3, 100, 384), qcuda.quantize_config("1d", "e4m3", True, False))
        self.assertEqual([p[0] for p in row], ["rowwise_data", "rowwise_scale_inv"])

    def test_out_tensors_go_through_one_flat_native_call(self):
        x = self.cuda(torch.zeros(256, 512, dtype=torch.bfloat16))
        out = self.outs((256, 512))
        q = self.s.quantize(x, columnwise=True, out=out, stream=5)
        self.assertEqual(len(self.native.calls), 1)
        name, args = self.native.calls[0]
        self.assertEqual(name, "submit_quantize")
        dev, stream, ptr, dtype, shape = args[:5]
        self.assertEqual((dev, stream, ptr, dtype, tuple(shape)),
                         (0, 5, x.data_ptr(), qcuda.BFLOAT16, (256, 512)))
        self.assertEqual(args[5:11], (1, 1, True, True, True, 0.0))
        want = []
        for f in qcuda.FIELDS:
            want += [out[f].data_ptr(), out[f].numel() * out[f].element_size()]
        self.assertEqual(list(args[11:]), want)
        self.assertEqual((q.op, q.stream, q.device, q.shape), (17, 5, 0, (256, 512)))
        for f in qcuda.FIELDS:
            self.assertIs(getattr(q, f), out[f])
        self.assertFalse(q._framework_alloc)
        self.assertEqual(set(vars(q)), set(vars(qcuda.QuantizedTensor((4, 128), "1d", "e4m3"))))
        self.assertIs(q._session, self.s)
        # Rowwise only: the columnwise pointers are 0; float8 data is accepted.
        if hasattr(torch, "float8_e4m3fn"):
            out = self.outs((256, 512))
            out["rowwise_data"] = out["rowwise_data"].view(torch.float8_e4m3fn)
            del out["columnwise_data"], out["columnwise_scale_inv"]
            self.s.quantize(x, out=out, stream=5)
            args = self.native.calls[-1][1]
            self.assertEqual(self.native.calls[-1][0], "submit_quantize")
            self.assertEqual(args[15:], (0, 0, 0, 0))

    def test_sharded_offload_and_step_reach_the_native_session(self):
        # Data-parallel sharded state: the whole shapes and the ranges at
        # offload; at the step the slices' gradients (an empty inline one for
        # a parameter this owner owns nothing of), the FP8 shard buffers
        # (rowwise [end - begin] bytes, the whole scales, no columnwise data)
        # and the Collective group with its sequence.
        masters = {"w": torch.zeros(1000), "b": torch.zeros(0), "v": torch.zeros(3, 128)}
        n = self.s.offload_optimizer_state(
            "g", masters, shards={"w": (2000, 3000), "b": (7, 7)},
            shapes={"w": (20, 260), "b": (1, 200)})
        self.assertEqual(n, 3)
        name, args = self.native.calls[-1]
        self.assertEqual(name, "offload_optimizer_state")
        self.assertEqual([(p[0], p[2]) for p in args[1]],
                         [("w", [20, 260]), ("b", [1, 200]), ("v", [3, 128])])
        self.assertEqual(args[-1], [(2000, 3000), (7, 7), None])
        lay = qcuda.layout((20, 260), "2d")
        out = {"w": {"rowwise_data": self.cuda(torch.zeros(1000, dtype=torch.uint8)),
                     "rowwise_scale_inv": self.cuda(torch.zeros(lay["rowwise_scale_inv"])),
                     "columnwise_scale_inv": self.cuda(torch.zeros(lay["columnwise_scale_inv"]))},
               "v": self.outs((3, 128), "2d")}
        grads = {"w": self.cuda(torch.zeros(1000, dtype=torch.bfloat16)),
                 "v": self.cuda(torch.zeros(3, 128))}
        stats, res = self.s.step("g", 4, grads, out=out, stream=5, collective_group="dp",
                                 sequence=9)
        self.assertEqual(stats, {"step": 4})
        name, args = self.native.calls[-1]
        self.assertEqual(name, "step")
        self.assertEqual(args[-2:], ("dp", 9))
        gr = {g[0]: g for g in args[4]}
        self.assertEqual(gr["w"][3], [1000])
        self.assertEqual(gr["b"], ("b", 0, qcuda.FLOAT32, [0]))
        dests = dict(args[5])
        self.assertEqual(dests["w"][0][1], 1000)  # rowwise_data: the shard's bytes
        self.assertEqual(dests["w"][1][1], lay["rowwise_scale_inv"][0]
                         * lay["rowwise_scale_inv"][1] * 4)
        self.assertIsNone(dests["w"][2])  # no columnwise data
        self.assertIsNotNone(dests["w"][3])
        self.assertNotIn("b", dests)  # owns nothing of it: returned inline
        self.assertIsNotNone(dests["v"][2])  # an unsharded parameter: every buffer
        self.assertEqual(tuple(res["w"].shape), (20, 260))
        self.assertIs(res["w"].rowwise_data, out["w"]["rowwise_data"])
        self.assertNotIn("b", res)
        # The checks, before any native call.
        calls = len(self.native.calls)
        for bad, msg in (
                (dict(sequence=1), "without collective_group"),
                (dict(collective_group="dp"), "needs the group's next sequence"),
                (dict(collective_group="dp", sequence=-1), "an int >= 0"),
                (dict(collective_group="", sequence=0), "the name of a Collective group")):
            with self.assertRaises(qcuda.ArgumentError) as cm:
                self.s.step("g", 5, grads, out=out, stream=5, **bad)
            self.assertIn(msg, str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            self.s.step("g", 5, {"w": self.cuda(torch.zeros(999))}, stream=5,
                        collective_group="dp", sequence=1)
        self.assertIn("999 elements; this owner's shard [2000, 3000)", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            self.s.step("g", 5, {"w": grads["w"]}, out={"w": out["v"]}, stream=5,
                        collective_group="dp", sequence=1)
        self.assertIn("out.rowwise_data: shape [3, 128], expected [1000]", str(cm.exception))
        self.assertEqual(len(self.native.calls), calls)

    def test_make_columnwise_checks_then_one_native_call(self):
        self.native.make_columnwise = lambda *a: self.native.calls.append(("make_columnwise", a))
        for mode in ("2d", "tensor"):
            lay = qcuda.layout((3, 100, 384), mode)
            row = self.cuda(torch.zeros(lay["rowwise_data"], dtype=torch.uint8))
            scale = self.cuda(torch.zeros(lay["rowwise_scale_inv"], dtype=torch.float32))
            q = qcuda.QuantizedTensor((3, 100, 384), mode, "e4m3", row, scale)
            out = (self.cuda(torch.zeros(lay["columnwise_data"], dtype=torch.uint8)),
                   self.cuda(torch.zeros(lay["columnwise_scale_inv"], dtype=torch.float32)))
            r = self.s.make_columnwise(q, out=out, stream=5)
            name, args = self.native.calls[-1]
            self.assertEqual(name, "make_columnwise")
            self.assertEqual(args, (0, 5, qcuda._MODES[mode], [3, 100, 384], row.data_ptr(),
                                    scale.data_ptr(), out[0].data_ptr(), out[1].data_ptr()))
            self.assertIs(r.rowwise_data, row)
            self.assertIs(r.columnwise_data, out[0])
            self.assertIs(r.columnwise_scale_inv, out[1])
            self.assertEqual((r.stream, r.device, r.mode), (5, 0, mode))
        calls = len(self.native.calls)
        lay = qcuda.layout((256, 384), "1d")
        q1 = qcuda.QuantizedTensor((256, 384), "1d", "e4m3",
                                   self.cuda(torch.zeros(lay["rowwise_data"], dtype=torch.uint8)),
                                   self.cuda(torch.zeros(lay["rowwise_scale_inv"])))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            self.s.make_columnwise(q1, stream=5)
        self.assertIn("quantize with columnwise=True", str(cm.exception))
        lay = qcuda.layout((256, 384), "2d")
        q2 = qcuda.QuantizedTensor((256, 384), "2d", "e4m3",
                                   self.cuda(torch.zeros(lay["rowwise_data"], dtype=torch.uint8)),
                                   self.cuda(torch.zeros(lay["rowwise_scale_inv"])))
        bad = (self.cuda(torch.zeros(256, 384, dtype=torch.uint8)),  # not transposed
               self.cuda(torch.zeros(lay["columnwise_scale_inv"])))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            self.s.make_columnwise(q2, out=bad, stream=5)
        self.assertIn("out[0]: shape [256, 384], expected [384, 256]", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            self.s.make_columnwise(qcuda.QuantizedTensor((256, 384), "2d", "e4m3"), stream=5)
        self.assertIn("needs rowwise_data and rowwise_scale_inv", str(cm.exception))
        self.assertEqual(len(self.native.calls), calls)  # nothing reached the GPU

    def test_tensor_mode_outputs(self):
        # mode='tensor': out= scales of shape [1] take the fast path (4 bytes each).
        x = self.cuda(torch.zeros(3, 100, 384, dtype=torch.float32))
        out = self.outs((3, 100, 384), "tensor")
        self.assertEqual(tuple(out["rowwise_scale_inv"].shape), (1,))
        q = self.s.quantize(x, mode="tensor", format="e5m2", columnwise=True, out=out, stream=5)
        name, args = self.native.calls[-1]
        self.assertEqual(name, "submit_quantize")
        self.assertEqual(args[5:11], (3, 2, True, True, True, 0.0))
        self.assertEqual(list(args[12::2]), [300 * 384, 4, 384 * 300, 4])
        self.assertEqual(q.mode, "tensor")
        self.assertIs(q.columnwise_scale_inv, out["columnwise_scale_inv"])
        # [1, 1] scales are not the layout: the checked path names the expected [1].
        bad = self.outs((3, 100, 384), "tensor",
                        rowwise_scale_inv=self.cuda(torch.zeros(1, 1)))
        with self.assertRaises(qcuda.ArgumentError) as cm:
            self.s.quantize(x, mode="tensor", columnwise=True, out=bad, stream=5)
        self.assertIn("out.rowwise_scale_inv: shape [1, 1], expected [1]", str(cm.exception))
        # Framework outputs: PyTorch is asked for [1] scales.
        got = []

        def fake_empty(torch_, specs, device, s, current=False):
            got.append(specs)
            return [self.cuda(torch.zeros(shape, dtype=dt)) for shape, dt in specs]
        self.s._torch_empty = fake_empty
        q = self.s.quantize(x, mode="tensor", columnwise=True, stream=5)
        self.assertEqual([shape for shape, _ in got[0]], [(300, 384), (1,), (384, 300), (1,)])
        self.assertEqual(tuple(q.rowwise_scale_inv.shape), (1,))

    def test_tensor_mode_dequantize_takes_any_one_element_scale(self):
        data = self.cuda(torch.zeros(256, 512, dtype=torch.uint8))
        out = self.cuda(torch.zeros(256, 512, dtype=torch.float32))
        for shape in ((1,), (1, 1), (1, 1, 1)):
            q = qcuda.QuantizedTensor((256, 512), "tensor", "e4m3", rowwise_data=data,
                                      rowwise_scale_inv=self.cuda(torch.ones(shape)))
            self.assertIs(self.s.dequantize(q, dtype="float32", out=out, stream=5), out)
            name, args = self.native.calls[-1]
            self.assertEqual(name, "dequantize")
            # (device, stream, shape, mode, format, bufs, shapes, ...): the scale's own shape.
            self.assertEqual((args[3], args[6][1]), (3, list(shape)))
            self.assertEqual(args[5][1][1], 4)
        n = len(self.native.calls)
        for bad in ((2,), (1, 2), (0,)):
            q = qcuda.QuantizedTensor((256, 512), "tensor", "e4m3", rowwise_data=data,
                                      rowwise_scale_inv=self.cuda(torch.ones(bad)))
            with self.assertRaises(qcuda.ArgumentError) as cm:
                self.s.dequantize(q, dtype="float32", out=out, stream=5)
            self.assertIn("rowwise_scale_inv: shape %s, expected [1]" % list(bad),
                          str(cm.exception))
        # A block mode still wants its exact 2-D scale shape.
        q = qcuda.QuantizedTensor((256, 512), "1d", "e4m3", rowwise_data=data,
                                  rowwise_scale_inv=self.cuda(torch.ones(1)))
        with self.assertRaises(qcuda.ArgumentError):
            self.s.dequantize(q, dtype="float32", out=out, stream=5)
        self.assertEqual(len(self.native.calls), n)

    def test_bad_out_tensors_fall_back_to_the_checked_path(self):
        x = self.cuda(torch.zeros(256, 512, dtype=torch.float32))
        bad = {
            "shape": self.outs((256, 512), rowwise_data=self.cuda(
                torch.zeros(256, 511, dtype=torch.uint8))),
            "dtype": self.outs((256, 512), rowwise_scale_inv=self.cuda(
                torch.zeros(qcuda.layout((256, 512))["rowwise_scale_inv"],
                            dtype=torch.uint8))),
            "not contiguous": self.outs((256, 512), columnwise_data=self.cuda(
                torch.zeros(256, 512, dtype=torch.uint8)).t()),
        }
        for what, out in bad.items():
            with self.assertRaises(qcuda.ArgumentError) as cm:
                self.s.quantize(x, columnwise=True, out=out, stream=5)
            self.assertIn(what, str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError) as cm:  # a missing output
            self.s.quantize(x, columnwise=True, out={"rowwise_data": None}, stream=5)
        self.assertEqual(self.native.calls, [])  # nothing was submitted
        # A non-contiguous input, a float64 input: refused by the checked path.
        with self.assertRaises(qcuda.ArgumentError) as cm:
            self.s.quantize(self.cuda(torch.zeros(512, 256)).t(), stream=5,
                            out=self.outs((256, 512)))
        self.assertIn("not contiguous", str(cm.exception))
        with self.assertRaises(qcuda.ArgumentError):
            self.s.quantize(self.cuda(torch.zeros(4, 128, dtype=torch.float64)), stream=5)
        self.assertEqual(self.native.calls, [])

    def test_one_native_plan_per_config_dtype_and_shape(self):
        x = self.cuda(torch.zeros(256, 512, dtype=torch.bfloat16))
        out = self.outs((256, 512))
        for _ in range(3):
            self.s.quantize(x, columnwise=True, out=out, stream=5)
        self.assertEqual(len(self.native.plans), 1)
        self.assertEqual(self.native.plans[0][:2], (qcuda.BFLOAT16, [256, 512]))
        # Another dtype, shape or config: a plan of its own.
        self.s.quantize(self.cuda(torch.zeros(256, 512)), columnwise=True, out=out, stream=5)
        self.s.quantize(x, columnwise=True, format="e5m2", out=out, stream=5)
        self.assertEqual(len(self.native.plans), 3)
        # amax_epsilon -0.0 equals 0.0 but its bits differ: not the 0.0 plan.
        self.s.quantize(x, columnwise=True, amax_epsilon=-0.0, out=out, stream=5)
        self.assertEqual(len(self.native.plans), 4)
        self.assertEqual(str(self.native.calls[-1][1][10]), "-0.0")
        self.s.quantize(x, columnwise=True, amax_epsilon=0.0, out=out, stream=5)
        self.assertEqual(len(self.native.plans), 4)
        self.assertEqual(str(self.native.calls[-1][1][10]), "0.0")
        # A new Session makes its own plans (plan ids are per native session).
        s2 = qcuda.Session("unix:///nonexistent/dir/qtxd.sock", timeout=1.0)
        s2._native = FakeNative()
        s2._submit = s2._native.submit_quantize
        s2.quantize(x, columnwise=True, out=out, stream=5)
        self.assertEqual(len(s2._native.plans), 1)
        s2.close()

    def test_framework_outputs(self):
        got = []

        def fake_empty(torch_, specs, device, s, current=False):
            got.append((specs, device, s))
            return [self.cuda(torch.zeros(shape, dtype=dt)) for shape, dt in specs]
        self.s._torch_empty = fake_empty
        x = self.cuda(torch.zeros(256, 512, dtype=torch.float16))
        q = self.s.quantize(x, mode="2d", columnwise=True, stream=9)
        lay = qcuda.layout((256, 512), "2d")
        self.assertEqual(got, [([(tuple(lay[f]), torch.float32 if "scale" in f else torch.uint8)
                                 for f in qcuda.FIELDS], 0, 9)])
        args = self.native.calls[-1][1]
        self.assertEqual(list(args[11::2]), [getattr(q, f).data_ptr() for f in qcuda.FIELDS])
        self.assertTrue(q._framework_alloc)
        # allocator='pool': the fast path declines pooled outputs.
        s2 = qcuda.Session("unix:///nonexistent/dir/qtxd.sock", timeout=1.0, allocator="pool")
        s2._native = FakeNative()
        s2._submit = s2._native.submit_quantize
        cfg = qcuda._config("1d", "e4m3", True, False, True, 0.0)
        self.assertIsNone(s2._quantize_torch(torch, x, cfg, "1d", "e4m3", None, 9))
        s2.close()
        with self.assertRaises(qcuda.ArgumentError):
            qcuda.Session("unix:///nonexistent/dir/qtxd.sock", timeout=1.0, allocator="torch")


class FakeBackend:
    def __init__(self):
        self.next = 0x7000000
        self.mallocs, self.frees, self.events = [], [], {}
        self.n_events = 0

    def malloc(self, device, nbytes):
        p = self.next
        self.next += nbytes + 0x100000
        self.mallocs.append((device, p, nbytes))
        return p

    def free(self, device, ptr):
        self.frees.append((device, ptr))

    def event_record(self, device, stream):
        self.n_events += 1
        self.events[self.n_events] = False
        return self.n_events

    def event_query(self, e):
        return self.events[e]

    def event_destroy(self, e):
        del self.events[e]


class PoolTest(unittest.TestCase):
    def test_carving_rounding_and_reuse_on_the_same_stream(self):
        be = FakeBackend()
        pool = qcuda.DevicePool(be, chunk_bytes=1 << 20, align=512)
        a = pool.alloc(0, 11, 1000)
        b = pool.alloc(0, 11, 1)
        self.assertEqual(a.nbytes, 1024)
        self.assertEqual(b.ptr, a.ptr + 1024)
        self.assertEqual(len(be.mallocs), 1)
        pa = a.ptr
        del a
        gc.collect()
        self.assertEqual(pool.stats()["free_blocks"], 1)
        other = pool.alloc(0, 22, 1000)  # another stream: not the freed block
        self.assertNotEqual(other.ptr, pa)
        same = pool.alloc(0, 11, 900)    # same stream, same size class: reused
        self.assertEqual(same.ptr, pa)
        st = pool.stats()
        self.assertEqual((st["chunks"], st["live_blocks"], st["reuses"], st["allocs"]),
                         (1, 3, 1, 4))

    def test_big_block_gets_its_own_chunk_and_churn_allocates_nothing(self):
        be = FakeBackend()
        pool = qcuda.DevicePool(be, chunk_bytes=4096, align=512)
        big = pool.alloc(1, 5, 10000)
        self.assertEqual(be.mallocs[-1][2], 10240)
        self.assertEqual(big.device, 1)
        for _ in range(100):  # a training loop: same shapes each step
            x, y = pool.alloc(1, 5, 2048), pool.alloc(1, 5, 512)
            del x, y
        self.assertEqual(len(be.mallocs), 2)
        self.assertEqual(pool.stats()["reuses"], 198)

    def test_record_stream_defers_reuse_until_the_event_completes(self):
        be = FakeBackend()
        pool = qcuda.DevicePool(be, chunk_bytes=1 << 20)
        a = pool.alloc(0, 1, 512)
        pa = a.ptr
        a.record_stream(2)
        a.record_stream(1)  # its own stream: no event needed
        del a
        gc.collect()
        self.assertEqual(be.n_events, 1)
        b = pool.alloc(0, 1, 512)
        self.assertNotEqual(b.ptr, pa)  # event pending
        be.events[1] = True
        c = pool.alloc(0, 1, 512)
        self.assertEqual(c.ptr, pa)
        self.assertEqual(be.events, {})  # destroyed once used

    def test_close_frees_idle_chunks_now_and_busy_ones_later(self):
        be = FakeBackend()
        pool = qcuda.DevicePool(be, chunk_bytes=1024)
        keep = pool.alloc(0, 1, 1024)
        tmp = pool.alloc(0, 1, 1024)
        del tmp
        gc.collect()
        pool.close()
        self.assertEqual(len(be.frees), 1)
        with self.assertRaises(qtx.errors.FailedPreconditionError):
            pool.alloc(0, 1, 10)
        del keep
        gc.collect()
        self.assertEqual(len(be.frees), 2)
        self.assertEqual(pool.stats()["chunks"], 0)

    def test_bad_pool_arguments(self):
        with self.assertRaises(qcuda.ArgumentError):
            qcuda.DevicePool(FakeBackend(), chunk_bytes=1024, align=300)

    def test_wrapped_generic_array_keeps_the_block(self):
        be = FakeBackend()
        pool = qcuda.DevicePool(be, chunk_bytes=1 << 20)
        parts = [((16, 16), qcuda.FLOAT32), ((3, 5), qcuda.UINT8), ((2, 4), qcuda.FLOAT32)]
        offsets, total = qcuda._pack(parts)
        self.assertEqual((offsets, total), ([0, 1024, 1280], 1536))  # 256-byte aligned views
        block = pool.alloc(0, 1, total)
        arrs = qcuda._wrap_many(block, parts, offsets, None)
        del block
        gc.collect()
        self.assertEqual(pool.stats()["live_blocks"], 1)
        cai = arrs[1].__cuda_array_interface__
        self.assertEqual((cai["shape"], cai["typestr"], cai["version"]), ((3, 5), "|u1", 3))
        self.assertEqual(cai["data"][0], arrs[0].ptr + 1024)
        del arrs[0], arrs[0]
        gc.collect()
        self.assertEqual(pool.stats()["live_blocks"], 1)  # one view still holds it
        del arrs, cai
        gc.collect()
        self.assertEqual(pool.stats()["live_blocks"], 0)


class CommandLineTest(unittest.TestCase):
    def env(self):
        return dict(os.environ, PYTHONPATH=ARGS.python_dir)

    def health(self, *args):
        """`python -m qtx health ARGS...`, finished (stdout, stderr, returncode)."""
        return subprocess.run([sys.executable, "-m", "qtx", "health"] + list(args),
                              env=self.env(), capture_output=True, text=True, timeout=60)

    def test_health_of_a_missing_qtxd(self):
        r = self.health("--target", "unix:///nonexistent/dir/qtxd.sock", "--timeout", "2")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("UNAVAILABLE", r.stdout)
        self.assertIn("qtx.cuda: yes", r.stdout)

    def test_health_wait(self):
        # No qtxd: DEADLINE_EXCEEDED after the wait, naming it.
        r = self.health("--target", "unix:///nonexistent/dir/qtxd.sock", "--wait", "0.5")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("DEADLINE_EXCEEDED", r.stdout)
        self.assertIn("not SERVING after 500ms", r.stdout)
        r = self.health("--wait", "-1")
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        # Started before its qtxd (through qtx._native): SERVING once qtxd is up.
        tmp = tempfile.mkdtemp(prefix="qtx-cuda-cpu-wait-")
        self.addCleanup(shutil.rmtree, tmp, True)
        sock = os.path.join(tmp, "qtxd.sock")
        waiter = subprocess.Popen([sys.executable, "-m", "qtx", "health", "--target",
                                   "unix://" + sock, "--wait", "60"], env=self.env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(waiter.kill)
        time.sleep(0.3)
        self.assertIsNone(waiter.poll(), "returned with no qtxd")
        server = qtxd_child.start(ARGS.qtxd, tmp, ["--device=cpu"])
        try:
            out, _ = waiter.communicate(timeout=90)
            self.assertEqual(waiter.returncode, 0, out)
            self.assertIn("SERVING via qtx._native", out)
            # qtx.cuda.Session's own wait, on a serving qtxd and on none.
            qcuda.Session(server.target, timeout=10.0).wait_until_serving(30)
            nobody = qcuda.Session("unix://" + os.path.join(tmp, "none.sock"), timeout=1.0)
            with self.assertRaises(qtx.errors.DeadlineExceededError) as cm:
                nobody.wait_until_serving(0.3)
            self.assertIn("none.sock", str(cm.exception))
        finally:
            self.assertEqual(server.stop(), 0)

    def test_import_without_grpc(self):
        code = (
            "import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'grpc' or name.startswith('google.protobuf'):\n"
            "            raise ImportError('no grpc or protobuf here')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import qtx, qtx.cuda\n"
            "e = qtx.errors.from_status(14, 'gone')\n"
            "print(type(e).__name__, e.code.name, qtx.errors.grpc is None)\n"
            "try:\n"
            "    qtx.Client\n"
            "except ImportError as err:\n"
            "    print('Client:', err)\n"
            "from qtx.optimizer import per_parameter\n"  # what qtx.cuda's offload uses
            "print('per_parameter:', per_parameter([0.5, None], ['a', 'b'], 'w'))\n")
        r = subprocess.run([sys.executable, "-c", code], env=self.env(), capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("UnavailableError UNAVAILABLE True", r.stdout)
        self.assertIn("Client: qtx.Client needs grpcio", r.stdout)
        self.assertIn("per_parameter: {'a': 0.5}", r.stdout)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--python_dir", required=True)
    p.add_argument("--qtxd", required=True)
    ARGS, rest = p.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
