"""qtx.cuda: qtx on CUDA tensors, zero-copy and stream-ordered.

    import torch, qtx.cuda
    with qtx.cuda.Session("unix:///tmp/qtxd.sock") as s:
        x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
        q = s.quantize(x, columnwise=True)        # returns at submission
        w8 = q.fp8()                              # float8_e4m3fn view of rowwise_data
        y = s.dequantize(q, dtype="bfloat16")     # ordered after the quantize
        s.synchronize()                           # host wait, e.g. at step end

Inputs are any CUDA array: a PyTorch tensor, a CuPy array, or any object
with ``__cuda_array_interface__`` (v2/v3) or ``__dlpack__`` /
``__dlpack_device__``. Nothing is copied: qtxd reads the input and writes the
outputs in this process's device memory (CUDA IPC, registered once per
allocation by the C++ ``qtx::cuda::RegionCache``).

Stream order. Each call runs on a stream: ``stream=`` (an int
``cudaStream_t``, a ``torch.cuda.Stream``, a ``cupy.cuda.Stream`` or any
object with ``__cuda_stream__``), else the framework's current stream on the
input's device (PyTorch: ``torch.cuda.current_stream(device)``; CuPy:
``cupy.cuda.get_current_stream()``; another ``__cuda_array_interface__``
producer: the ``stream`` it names, else the legacy default stream). qtxd
reads the inputs after the work queued on that stream before the call, and
work queued on that stream after the call sees the outputs. The call returns
once it is submitted (a few tens of microseconds); the host never waits. An
input whose ``__cuda_array_interface__`` names another stream is waited for
with an event (CAI v3); a DLPack producer is handed the call's stream
(``__dlpack__(stream=...)``), which orders its pending work itself.

Each (device, stream) pair gets its own ``qtx::Channel``, opened on first use
and kept until ``close()``.

Outputs and lifetimes. Outputs are written into ``out=`` tensors when given
(any CUDA array of the exact shape, dtype and contiguity; see
``Session.quantize``). Otherwise, for PyTorch inputs with
``Session(allocator="framework")`` (the default), into tensors from
PyTorch's caching allocator (``torch.empty`` with the call's stream current:
PyTorch's own stream rules apply, ``q.record_stream`` calls
``Tensor.record_stream``; their segments are registered with qtxd once each,
like inputs). For other inputs, and with ``allocator="pool"``, into blocks
of the session's ``DevicePool``, returned as tensors of the input's framework
(PyTorch / CuPy; other producers get ``DeviceArray`` objects with
``__cuda_array_interface__``):

- A pooled block belongs to the session; it is allocated on the call's
  stream and returns to the pool when the last tensor (or view) using it is
  garbage-collected. It is then reused only by a later call on the *same*
  stream (which, being stream-ordered, runs after every use queued on that
  stream before the tensor was freed) -- the rule of PyTorch's caching
  allocator. If you read a pooled output on another stream, call
  ``q.record_stream(other)`` (as ``Tensor.record_stream``): the block is then
  reused only after an event recorded on ``other`` when it was freed has
  completed.
- Pool memory comes from ``cudaMalloc`` in chunks (64 MiB by default), each
  registered with qtxd once: the allocator churn of a training loop never
  causes a registration per call. Chunks are freed by ``close()``; a chunk
  still holding a live block is freed when its last block is released.
  ``Session.pool.stats()`` reports chunks, bytes, live and free blocks.
- Inputs, and ``out=`` tensors from PyTorch's or CuPy's caching allocator,
  follow the framework's own rule: freeing a tensor and reusing its memory
  on the same stream is safe; on another stream use ``record_stream``.

Errors. Bad arguments (dtype, contiguity, device, shapes, strings) raise
``qtx.cuda.ArgumentError`` (a ``qtx.errors.InvalidArgumentError`` and a
``ValueError``) or ``ArgumentTypeError`` (also a ``TypeError``) before
anything is submitted. Failures of qtxd or the channel raise the
``qtx.errors`` class of their status code with qtxd's message (a failed
operation fails its channel: the next call on that stream and
``synchronize()`` raise it).

Optimizer: ``offload_optimizer_state`` hands FP32 masters to qtxd once;
``step`` then takes gradients in device memory and writes the FP8 parameters
into device memory, ordered on the call's stream by interprocess events (the
host waits for qtxd's answer, whose statistics need the gradients).

Speed: ``quantize`` of a contiguous PyTorch tensor with torch ``out=``
tensors (or framework-allocated outputs) takes a fast path: per (config,
dtype, shape) a memoized plan (the config and buffer sizes, registered once
with the native session, and the result's fixed fields),
``torch._C._cuda_getCurrentRawStream`` for the current stream, each tensor's
device, shape, dtype, contiguity and pointer read once, and one native call
of nine ints (``_native.submit_quantize``, a plain METH_FASTCALL function
that keeps the GIL unless another thread holds the session or the stream's
channel is opened); each region lookup in C++ is one driver call once the
allocation is registered, and the channel's socket write happens on its
background writer thread. Anything
else (CuPy, CAI, DLPack, bad arguments) takes the general, fully checked path.

Threads: a Session may be used from several threads; calls are serialized.
"""

import math
import sys
import threading

from qtx import errors

try:
    from qtx import _native
except ImportError as _e:  # pragma: no cover - depends on the build
    _native = None
    _NATIVE_IMPORT_ERROR = _e
else:
    _NATIVE_IMPORT_ERROR = None

DEFAULT_TARGET = "unix:///tmp/qtxd.sock"

# qtx.v1.DType numbers.
FLOAT32, BFLOAT16, FLOAT16, FLOAT8_E4M3, FLOAT8_E5M2, UINT8 = 1, 2, 3, 4, 5, 6
DTYPE_NAMES = {FLOAT32: "float32", BFLOAT16: "bfloat16", FLOAT16: "float16",
               FLOAT8_E4M3: "float8_e4m3fn", FLOAT8_E5M2: "float8_e5m2", UINT8: "uint8"}
_ITEMSIZE = {FLOAT32: 4, BFLOAT16: 2, FLOAT16: 2, FLOAT8_E4M3: 1, FLOAT8_E5M2: 1, UINT8: 1}
INPUT_DTYPES = (FLOAT32, BFLOAT16, FLOAT16)
# qtx.v1.ScalingMode: 1x128 blocks, 128x128 tiles, per-tensor current scaling
# (docs/numerics.md §9: one scale_inv of shape [1] per copy).
_MODES = {"1d": 1, "2d": 2, "tensor": 3}
_FORMATS = {"e4m3": 1, "e5m2": 2}
_OUT_DTYPES = {"float32": FLOAT32, "bfloat16": BFLOAT16, "float16": FLOAT16}
_GATHER_MODES = {"exact_fp8": 1, "gather_high_precision": 2}
_BACKENDS = {"auto": 0, "gloo": 1, "nccl": 2}
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")

# __cuda_array_interface__ typestr -> qtx dtype (bfloat16 has no typestr).
_TYPESTRS = {"<f4": FLOAT32, "<f2": FLOAT16, "|u1": UINT8, "<u1": UINT8}
_TYPESTR_OF = {FLOAT32: "<f4", FLOAT16: "<f2", UINT8: "|u1", BFLOAT16: "<u2",
               FLOAT8_E4M3: "|u1", FLOAT8_E5M2: "|u1"}
# DLPack (code, bits, lanes) -> qtx dtype. Codes: 1 uint, 2 float, 4 bfloat;
# DLPack 1.0's float8 codes: 10 e4m3fn, 12 e5m2.
_DLPACK_DTYPES = {(2, 32, 1): FLOAT32, (2, 16, 1): FLOAT16, (4, 16, 1): BFLOAT16,
                  (1, 8, 1): UINT8, (10, 8, 1): FLOAT8_E4M3, (12, 8, 1): FLOAT8_E5M2}
_KDLCUDA = 2
# How a pooled buffer is described to torch.as_tensor (bfloat16 is viewed after).
_RAW_TYPESTR = {FLOAT32: "<f4", FLOAT16: "<f2", BFLOAT16: "<i2", UINT8: "|u1",
                FLOAT8_E4M3: "|u1", FLOAT8_E5M2: "|u1"}
# cudaStreamLegacy: what "the default stream" means for a producer that names none.
LEGACY_STREAM = 1


class ArgumentError(errors.InvalidArgumentError, ValueError):
    """A bad argument, found before submission (also a ValueError)."""


class ArgumentTypeError(errors.InvalidArgumentError, TypeError):
    """An argument of the wrong kind (also a TypeError)."""


def _torch():
    return sys.modules.get("torch")


def _cupy():
    return sys.modules.get("cupy")


def _native_or_raise():
    if _native is None:
        raise ImportError("qtx._native is not built (%s): build the CMake target qtx_native or "
                          "pip install client/python on a CUDA build host"
                          % _NATIVE_IMPORT_ERROR)
    return _native


# ---- parsing CUDA arrays ----------------------------------------------------------------------


class CudaArray:
    """What qtx needs of a CUDA array, whatever produced it."""
    __slots__ = ("ptr", "shape", "dtype", "device", "contiguous", "framework", "stream_hint",
                 "obj", "keepalive")

    def __init__(self, ptr, shape, dtype, device, contiguous, framework, stream_hint=None,
                 obj=None, keepalive=None):
        self.ptr = ptr
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.device = device
        self.contiguous = contiguous
        self.framework = framework    # "torch", "cupy" or None
        self.stream_hint = stream_hint  # CAI v3 "stream", or None
        self.obj = obj
        self.keepalive = keepalive    # e.g. a DLPack capsule, until submission

    @property
    def nbytes(self):
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def _c_contiguous(shape, strides, itemsize):
    """Whether `strides` (in bytes) describe a C-contiguous `shape`; dims of
    size 1 may carry any stride, an empty array is contiguous."""
    if strides is None:
        return True
    if len(strides) != len(shape):
        return False
    if any(d == 0 for d in shape):
        return True
    expected = itemsize
    for d, s in zip(reversed(shape), reversed(strides)):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


_TORCH_DTYPES = {}


def _torch_dtype_map(torch):
    """{torch dtype: qtx dtype} (built once)."""
    if _TORCH_DTYPES:
        return _TORCH_DTYPES
    m = {torch.float32: FLOAT32, torch.bfloat16: BFLOAT16, torch.float16: FLOAT16,
         torch.uint8: UINT8}
    for name, code in (("float8_e4m3fn", FLOAT8_E4M3), ("float8_e5m2", FLOAT8_E5M2)):
        if hasattr(torch, name):
            m[getattr(torch, name)] = code
    _TORCH_DTYPES.update(m)
    return _TORCH_DTYPES


def from_cuda_array_interface(cai, what, obj=None, device_of=None):
    """A CudaArray from a __cuda_array_interface__ dict (v2 or v3).
    device_of(ptr) gives the device of a pointer (qtx._native.pointer_device
    by default)."""
    if not isinstance(cai, dict):
        raise ArgumentTypeError("%s: __cuda_array_interface__ is a %s, not a dict"
                                % (what, type(cai).__name__))
    version = cai.get("version", 0)
    if version < 2:
        raise ArgumentError("%s: __cuda_array_interface__ version %r: qtx needs 2 or 3"
                            % (what, version))
    if cai.get("mask") is not None:
        raise ArgumentError("%s: masked arrays (__cuda_array_interface__ 'mask') are not "
                            "supported" % what)
    try:
        ptr, readonly = cai["data"]
        shape = tuple(cai["shape"])
        typestr = cai["typestr"]
    except (KeyError, TypeError, ValueError):
        raise ArgumentError("%s: __cuda_array_interface__ needs 'data' (ptr, readonly), "
                            "'shape' and 'typestr'" % what) from None
    if typestr not in _TYPESTRS:
        raise ArgumentError("%s: typestr %r: qtx takes %s through __cuda_array_interface__ "
                            "(bfloat16 has no typestr: pass it by DLPack or as a torch tensor)"
                            % (what, typestr, sorted(_TYPESTRS)))
    dtype = _TYPESTRS[typestr]
    stream = cai.get("stream") if version >= 3 else None
    if stream is not None:
        if not isinstance(stream, int) or isinstance(stream, bool):
            raise ArgumentError("%s: __cuda_array_interface__ 'stream' %r is not an int"
                                % (what, stream))
        if stream == 0:
            raise ArgumentError("%s: __cuda_array_interface__ 'stream' 0 is disallowed by "
                                "CAI v3 (ambiguous); the producer should name 1 (legacy "
                                "default), 2 (per-thread default) or its stream" % what)
    contiguous = _c_contiguous(shape, cai.get("strides"), _ITEMSIZE[dtype])
    if ptr == 0 and math.prod(shape) > 0:
        raise ArgumentError("%s: null data pointer" % what)
    device = (device_of or _pointer_device)(ptr) if ptr else -1
    return CudaArray(ptr, shape, dtype, device, contiguous, None, stream, obj)


def _pointer_device(ptr):
    return _native_or_raise().pointer_device(ptr)


def from_dlpack_capsule(capsule, what, obj=None, parse=None):
    """A CudaArray from an unconsumed DLPack capsule (the capsule is kept
    alive with it, and never consumed)."""
    ptr, shape, strides, dt, dev = (parse or _native_or_raise().parse_dlpack)(capsule)
    if dev[0] != _KDLCUDA:
        raise ArgumentError("%s: DLPack device type %d: qtx.cuda takes CUDA memory (kDLCUDA=2)"
                            % (what, dev[0]))
    dtype = _DLPACK_DTYPES.get(tuple(dt))
    if dtype is None:
        raise ArgumentError("%s: DLPack dtype (code %d, bits %d, lanes %d) is not one qtx "
                            "takes (float32, bfloat16, float16, uint8, float8)" % ((what,) + tuple(dt)))
    byte_strides = None if strides is None else [s * _ITEMSIZE[dtype] for s in strides]
    contiguous = _c_contiguous(tuple(shape), byte_strides, _ITEMSIZE[dtype])
    return CudaArray(ptr, shape, dtype, dev[1], contiguous, None, None, obj, keepalive=capsule)


def as_cuda_array(x, what, stream_for_dlpack=None):
    """Parses a torch tensor, a CuPy array, a __cuda_array_interface__ or a
    DLPack object. stream_for_dlpack(device) -> the stream handle to pass to
    __dlpack__ (called only for DLPack producers)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cuda:
            raise ArgumentError("%s: a tensor on %s; qtx.cuda takes CUDA tensors (qtx.Client "
                                "takes host tensors)" % (what, x.device))
        dtype = _torch_dtype_map(torch).get(x.dtype)
        if dtype is None:
            raise ArgumentError("%s: dtype %s is not one qtx takes" % (what, x.dtype))
        return CudaArray(x.data_ptr(), x.shape, dtype, x.device.index, x.is_contiguous(),
                         "torch", None, x)
    cupy = _cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        dtype = _TYPESTRS.get(x.dtype.str)
        if dtype is None:
            raise ArgumentError("%s: dtype %s is not one qtx takes from CuPy (float32, "
                                "float16, uint8)" % (what, x.dtype))
        return CudaArray(x.data.ptr, x.shape, dtype, x.device.id, x.flags.c_contiguous,
                         "cupy", None, x)
    if isinstance(x, DeviceArray):
        return CudaArray(x.ptr, x.shape, x.dtype, x.device, True, None, None, x)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return from_cuda_array_interface(cai, what, x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = x.__dlpack_device__()
        if int(dev_type) != _KDLCUDA:
            raise ArgumentError("%s: DLPack device type %d: qtx.cuda takes CUDA memory "
                                "(kDLCUDA=2)" % (what, int(dev_type)))
        stream = stream_for_dlpack(int(dev_id)) if stream_for_dlpack else LEGACY_STREAM
        return from_dlpack_capsule(x.__dlpack__(stream=stream), what, x)
    raise ArgumentTypeError("%s: a %s is not a CUDA array (expected a torch tensor, a CuPy "
                            "array, or an object with __cuda_array_interface__ or __dlpack__)"
                            % (what, type(x).__name__))


def stream_handle(stream, framework=None, device=0, hint=None):
    """The cudaStream_t (int) of `stream`: an int, a torch/CuPy stream, or an
    object with __cuda_stream__; None: the framework's current stream on
    `device`, else `hint` (a CAI v3 stream), else the legacy default stream."""
    if stream is None:
        if framework == "torch":
            return _torch().cuda.current_stream(device).cuda_stream
        if framework == "cupy":
            cupy = _cupy()
            with cupy.cuda.Device(device):
                return cupy.cuda.get_current_stream().ptr
        return hint if hint is not None else LEGACY_STREAM
    if isinstance(stream, bool):
        raise ArgumentTypeError("stream=%r: expected an int handle or a stream object" % stream)
    if isinstance(stream, int):
        if stream < 0:
            raise ArgumentError("stream=%d: a cudaStream_t handle is >= 0" % stream)
        return stream
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream / ExternalStream
        return int(stream.cuda_stream)
    if hasattr(stream, "__cuda_stream__"):  # the CUDA Python stream protocol
        return int(stream.__cuda_stream__()[1])
    cupy = _cupy()
    if cupy is not None and isinstance(stream, cupy.cuda.Stream):
        return int(stream.ptr)
    raise ArgumentTypeError("stream: a %s is not a stream (expected an int cudaStream_t, a "
                            "torch.cuda.Stream, a cupy.cuda.Stream or an object with "
                            "__cuda_stream__)" % type(stream).__name__)


# ---- configs and layouts ----------------------------------------------------------------------


def _choice(value, table, name):
    if value not in table:
        raise ArgumentError("%s=%r: must be one of %s" % (name, value, sorted(table)))
    return table[value]


def quantize_config(mode="1d", format="e4m3", rowwise=True, columnwise=False, pow2_scales=True,
                    amax_epsilon=0.0):
    """(mode, format, rowwise, columnwise, pow2, eps) numbers, checked."""
    m = _choice(mode, _MODES, "mode")
    f = _choice(format, _FORMATS, "format")
    if not (rowwise or columnwise):
        raise ArgumentError("rowwise=False and columnwise=False: ask for at least one copy")
    eps = float(amax_epsilon)
    if not math.isfinite(eps) or eps < 0:
        raise ArgumentError("amax_epsilon=%r: must be finite and >= 0" % amax_epsilon)
    return m, f, bool(rowwise), bool(columnwise), bool(pow2_scales), eps


def layout(shape, mode="1d"):
    """The shapes of the four buffers of quantizing a tensor of `shape`
    (flattened to [prod(shape[:-1]), shape[-1]]): {field: (rows, cols)} plus
    'm' and 'n' (the C++ qtx::ComputeQuantizedLayout, docs/numerics.md §4.1);
    mode 'tensor' has one scale per copy, of shape (1,) (§9)."""
    m = _choice(mode, _MODES, "mode") if isinstance(mode, str) else mode
    shape = [int(d) for d in shape]
    if not shape:
        raise ArgumentError("shape []: quantization needs rank >= 1")
    if any(d < 0 for d in shape):
        raise ArgumentError("shape %s: negative dimension" % shape)
    key = (m, tuple(shape))
    lay = _LAYOUTS.get(key)
    if lay is None:
        lay = _native_or_raise().layout(m, shape)
        if len(_LAYOUTS) > 4096:
            _LAYOUTS.clear()
        _LAYOUTS[key] = lay
    return lay


_LAYOUTS = {}
_CONFIGS = {}
_PLANS = {}


def _config(mode, format, rowwise, columnwise, pow2_scales, amax_epsilon):
    """quantize_config, memoized on its arguments. Only valid configs are
    kept: a bad argument is checked (and raises) on every call."""
    key = (mode, format, rowwise, columnwise, pow2_scales, amax_epsilon)
    if amax_epsilon == 0 and math.copysign(1.0, amax_epsilon) < 0:
        # -0.0 == 0.0 as a key, but its bits differ: a 7th entry keeps this
        # config (and the fast path's plan for it) apart from 0.0's.
        return quantize_config(*key) + ("-0.0",)
    try:
        cfg = _CONFIGS.get(key)
    except TypeError:  # an unhashable argument: no memo
        return quantize_config(*key)
    if cfg is None:
        cfg = quantize_config(*key)
        if len(_CONFIGS) > 1024:
            _CONFIGS.clear()
        _CONFIGS[key] = cfg
    return cfg


def _plan(shape, cfg):
    """What quantizing `shape` with `cfg` writes, memoized: (layout,
    ((field, 2-D shape, bytes, is_scale, index in FIELDS) for each copy cfg
    asks for, in FIELDS order))."""
    key = (cfg[0], cfg[2], cfg[3], shape)
    p = _PLANS.get(key)
    if p is None:
        lay = layout(shape, cfg[0])
        parts = []
        for i, f in enumerate(FIELDS):
            if cfg[2] if i < 2 else cfg[3]:
                shp = tuple(int(d) for d in lay[f])
                scale = i % 2 == 1
                parts.append((f, shp, math.prod(shp) * (4 if scale else 1), scale, i))
        p = (lay, tuple(parts))
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[(cfg[0], cfg[2], cfg[3], tuple(int(d) for d in shape))] = p
    return p


_TORCH_FAST = []


def _torch_fast(torch):
    """What the PyTorch fast path of Session.quantize needs, built once:
    (torch.Tensor, {input dtype: qtx dtype}, {format: ok data dtypes},
    float32, uint8, current_stream(device) -> int)."""
    if _TORCH_FAST:
        return _TORCH_FAST[0]
    m = _torch_dtype_map(torch)
    inputs = {t: q for t, q in m.items() if q in INPUT_DTYPES}
    data_ok = {1: {t for t, q in m.items() if q in (UINT8, FLOAT8_E4M3)},
               2: {t for t, q in m.items() if q in (UINT8, FLOAT8_E5M2)}}
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # older PyTorch: the public (slower) way
        def raw(device):
            return torch.cuda.current_stream(device).cuda_stream
    _TORCH_FAST.append((torch.Tensor, inputs, data_ok, torch.float32, torch.uint8, raw))
    return _TORCH_FAST[0]


def _field_dtype_ok(field, dtype, fmt):
    if field.endswith("scale_inv"):
        return dtype == FLOAT32
    return dtype in (UINT8, FLOAT8_E4M3 if fmt == 1 else FLOAT8_E5M2)


# ---- device memory pool -----------------------------------------------------------------------


class _NativeCudaBackend:
    """DevicePool's CUDA calls, through qtx._native."""

    def malloc(self, device, nbytes):
        return _native.malloc(device, nbytes)

    def free(self, device, ptr):
        _native.free(device, ptr)

    def event_record(self, device, stream):
        return _native.event_record(device, stream)

    def event_query(self, event):
        return _native.event_query(event)

    def event_destroy(self, event):
        _native.event_destroy(event)


class _Chunk:
    __slots__ = ("device", "ptr", "nbytes", "top", "live")

    def __init__(self, device, ptr, nbytes):
        self.device, self.ptr, self.nbytes, self.top, self.live = device, ptr, nbytes, 0, 0


class PoolBlock:
    """A block of pool memory. Frameworks' tensors made from it keep it alive
    (as the owner of their storage); when the last is collected, __del__
    gives it back to the pool."""
    __slots__ = ("pool", "chunk", "offset", "nbytes", "device", "stream", "streams",
                 "__cuda_array_interface__", "__weakref__")

    def __init__(self, pool, chunk, offset, nbytes, stream):
        self.pool, self.chunk, self.offset, self.nbytes = pool, chunk, offset, nbytes
        self.device, self.stream, self.streams = chunk.device, stream, None

    @property
    def ptr(self):
        return self.chunk.ptr + self.offset

    def record_stream(self, stream):
        """Marks the block as used on `stream` (an int handle) too."""
        if stream != self.stream:
            if self.streams is None:
                self.streams = set()
            self.streams.add(stream)

    def __del__(self):
        pool = self.pool
        if pool is not None:
            self.pool = None
            try:
                pool._release(self)
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass


class DevicePool:
    """Registered device memory for outputs, owned by a Session (see the
    module doc for the lifetime rules).

    Blocks are rounded up to `align` bytes and kept per (device, stream,
    size): a released block is reused by the next allocation of that size on
    that stream (or, when it was used on other streams, once the events
    recorded on them at release have completed). New blocks are carved from
    chunks of `chunk_bytes` (bigger for a bigger block) from backend.malloc.
    Thread-safe."""

    def __init__(self, backend=None, chunk_bytes=64 << 20, align=512):
        if chunk_bytes <= 0 or align <= 0 or align & (align - 1):
            raise ArgumentError("chunk_bytes=%r, align=%r: positive, align a power of 2"
                                % (chunk_bytes, align))
        self._backend = backend or _NativeCudaBackend()
        self.chunk_bytes = int(chunk_bytes)
        self.align = int(align)
        self._lock = threading.Lock()
        self._chunks = []       # every chunk not yet freed
        self._free = {}         # (device, stream, size) -> [(chunk, offset, events)]
        self._closed = False
        self._allocs = 0
        self._reuses = 0

    def _round(self, nbytes):
        return max(self.align, (int(nbytes) + self.align - 1) // self.align * self.align)

    def alloc(self, device, stream, nbytes):
        """A PoolBlock of at least `nbytes` on `device`, for use on `stream`."""
        size = self._round(nbytes)
        with self._lock:
            if self._closed:
                raise errors.FailedPreconditionError("the session's pool is closed")
            self._allocs += 1
            entries = self._free.get((device, stream, size))
            if entries:
                for i, (chunk, offset, events) in enumerate(entries):
                    if events and not all(self._backend.event_query(e) for e in events):
                        continue
                    for e in events or ():
                        self._backend.event_destroy(e)
                    del entries[i]
                    self._reuses += 1
                    chunk.live += 1
                    return PoolBlock(self, chunk, offset, size, stream)
            chunk = None
            for c in self._chunks:
                if c.device == device and c.nbytes - c.top >= size:
                    chunk = c
                    break
            if chunk is None:
                nb = max(self.chunk_bytes, size)
                chunk = _Chunk(device, self._backend.malloc(device, nb), nb)
                self._chunks.append(chunk)
            offset = chunk.top
            chunk.top += size
            chunk.live += 1
            return PoolBlock(self, chunk, offset, size, stream)

    def _release(self, block):
        events = [self._backend.event_record(block.device, s) for s in (block.streams or ())]
        with self._lock:
            chunk = block.chunk
            chunk.live -= 1
            if self._closed:
                for e in events:
                    self._backend.event_destroy(e)
                if chunk.live == 0 and chunk in self._chunks:
                    self._chunks.remove(chunk)
                    self._backend.free(chunk.device, chunk.ptr)
                return
            self._free.setdefault((block.device, block.stream, block.nbytes), []).append(
                (chunk, block.offset, events))

    def close(self):
        """Frees every chunk without live blocks now, the others when their
        last block is released. REQUIRES: the GPU work that used the pool is
        done (Session.close synchronizes first)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for entries in self._free.values():
                for _, _, events in entries:
                    for e in events or ():
                        self._backend.event_destroy(e)
            self._free.clear()
            keep = []
            for c in self._chunks:
                if c.live == 0:
                    self._backend.free(c.device, c.ptr)
                else:
                    keep.append(c)
            self._chunks = keep

    def stats(self):
        """{'chunks', 'reserved_bytes', 'live_blocks', 'free_blocks', 'allocs', 'reuses'}."""
        with self._lock:
            return {"chunks": len(self._chunks),
                    "reserved_bytes": sum(c.nbytes for c in self._chunks),
                    "live_blocks": sum(c.live for c in self._chunks),
                    "free_blocks": sum(len(v) for v in self._free.values()),
                    "allocs": self._allocs, "reuses": self._reuses}


class DeviceArray:
    """A pooled output for inputs that came from neither PyTorch nor CuPy:
    exposes __cuda_array_interface__ v3 (stream None: ordered on the call's
    stream already). Keeps its pool block alive."""

    def __init__(self, block, shape, dtype, offset=0):
        self.block = block
        self.ptr = block.ptr + offset
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = block.device

    @property
    def __cuda_array_interface__(self):
        return {"version": 3, "data": (self.ptr, False), "shape": self.shape,
                "typestr": _TYPESTR_OF[self.dtype], "strides": None, "stream": None}


_VIEW_ALIGN = 256


def _pack(parts):
    """Offsets of `parts` [(shape, dtype)] packed into one block, each
    aligned to 256 bytes; returns ([offset], total bytes)."""
    offsets, total = [], 0
    for shape, dtype in parts:
        offsets.append(total)
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        total += (nbytes + _VIEW_ALIGN - 1) // _VIEW_ALIGN * _VIEW_ALIGN
    return offsets, max(total, _VIEW_ALIGN)


def _wrap_many(block, parts, offsets, framework):
    """Tensors of `framework` over parts [(shape, dtype)] of one pool block at
    `offsets`: one framework allocation wrapper (which keeps the block alive
    until every view is gone), then views."""
    if framework == "torch":
        torch = _torch()
        block.__cuda_array_interface__ = {
            "version": 3, "data": (block.ptr, False), "shape": (block.nbytes,),
            "typestr": "|u1", "strides": None, "stream": None}
        base = torch.as_tensor(block, device=torch.device("cuda", block.device))
        tdt = {FLOAT32: torch.float32, FLOAT16: torch.float16, BFLOAT16: torch.bfloat16,
               UINT8: torch.uint8}
        out = []
        for (shape, dtype), off in zip(parts, offsets):
            nbytes = math.prod(shape) * _ITEMSIZE[dtype]
            out.append(base[off:off + nbytes].view(tdt[dtype]).view(shape))
        return out
    if framework == "cupy":
        cupy = _cupy()
        mem = cupy.cuda.UnownedMemory(block.ptr, block.nbytes, block, block.device)
        out = []
        for (shape, dtype), off in zip(parts, offsets):
            if dtype == BFLOAT16:
                raise ArgumentError("dtype='bfloat16': CuPy has no bfloat16; ask float32/float16")
            out.append(cupy.ndarray(tuple(shape), dtype=_TYPESTR_OF[dtype],
                                    memptr=cupy.cuda.MemoryPointer(mem, off)))
        return out
    return [DeviceArray(block, shape, dtype, off) for (shape, dtype), off in zip(parts, offsets)]


# ---- results ----------------------------------------------------------------------------------


class _FastPlan:
    """Session._quantize_torch's per-(config, dtype, shape) memo: the native
    plan id, the requested copies ((field, 2-D shape, is_scale, index)), their
    torch.empty specs, and the result's fields for QuantizedTensor.__dict__
    (mode/format as the caller spelled them)."""
    __slots__ = ("plan", "parts", "specs", "base")

    def __init__(self, plan, parts, specs, base):
        self.plan, self.parts, self.specs, self.base = plan, parts, specs, base


class QuantizedTensor:
    """A block-scaled FP8 tensor in device memory, with qtx.client's field
    names: shape (logical, of the high-precision tensor), mode, format,
    rowwise_data [M, N] uint8, rowwise_scale_inv float32 2-D, columnwise_data
    [N, M] uint8, columnwise_scale_inv float32 2-D (absent copies: None); for
    mode 'tensor' each scale_inv has shape [1] (docs/numerics.md §9).
    The tensors are valid on `stream` after the call (stream order); `op` is
    the channel's operation id (query() tells whether it has finished)."""

    def __init__(self, shape, mode, format, rowwise_data=None, rowwise_scale_inv=None,
                 columnwise_data=None, columnwise_scale_inv=None):
        # Session._quantize_torch sets these same fields without __init__: keep both in step.
        self.shape = tuple(shape)
        self.mode = mode
        self.format = format
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.stream = None
        self.device = None
        self.op = None
        self._session = None
        self._blocks = ()
        self._framework_alloc = False  # outputs from PyTorch's caching allocator

    def __repr__(self):
        present = [f for f in FIELDS if getattr(self, f) is not None]
        return "qtx.cuda.QuantizedTensor(shape=%s, mode=%r, format=%r, %s, op=%s)" % (
            self.shape, self.mode, self.format, "+".join(present), self.op)

    def fp8(self, which="rowwise"):
        """The data of `which` ('rowwise' or 'columnwise') as a float8_e4m3fn
        / float8_e5m2 view (PyTorch >= 2.1); TypeError for frameworks
        without FP8 dtypes (use the uint8 data)."""
        if which not in ("rowwise", "columnwise"):
            raise ArgumentError("which=%r: must be 'rowwise' or 'columnwise'" % which)
        data = getattr(self, which + "_data")
        if data is None:
            raise ArgumentError("%s copy was not requested" % which)
        torch = _torch()
        if torch is not None and isinstance(data, torch.Tensor):
            name = "float8_e4m3fn" if self.format == "e4m3" else "float8_e5m2"
            if not hasattr(torch, name):
                raise ArgumentTypeError("torch %s has no %s dtype (PyTorch >= 2.1 has)"
                                        % (torch.__version__, name))
            return data.view(getattr(torch, name))
        raise ArgumentTypeError("%s has no FP8 dtype: use %s_data (uint8)"
                                % (type(data).__name__, which))

    def query(self):
        """True once the operation has finished (host view; raises its failure)."""
        if self.op is None:
            raise ArgumentError("not a channel operation (an optimizer step's outputs are "
                                "ordered by an event: synchronize the stream instead)")
        return self._session._native.query(self.device, self.stream, self.op)

    def record_stream(self, stream):
        """Tells the pool (or PyTorch's allocator, Tensor.record_stream, for
        outputs it allocated) that the outputs are used on `stream` too."""
        h = stream_handle(stream)
        for b in self._blocks:
            b.record_stream(h)
        if self._framework_alloc:
            torch = _torch()
            if not isinstance(stream, torch.cuda.Stream):
                stream = torch.cuda.ExternalStream(h, device=torch.device("cuda", self.device))
            for f in FIELDS:
                t = getattr(self, f)
                if t is not None:
                    t.record_stream(stream)


class AllGatherHandle:
    """What Session.all_gather(async_op=True) returns. wait(stream) orders
    `stream` after the gathered result on the GPU (no host wait), as
    torch.distributed's async work handles do."""

    def __init__(self, session, result, device, stream, event):
        self.result = result
        self._session = session
        self._device = device
        self._stream = stream
        self._event = event

    def wait(self, stream=None):
        """Orders `stream` (default: the framework's current stream) after
        the result; returns the result."""
        fw = _framework_of(self.result)
        h = stream_handle(stream, fw, self._device)
        if h != self._stream:
            _native.stream_wait_event(self._device, h, self._event)
        return self.result

    def is_completed(self):
        return self.result.query()

    def __del__(self):
        ev, self._event = getattr(self, "_event", None), None
        if ev is not None and _native is not None:
            try:
                _native.event_destroy(ev)
            except Exception:  # noqa: BLE001
                pass


def _framework_of(q):
    for f in FIELDS:
        t = getattr(q, f)
        if t is not None:
            torch, cupy = _torch(), _cupy()
            if torch is not None and isinstance(t, torch.Tensor):
                return "torch"
            if cupy is not None and isinstance(t, cupy.ndarray):
                return "cupy"
            return None
    return None


# ---- the session ------------------------------------------------------------------------------


class Session:
    """A connection to one qtxd for stream-ordered calls on CUDA tensors.

    target: qtxd's gRPC target. device: if given (int or 'cuda:N'), inputs
    must live on it. flag_memory: 'host' (the channel flags in shared host
    memory; qtxd needs --allow_client_shm) or 'device' (CUDA IPC; see
    client/README.md). pool_chunk_bytes: the DevicePool's chunk size.
    allocator: where outputs not passed as out= come from: 'framework'
    (default: for PyTorch inputs, torch.empty from PyTorch's caching
    allocator on the call's stream; other inputs use the DevicePool) or
    'pool' (always the session's DevicePool). background_writer: each
    channel's stream writes to qtxd start on a thread of the channel's own
    (qtx::ChannelOptions::background_writer), so that a call returns
    without writing the socket itself (default True; False: the calling
    thread writes, one thread fewer per (device, stream) used)."""

    def __init__(self, target=DEFAULT_TARGET, device=None, flag_memory="host", timeout=60.0,
                 label="py", pool_chunk_bytes=64 << 20, allocator="framework",
                 background_writer=True):
        native = _native_or_raise()
        if flag_memory not in ("host", "device"):
            raise ArgumentError("flag_memory=%r: must be 'host' or 'device'" % flag_memory)
        if allocator not in ("framework", "pool"):
            raise ArgumentError("allocator=%r: must be 'framework' or 'pool'" % (allocator,))
        self.device = _device_index(device)
        self.allocator = allocator
        self._native = native.Session(target, flag_memory, label, float(timeout),
                                      bool(background_writer))
        self._submit = native.submit_quantize  # the fast path's one native call
        self._fast_plans = {}  # (cfg, qtx dtype, shape) -> _FastPlan (plan ids: per session)
        self.pool = DevicePool(_NativeCudaBackend(), pool_chunk_bytes)
        self._tdevs = {}        # device index -> torch.device
        self._ext_streams = {}  # (device, cudaStream_t) -> torch.cuda.ExternalStream
        self._world = {}
        self._groups = {}
        self._closed = False

    # -- plumbing

    def _input(self, x, what, stream):
        holder = {}

        def dl_stream(device):
            holder["s"] = stream_handle(stream, None, device)
            return holder["s"]

        a = as_cuda_array(x, what, dl_stream)
        if a.device < 0:
            raise ArgumentError("%s: pointer 0x%x is not device memory" % (what, a.ptr))
        if self.device is not None and a.device != self.device:
            raise ArgumentError("%s: on cuda:%d, the session is for cuda:%d"
                                % (what, a.device, self.device))
        s = holder.get("s")
        if s is None:
            s = stream_handle(stream, a.framework, a.device, a.stream_hint)
        if a.stream_hint is not None and a.stream_hint != s:
            # CAI v3: the producer's work on its stream must come first.
            ev = _native.event_record(a.device, a.stream_hint)
            try:
                _native.stream_wait_event(a.device, s, ev)
            finally:
                _native.event_destroy(ev)
        return a, s

    def _out_tensor(self, t, what, shape, dtype_ok, device, expect):
        a = as_cuda_array(t, what)
        if not dtype_ok(a.dtype):
            raise ArgumentError("%s: dtype %s, expected %s" % (what, DTYPE_NAMES[a.dtype],
                                                               expect))
        if tuple(a.shape) != tuple(shape):
            raise ArgumentError("%s: shape %s, expected %s" % (what, list(a.shape), list(shape)))
        if not a.contiguous:
            raise ArgumentError("%s: not contiguous (qtx writes C-contiguous buffers)" % what)
        if a.device != device:
            raise ArgumentError("%s: on cuda:%d, the input is on cuda:%d" % (what, a.device,
                                                                             device))
        return a

    def _torch_empty(self, torch, specs, device, s, current=False):
        """Tensors for [(shape, torch dtype)] from PyTorch's caching allocator
        on cuda:`device`, for use on stream `s` (allocated with `s` current,
        so PyTorch reuses the memory only in stream order after the work
        queued on `s`). current: `s` is known to be the current stream."""
        dev = self._tdevs.get(device)
        if dev is None:
            dev = self._tdevs[device] = torch.device("cuda", device)
        if current or s == _torch_fast(torch)[5](device):
            return [torch.empty(shape, dtype=dt, device=dev) for shape, dt in specs]
        es = self._ext_streams.get((device, s))
        if es is None:
            es = self._ext_streams[(device, s)] = torch.cuda.ExternalStream(s, device=dev)
        with torch.cuda.stream(es):
            return [torch.empty(shape, dtype=dt, device=dev) for shape, dt in specs]

    def _quantize_outputs(self, out, lay, cfg, a, s, fields=None):
        """([4 x (ptr, bytes) or None], {field: tensor}, [pool blocks]).
        fields: the buffers to make (default: those cfg asks for)."""
        fmt, row, col = cfg[1], cfg[2], cfg[3]
        if fields is None:
            fields = [f for f in FIELDS if (row if f.startswith("row") else col)]
        tensors, blocks = {}, []
        bufs = {}
        if out is not None:
            for f in fields:
                t = out.get(f) if isinstance(out, dict) else getattr(out, f, None)
                if t is None:
                    raise ArgumentError("out: no %s (the config asks for it)" % f)
                scale = f.endswith("scale_inv")
                o = self._out_tensor(t, "out." + f, lay[f],
                                     lambda d, f=f: _field_dtype_ok(f, d, fmt), a.device,
                                     "float32" if scale else "uint8 or the format's float8")
                bufs[f] = (o.ptr, o.nbytes)
                tensors[f] = t
        elif a.framework == "torch" and self.allocator == "framework":
            torch = _torch()
            parts = [(tuple(lay[f]), FLOAT32 if f.endswith("scale_inv") else UINT8)
                     for f in fields]
            ts = self._torch_empty(torch, [(shape, torch.float32 if dt == FLOAT32 else torch.uint8)
                                           for shape, dt in parts], a.device, s)
            for f, (shape, dt), t in zip(fields, parts, ts):
                bufs[f] = (t.data_ptr(), math.prod(shape) * _ITEMSIZE[dt])
                tensors[f] = t
        else:
            parts = [(lay[f], FLOAT32 if f.endswith("scale_inv") else UINT8) for f in fields]
            offsets, total = _pack(parts)
            block = self.pool.alloc(a.device, s, total)
            blocks.append(block)
            views = _wrap_many(block, parts, offsets, a.framework)
            for f, (shape, dtype), off, t in zip(fields, parts, offsets, views):
                bufs[f] = (block.ptr + off, math.prod(shape) * _ITEMSIZE[dtype])
                tensors[f] = t
        return [bufs.get(f) for f in FIELDS], tensors, blocks

    # -- calls

    def quantize(self, x, mode="1d", format="e4m3", rowwise=True, columnwise=False,
                 pow2_scales=True, amax_epsilon=0.0, out=None, stream=None):
        """Submits the quantization of `x` (float32 / bfloat16 / float16,
        C-contiguous, [..., N]; leading dims flatten into M) and returns a
        QuantizedTensor at once. mode: '1d' (1x128 blocks), '2d' (128x128
        tiles) or 'tensor' (per-tensor current scaling: one scale_inv of
        shape [1] per copy, docs/numerics.md §9). out: a QuantizedTensor or
        {field: tensor} with every requested buffer (uint8 or the format's
        float8 data, float32 scales, shapes as qtx.cuda.layout), else pooled
        outputs."""
        cfg = _config(mode, format, rowwise, columnwise, pow2_scales, amax_epsilon)
        torch = _torch()
        if torch is not None:
            q = self._quantize_torch(torch, x, cfg, mode, format, out, stream)
            if q is not None:
                return q
        a, s = self._input(x, "x", stream)
        if a.dtype not in INPUT_DTYPES:
            raise ArgumentError("x: dtype %s; qtx quantizes float32, bfloat16, float16"
                                % DTYPE_NAMES[a.dtype])
        if not a.contiguous:
            raise ArgumentError("x: not contiguous (call .contiguous() first)")
        if not a.shape:
            raise ArgumentError("x: a 0-d tensor; quantization needs rank >= 1")
        lay = layout(a.shape, cfg[0])
        bufs, tensors, blocks = self._quantize_outputs(out, lay, cfg, a, s)
        op = self._native.quantize(a.device, s, a.ptr, a.dtype, list(a.shape), cfg[0], cfg[1],
                                   cfg[2], cfg[3], cfg[4], cfg[5], bufs)
        q = self._result(a.shape, mode, format, tensors, a.device, s, op, blocks)
        q._framework_alloc = out is None and not blocks
        return q

    def _quantize_torch(self, torch, x, cfg, mode, format, out, stream):
        """Session.quantize for the common PyTorch case, with as few Python
        and native steps as possible: a contiguous CUDA input of an input
        dtype, torch out= tensors of the exact dtype/shape/device (or outputs
        from PyTorch's allocator). Per (config, dtype, shape) a _FastPlan
        holds everything that does not change between calls (the native
        plan: config, shapes and sizes; the result's fixed fields); a call
        then reads each tensor's device, shape, dtype, contiguity and
        pointer once and makes one native call of nine ints. Returns None
        for anything else (the general path then handles it, and raises for
        bad arguments)."""
        tensor_t, inputs, data_ok, f32, _, current = _torch_fast(torch)
        if not isinstance(x, tensor_t):
            return None
        dtype = inputs.get(x.dtype)
        if dtype is None:
            return None
        dev = x.get_device()  # -1 for a CPU tensor
        if dev < 0 or not x.is_contiguous() or (self.device is not None and dev != self.device):
            return None
        shape = x.shape
        key = (cfg, dtype, shape)
        fp = self._fast_plans.get(key)
        if fp is None:
            fp = self._make_fast_plan(torch, key, mode, format)
            if fp is None:
                return None
        if stream is None:
            s, is_current = current(dev), True
        else:
            s, is_current = stream_handle(stream), False
        p = [0, 0, 0, 0]
        d = fp.base.copy()
        if out is not None:
            ok_data = data_ok[cfg[1]]
            get = out.get if type(out) is dict else None
            for f, shp, scale, i in fp.parts:
                t = get(f) if get is not None else getattr(out, f, None)
                if (not isinstance(t, tensor_t) or t.get_device() != dev or t.shape != shp
                        or (t.dtype is not f32 if scale else t.dtype not in ok_data)
                        or not t.is_contiguous()):
                    return None  # the general path says what is wrong
                p[i] = t.data_ptr()
                d[f] = t
        elif self.allocator == "framework":
            ts = self._torch_empty(torch, fp.specs, dev, s, is_current)
            for (f, _, _, i), t in zip(fp.parts, ts):
                p[i] = t.data_ptr()
                d[f] = t
            d["_framework_alloc"] = True
        else:
            return None
        d["op"] = self._submit(self._native, fp.plan, dev, s, x.data_ptr(), p[0], p[1], p[2],
                               p[3])
        d["stream"] = s
        d["device"] = dev
        q = object.__new__(QuantizedTensor)  # QuantizedTensor.__init__'s fields, set at once
        q.__dict__ = d
        return q

    def _make_fast_plan(self, torch, key, mode, format):
        """The _FastPlan of key = (cfg, qtx dtype, shape), memoized; None for
        an empty or 0-d input (the general path)."""
        cfg, dtype, shape = key
        if not shape or math.prod(shape) == 0:
            return None
        lay, parts = _plan(shape, cfg)
        nbytes = [0, 0, 0, 0]
        for _, _, n, _, i in parts:
            nbytes[i] = n
        plan = self._native.quantize_plan(dtype, [int(d) for d in shape], cfg[0], cfg[1], cfg[2],
                                          cfg[3], cfg[4], cfg[5], *nbytes)
        base = dict(shape=tuple(int(d) for d in shape), mode=mode, format=format,
                    rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None,
                    columnwise_scale_inv=None, stream=None, device=None, op=None,
                    _session=self, _blocks=(), _framework_alloc=False)
        fp = _FastPlan(plan, tuple((f, shp, scale, i) for f, shp, _, scale, i in parts),
                       [(shp, torch.float32 if scale else torch.uint8)
                        for _, shp, _, scale, _ in parts], base)
        if len(self._fast_plans) > 4096:
            self._fast_plans.clear()  # native plans stay (small); new ones are made
        self._fast_plans[key] = fp
        return fp

    def _result(self, shape, mode, format, tensors, device, s, op, blocks):
        q = QuantizedTensor(shape, mode, format, **tensors)
        q.stream, q.device, q.op, q._session, q._blocks = s, device, op, self, tuple(blocks)
        return q

    def dequantize(self, q, dtype="bfloat16", out=None, stream=None):
        """Submits the dequantization of `q` (its rowwise copy when present,
        else its columnwise copy) into `out` (a tensor of q.shape and
        `dtype`) or a pooled tensor, returned at once. The buffers have the
        shapes of qtx.cuda.layout; a mode 'tensor' scale_inv may have any
        shape of one element (as qtxd's Dequantize takes it)."""
        odt = _choice(dtype, _OUT_DTYPES, "dtype")
        mode = _choice(getattr(q, "mode", None), _MODES, "q.mode")
        fmt = _choice(getattr(q, "format", None), _FORMATS, "q.format")
        shape = tuple(int(d) for d in q.shape)
        lay = layout(shape, mode)
        arrays = {}
        for f in FIELDS:
            t = getattr(q, f, None)
            if t is not None:
                arrays[f] = t
        if not (("rowwise_data" in arrays and "rowwise_scale_inv" in arrays)
                or ("columnwise_data" in arrays and "columnwise_scale_inv" in arrays)):
            raise ArgumentError("q: needs rowwise_data + rowwise_scale_inv or columnwise_data "
                                "+ columnwise_scale_inv")
        first = next(iter(arrays.values()))
        a0, s = self._input(first, "q." + next(iter(arrays)), stream)
        bufs, shapes, parsed = [], [], {}
        for f in FIELDS:
            t = arrays.get(f)
            if t is None:
                bufs.append(None)
                shapes.append([0, 0])
                continue
            want = lay[f]
            if mode == _MODES["tensor"] and f.endswith("scale_inv"):
                given = tuple(getattr(t, "shape", ()))
                if given and math.prod(given) == 1:
                    want = given  # any one-element shape: [1], [1, 1], ...
            p = self._out_tensor(t, "q." + f, want,
                                 lambda d, f=f: _field_dtype_ok(f, d, fmt), a0.device,
                                 "float32" if f.endswith("scale_inv") else "uint8/float8")
            parsed[f] = p
            bufs.append((p.ptr, p.nbytes))
            shapes.append(list(want))
        blocks = []
        if out is not None:
            o = self._out_tensor(out, "out", shape, lambda d: d == odt, a0.device, dtype)
            result = out
        elif a0.framework == "torch" and self.allocator == "framework":
            torch = _torch()
            tdt = {FLOAT32: torch.float32, FLOAT16: torch.float16, BFLOAT16: torch.bfloat16}[odt]
            result = self._torch_empty(torch, [(shape, tdt)], a0.device, s)[0]
            o = CudaArray(result.data_ptr(), shape, odt, a0.device, True, "torch")
        else:
            nbytes = math.prod(shape) * _ITEMSIZE[odt]
            block = self.pool.alloc(a0.device, s, nbytes)
            blocks.append(block)
            result = _wrap_many(block, [(shape, odt)], [0], a0.framework)[0]
            o = CudaArray(block.ptr, shape, odt, a0.device, True, None)
        self._native.dequantize(a0.device, s, list(shape), mode, fmt, bufs, shapes, odt, o.ptr,
                                o.nbytes)
        return result

    def make_columnwise(self, q, out=None, stream=None):
        """The columnwise copy of `q` made on the GPU from its rowwise copy
        (docs/numerics.md §4.5), for modes '2d' and 'tensor', whose two
        copies hold the same bytes transposed and the same scales: the result
        is byte-identical to the columnwise copy Quantize or the optimizer's
        Step writes. So a trainer can keep only rowwise FP8 weights and make
        the transposed copy when a backward GEMM needs it. One kernel on
        `stream` (default: the framework's current stream), no qtxd call, no
        host wait. `out`: a (data [N, M] uint8/float8, scale_inv float32)
        pair to write into; else they are allocated like quantize's outputs.
        Returns a QuantizedTensor holding q's rowwise tensors and the new
        columnwise ones. Mode '1d' raises ArgumentError (its columnwise blocks
        have their own scales: quantize with columnwise=True)."""
        mode = _choice(getattr(q, "mode", None), _MODES, "q.mode")
        if mode not in (_MODES["2d"], _MODES["tensor"]):
            raise ArgumentError("q.mode=%r: only '2d' and 'tensor' have a columnwise copy equal to "
                                "the transposed rowwise one; quantize with columnwise=True"
                                % q.mode)
        fmt = _choice(getattr(q, "format", None), _FORMATS, "q.format")
        if getattr(q, "rowwise_data", None) is None or getattr(q, "rowwise_scale_inv",
                                                                   None) is None:
            raise ArgumentError("q: needs rowwise_data and rowwise_scale_inv")
        shape = tuple(int(d) for d in q.shape)
        lay = layout(shape, mode)
        row = as_cuda_array(q.rowwise_data, "q.rowwise_data")
        s = stream_handle(stream, row.framework, row.device, row.stream_hint)
        row = self._out_tensor(q.rowwise_data, "q.rowwise_data", lay["rowwise_data"],
                               lambda d: _field_dtype_ok("rowwise_data", d, fmt), row.device,
                               "uint8/float8")
        scale_shape = lay["rowwise_scale_inv"]
        if mode == _MODES["tensor"]:
            given = tuple(getattr(q.rowwise_scale_inv, "shape", ()))
            if given and math.prod(given) == 1:
                scale_shape = given
        scale = self._out_tensor(q.rowwise_scale_inv, "q.rowwise_scale_inv", scale_shape,
                                 lambda d: d == FLOAT32, row.device, "float32")
        col_shape, col_scale_shape = lay["columnwise_data"], lay["columnwise_scale_inv"]
        blocks = []
        if out is not None:
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise ArgumentTypeError("out: expected a (data, scale_inv) pair")
            col_t, col_scale_t = out
            col = self._out_tensor(col_t, "out[0]", col_shape,
                                   lambda d: _field_dtype_ok("columnwise_data", d, fmt),
                                   row.device, "uint8/float8")
            col_scale = self._out_tensor(col_scale_t, "out[1]", col_scale_shape,
                                         lambda d: d == FLOAT32, row.device, "float32")
            col_ptr, col_scale_ptr = col.ptr, col_scale.ptr
        elif row.framework == "torch" and self.allocator == "framework":
            torch = _torch()
            col_t, col_scale_t = self._torch_empty(
                torch, [(col_shape, torch.uint8), (col_scale_shape, torch.float32)], row.device,
                s)
            col_ptr, col_scale_ptr = col_t.data_ptr(), col_scale_t.data_ptr()
        else:
            parts = [(col_shape, UINT8), (col_scale_shape, FLOAT32)]
            offsets, total = _pack(parts)
            block = self.pool.alloc(row.device, s, total)
            blocks.append(block)
            col_t, col_scale_t = _wrap_many(block, parts, offsets, row.framework)
            col_ptr, col_scale_ptr = block.ptr + offsets[0], block.ptr + offsets[1]
        self._native.make_columnwise(row.device, s, mode, list(shape), row.ptr, scale.ptr,
                                     col_ptr, col_scale_ptr)
        r = QuantizedTensor(shape, q.mode, q.format, q.rowwise_data, q.rowwise_scale_inv, col_t,
                            col_scale_t)
        r.stream, r.device, r._blocks = s, row.device, tuple(blocks)
        r._framework_alloc = out is None and not blocks
        return r

    def create_group(self, name, rank, world_size, coordinator="", backend="auto",
                     timeout=60.0):
        """Joins collective group `name` through this session's qtxd (as
        qtx.Client.create_group); returns (rank, world_size, next_sequence)."""
        b = _choice(backend, _BACKENDS, "backend")
        info = self._native.create_group(name, int(rank), int(world_size), coordinator, b,
                                         float(timeout))
        self._world[name] = int(world_size)
        return info

    def destroy_group(self, name):
        self._native.destroy_group(name)
        self._world.pop(name, None)

    def all_gather(self, shard, group, sequence, gather_mode="exact_fp8", mode="1d",
                   format="e4m3", rowwise=True, columnwise=False, pow2_scales=True,
                   amax_epsilon=0.0, shard_rows=None, out=None, stream=None, async_op=True):
        """Submits this rank's part of AllGather `sequence` of `group` (every
        rank makes the matching call) and returns an AllGatherHandle
        (async_op=True; wait() orders a stream after the result) or the
        QuantizedTensor of the gathered [sum M_r, N] (async_op=False: ordered
        on the call's stream). shard_rows: every rank's M_r in rank order;
        default: equal shards over the group's world size (a group created
        through this session)."""
        gm = _choice(gather_mode, _GATHER_MODES, "gather_mode")
        cfg = quantize_config(mode, format, rowwise, columnwise, pow2_scales, amax_epsilon)
        a, s = self._input(shard, "shard", stream)
        if a.dtype not in INPUT_DTYPES:
            raise ArgumentError("shard: dtype %s; qtx quantizes float32, bfloat16, float16"
                                % DTYPE_NAMES[a.dtype])
        if not a.contiguous or len(a.shape) != 2:
            raise ArgumentError("shard: shape %s; a C-contiguous [M_r, N] tensor" % list(a.shape))
        if shard_rows is None:
            world = self._world.get(group)
            if world is None:
                raise ArgumentError("group %r: not created through this session; pass "
                                    "shard_rows (every rank's M_r)" % group)
            shard_rows = [a.shape[0]] * world
        total = sum(int(r) for r in shard_rows)
        gshape = (total, a.shape[1])
        lay = layout(gshape, cfg[0])
        bufs, tensors, blocks = self._quantize_outputs(out, lay, cfg, a, s)
        op = self._native.all_gather(a.device, s, group, int(sequence), gm, a.ptr, a.dtype,
                                     list(a.shape), cfg[0], cfg[1], cfg[2], cfg[3], cfg[4],
                                     cfg[5], bufs)
        result = self._result(gshape, mode, format, tensors, a.device, s, op, blocks)
        result._framework_alloc = out is None and not blocks
        if not async_op:
            return result
        return AllGatherHandle(self, result, a.device, s, _native.event_record(a.device, s))

    # -- optimizer (AdamW offloaded to qtxd; semantics in proto/qtx/v1/optimizer.proto)

    def offload_optimizer_state(self, group, parameters, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=1e-2, bias_correction=True, mode="2d",
                                format="e4m3", rowwise=True, columnwise=True, pow2_scales=True,
                                amax_epsilon=0.0, step=0, replace=False, weight_decays=None,
                                lr_scales=None, shards=None, shapes=None):
        """Hands a parameter group's FP32 master weights to qtxd (once, through
        the host: {name: float32 tensor/array}, any device) with FP8 outputs
        per (mode, format, rowwise, columnwise). weight_decays / lr_scales:
        per-parameter settings as qtx.Client.offload_optimizer_state takes
        them. Returns the parameter count. Then step() runs with gradients
        and outputs in device memory. mode: '2d', '1d' or 'tensor' (per-tensor
        current scaling; not with shards, which need 128x128 blocks).

        Data-parallel sharded state (a distributed optimizer; README and
        docs/numerics.md §10): shards={name: (begin, end)} (or one pair or
        None per parameter) makes this sidecar own elements [begin, end) of
        the flattened whole parameter, whose shape shapes={name: shape} gives;
        the master holds the end - begin owned elements (any shape). Every
        owner offloads the same parameters with its own ranges and steps with
        collective_group / sequence (step()). ArgumentError for a range
        outside the shape, a master of another size, a missing shape."""
        cfg = quantize_config(mode, format, rowwise, columnwise, pow2_scales, amax_epsilon)
        params = []
        for name, t in (parameters.items() if hasattr(parameters, "items") else parameters):
            torch = _torch()
            if torch is not None and isinstance(t, torch.Tensor):
                if t.dtype != torch.float32:
                    raise ArgumentError("parameter %s: dtype %s, masters are float32"
                                        % (name, t.dtype))
                shape, data = tuple(t.shape), t.detach().contiguous().cpu().numpy().tobytes()
            else:
                import numpy as np
                a = np.ascontiguousarray(t)
                if a.dtype != np.float32:
                    raise ArgumentError("parameter %s: dtype %s, masters are float32"
                                        % (name, a.dtype))
                shape, data = a.shape, a.tobytes()
            params.append((str(name), data, list(shape)))
        from qtx.optimizer import per_parameter  # numpy; no grpc needed
        names = [p[0] for p in params]
        own = []
        for what, values in (("weight_decays", weight_decays), ("lr_scales", lr_scales)):
            try:
                own.append(per_parameter(values, names, what))
            except ValueError as e:
                raise ArgumentError(str(e)) from None
        hyper = [(own[0].get(n), own[1].get(n)) for n in names]
        ranges, params = _shard_ranges(params, names, shards, shapes)
        if ranges and (mode != "2d" or not rowwise):
            raise ArgumentError("shards=: a data-parallel sharded group returns FP8 parameters "
                                "as mode='2d' with rowwise=True (its shard is its elements of "
                                "the rowwise data); got mode=%r, rowwise=%r" % (mode, rowwise))
        n = self._native.offload_optimizer_state(
            group, params, (float(lr), float(betas[0]), float(betas[1]), float(eps),
                            float(weight_decay), bool(bias_correction)),
            cfg[0], cfg[1], cfg[2], cfg[3], cfg[4], cfg[5], int(step), bool(replace),
            [(None if w is None else float(w), None if l is None else float(l))
             for w, l in hyper], [ranges.get(n) for n in names])
        self._groups[group] = (mode, format, cfg, {p[0]: tuple(p[2]) for p in params}, ranges)
        return n

    def _gradients(self, group, gradients, stream):
        """The gradients of step() and grad_norm(), checked before anything
        is submitted (ArgumentError): {name: CUDA tensor} (or pairs), one or
        more parameters of a group offloaded through this session, each a
        contiguous float32/bfloat16/float16 tensor of the parameter's shape,
        all on one device. Returns (the group's (mode, format, config,
        {name: shape}), [(name, CudaArray)], device, stream)."""
        known = self._groups.get(group)
        if known is None:
            raise ArgumentError("group %r: not offloaded through this session "
                                "(offload_optimizer_state)" % group)
        shapes = known[3]
        ranges = known[4] if len(known) > 4 else {}
        items = list(gradients.items() if hasattr(gradients, "items") else gradients)
        if not items:
            raise ArgumentError("gradients: empty; one per parameter")
        parsed, device, s = [], None, None
        for name, g in items:
            if name in ranges and ranges[name][0] == ranges[name][1]:
                parsed.append((name, None))  # owns nothing: an empty gradient
                continue
            a, sg = self._input(g, "gradient %s" % name, stream)
            if s is None:
                device, s = a.device, sg
            elif a.device != device:
                raise ArgumentError("gradient %s: on cuda:%d, the others on cuda:%d"
                                    % (name, a.device, device))
            if a.dtype not in INPUT_DTYPES or not a.contiguous:
                raise ArgumentError("gradient %s: a contiguous float32/bfloat16/float16 tensor"
                                    % name)
            if name not in shapes:
                raise ArgumentError("gradient %s: no such parameter in group %r" % (name, group))
            if name in ranges:
                b, e = ranges[name]
                if math.prod(a.shape) != e - b:
                    raise ArgumentError("gradient %s: %d elements; this owner's shard [%d, %d) "
                                        "of the parameter has %d" % (name, math.prod(a.shape),
                                                                    b, e, e - b))
            elif tuple(a.shape) != shapes[name]:
                raise ArgumentError("gradient %s: shape %s, the parameter's is %s"
                                    % (name, list(a.shape), list(shapes[name])))
            parsed.append((name, a))
        if s is None:
            raise ArgumentError("gradients: every one given is of a parameter this owner owns "
                                "nothing of; pass at least one CUDA gradient (for the stream)")
        # Parameters this owner owns nothing of need no gradient argument.
        given = {name for name, _ in parsed}
        for name, (b, e) in ranges.items():
            if b == e and name not in given:
                parsed.append((name, None))
        return known, parsed, device, s

    def _grad_tuples(self, parsed):
        """(name, pointer, dtype, shape) for the native calls; a sharded
        parameter's gradient is sent 1-D, an empty one as (name, 0, FLOAT32,
        [0]) (sent inline)."""
        out = []
        for name, a in parsed:
            if a is None:
                out.append((name, 0, FLOAT32, [0]))
            else:
                out.append((name, a.ptr, a.dtype, list(a.shape)))
        return out

    def step(self, group, step, gradients, out=None, lr=None, max_grad_norm=None,
             skip_if_non_finite=False, stream=None, clip_factor=None, skip=False,
             collective_group=None, sequence=None):
        """AdamW step `step` of a group offloaded through this session, with
        the gradients in device memory ({name: CUDA tensor}, float32 /
        bfloat16 / float16, contiguous, the parameter's shape) and the FP8
        parameters written into device memory: out={name: QuantizedTensor or
        {field: tensor}}, else pooled. Stream order: qtxd reads the gradients
        after the work queued on the stream before the call (an interprocess
        event), and later work on the stream sees the outputs. The host waits
        for qtxd's answer (the statistics need the gradients), not for the
        outputs. clip_factor / skip: the second phase of a two-phase step
        (see grad_norm), as qtx.Client.step takes them. Returns (stats dict,
        {name: QuantizedTensor}).

        A data-parallel sharded group (offloaded with shards=): the gradients
        are this owner's slices (end - begin elements each; parameters it
        owns nothing of need none), and the step is one collective call of
        Collective group `collective_group` (create_group over the owners'
        sidecars) with its next `sequence`, on every owner with the same
        step. Each QuantizedTensor is then the owner's FP8 shard: shape the
        whole parameter's, rowwise_data its [end - begin] bytes of the
        rowwise data, rowwise_scale_inv (and with columnwise,
        columnwise_scale_inv) the whole scale tensors, no columnwise_data
        (the byte transpose of the gathered rowwise data: make_columnwise).
        out={name: {field: tensor}} takes those shapes. A parameter this
        owner owns nothing of has no entry in the result."""
        known = self._groups.get(group)
        ranges = known[4] if known is not None and len(known) > 4 else {}
        if collective_group is not None:
            if not isinstance(collective_group, str) or not collective_group:
                raise ArgumentError("collective_group=%r: the name of a Collective group"
                                    % (collective_group,))
            if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 0:
                raise ArgumentError("sequence=%r: collective_group needs the group's next "
                                    "sequence (an int >= 0)" % (sequence,))
        elif sequence is not None:
            raise ArgumentError("sequence=%r without collective_group" % (sequence,))
        (mode, fmt, cfg, shapes), parsed, device, s = self._split(
            self._gradients(group, gradients, stream))
        grads, dests, results = self._grad_tuples(parsed), [], {}
        for name, a in parsed:
            o = None if out is None else out.get(name)
            if out is not None and o is None and a is not None:
                raise ArgumentError("out: no entry for parameter %s" % name)
            if name in ranges:
                b, e = ranges[name]
                lay, fields = _shard_layout(shapes[name], cfg, e - b)
                if a is None:
                    continue  # no destination: its (whole) scales come back inline
                bufs, tensors, blocks = self._quantize_outputs(o, lay, cfg, a, s, fields)
                if e == b:
                    bufs[0] = None
                shape = shapes[name]
            else:
                lay = layout(a.shape, cfg[0])
                bufs, tensors, blocks = self._quantize_outputs(o, lay, cfg, a, s)
                shape = a.shape
            dests.append((name, bufs))
            results[name] = self._result(shape, mode, fmt, tensors, a.device, s, None, blocks)
            results[name]._framework_alloc = o is None and not blocks
        stats = self._native.step(device, s, group, int(step), grads, dests,
                                  -1.0 if lr is None else float(lr),
                                  0.0 if max_grad_norm is None else float(max_grad_norm),
                                  bool(skip_if_non_finite),
                                  None if clip_factor is None else float(clip_factor),
                                  bool(skip), collective_group or "",
                                  0 if sequence is None else int(sequence))
        return stats, results

    @staticmethod
    def _split(g):
        known, parsed, device, s = g
        return tuple(known[:4]), parsed, device, s

    def grad_norm(self, group, step, gradients, stream=None):
        """The first phase of a two-phase step (qtx.Client.grad_norm): this
        group's share of the gradient norm of step `step`, with the gradients
        in device memory as for step() (read after the work queued on the
        stream so far). Returns a dict: step, sum_squares, non_finite,
        grad_norm, step_processed. Add sum_squares and or non_finite over
        every group of every rank (e.g. a torch.distributed all_reduce), then
        step(..., clip_factor=..., skip=...) on each."""
        _, parsed, device, s = self._gradients(group, gradients, stream)
        return self._native.grad_norm(device, s, group, int(step), self._grad_tuples(parsed))

    def synchronize(self):
        """Waits (host) for every submitted call on every stream; raises the
        first failure."""
        self._native.synchronize()

    def health(self):
        """qtxd's serving status: 'SERVING', 'NOT_SERVING', ..."""
        return self._native.health()

    def wait_until_serving(self, timeout):
        """Returns once qtxd reports SERVING (health checks that wait for the
        connection); errors.DeadlineExceededError naming the last status seen
        after `timeout` seconds. For a trainer that starts before its sidecar."""
        self._native.wait_until_serving(float(timeout))

    def stats(self):
        """{'channels', 'registrations', 'pool': DevicePool.stats()}."""
        return {"channels": self._native.channels(),
                "registrations": self._native.registrations(), "pool": self.pool.stats()}

    def close(self):
        """Synchronizes and closes every channel, unregisters the memory,
        and frees the pool (see DevicePool.close). Raises the first failure."""
        if self._closed:
            return
        self._closed = True
        try:
            self._native.close()
        finally:
            self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shard_ranges(params, names, shards, shapes):
    """Checks offload_optimizer_state's shards= / shapes= (ArgumentError):
    returns ({name: (begin, end)}, params with each sharded parameter's
    shape replaced by the whole one from shapes=)."""
    from qtx.optimizer import per_parameter
    try:
        ranges = per_parameter(shards, names, "shards")
        whole = per_parameter(shapes, names, "shapes")
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    out_ranges, out = {}, []
    for name, data, shape in params:
        if name in whole and name not in ranges:
            raise ArgumentError("shapes[%s]: only for a parameter with a shard range (shards=)"
                                % name)
        if name not in ranges:
            out.append((name, data, shape))
            continue
        try:
            begin, end = (int(v) for v in ranges[name])
        except (TypeError, ValueError):
            raise ArgumentError("shards[%s]=%r: must be a (begin, end) pair of integers"
                                % (name, ranges[name])) from None
        if name not in whole:
            raise ArgumentError("parameter %s: shards=(%d, %d) needs shapes[%s], the whole "
                                "parameter's shape (the master holds only the owned elements)"
                                % (name, begin, end, name))
        full = [int(d) for d in whole[name]]
        if not full or any(d < 0 for d in full):
            raise ArgumentError("shapes[%s]=%r: a shape of rank >= 1" % (name, whole[name]))
        total = math.prod(full)
        if not 0 <= begin <= end <= total:
            raise ArgumentError("parameter %s: shards=(%d, %d): must have 0 <= begin <= end <= "
                                "%d (the elements of shape %s)" % (name, begin, end, total,
                                                                   full))
        if math.prod(shape) != end - begin:
            raise ArgumentError("parameter %s: the master has %d elements; shards=(%d, %d) "
                                "owns %d" % (name, math.prod(shape), begin, end, end - begin))
        out_ranges[name] = (begin, end)
        out.append((name, data, full))
    return out_ranges, out


def _shard_layout(whole_shape, cfg, count):
    """The buffers of an owner's FP8 shard of a [whole_shape] parameter that
    owns `count` elements (docs/numerics.md §10): (layout with rowwise_data
    [count], the fields made: rowwise data and scales, columnwise scales)."""
    lay = dict(layout(whole_shape, cfg[0]))
    lay["rowwise_data"] = (int(count),)
    fields = ["rowwise_data", "rowwise_scale_inv"]
    if cfg[3]:
        fields.append("columnwise_scale_inv")
    return lay, fields


def _device_index(device):
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    s = str(device)
    if s.startswith("cuda:") and s[5:].isdigit():
        return int(s[5:])
    if s == "cuda":
        return 0
    raise ArgumentError("device=%r: an int or 'cuda:N'" % (device,))
