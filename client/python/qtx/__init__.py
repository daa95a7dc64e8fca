"""qtx: Python client for the qtxd sidecar.

    import qtx
    with qtx.Client("unix:///tmp/qtxd.sock") as c:
        q = c.quantize(x, mode="2d", columnwise=True)   # numpy or torch in/out
        c.offload_optimizer_state("mlp", {"w": w}, lr=1e-3)  # AdamW in qtxd
        r = c.step("mlp", 1, {"w": grad_w})              # r.parameters["w"].fp8

``qtx.Client`` wraps the generated qtx.v1 stubs (``qtx.v1.*_pb2``,
``*_pb2_grpc``: generated from proto/ when the package is built, by
``pip install client/python`` or by the CMake target ``qtx_python``).
The Optimizer calls' types are in ``qtx.optimizer`` (also exported here).
``qtx.ShmRegion`` makes POSIX shm regions; ``qtx.errors`` has one exception
class per gRPC status code; ``qtx.channel()`` is a raw channel with raised
message limits for using the stubs directly.

``qtx.cuda`` (``import qtx.cuda``) is the zero-copy, stream-ordered API for
CUDA tensors of PyTorch, CuPy or any ``__cuda_array_interface__`` / DLPack
producer, over the compiled ``qtx._native``. It needs neither grpcio nor
protobuf: on a host without them (or without the generated stubs) ``import
qtx`` still works and gives ``qtx.errors`` and ``qtx.cuda``; ``qtx.Client``
and the stubs then raise ImportError naming what is missing.
"""

from qtx import errors  # noqa: F401
from qtx.errors import QtxError  # noqa: F401

DEFAULT_TARGET = "unix:///tmp/qtxd.sock"

try:  # the grpc-based client: grpcio, protobuf and the generated qtx.v1 stubs
    import grpc as _grpc  # noqa: F401
    import google.protobuf as _protobuf  # noqa: F401
    from qtx import v1  # noqa: F401  (generated subpackage)
    from qtx.v1 import collective_pb2, collective_pb2_grpc  # noqa: F401
    from qtx.v1 import memory_pb2, memory_pb2_grpc  # noqa: F401
    from qtx.v1 import optimizer_pb2, optimizer_pb2_grpc  # noqa: F401
    from qtx.v1 import quantizer_pb2, quantizer_pb2_grpc  # noqa: F401
    from qtx.v1 import tensor_pb2  # noqa: F401
except ImportError as _e:  # qtx.cuda only
    _GRPC_MISSING = _e
else:
    _GRPC_MISSING = None

if _GRPC_MISSING is None:
    from qtx.client import (  # noqa: F401
        DEFAULT_TARGET, MAX_MESSAGE_BYTES, AllGatherResult, Client, ParameterAllGatherResult,
        QuantizedTensor, channel, tensor_from_proto, tensor_to_proto)
    from qtx.optimizer import (  # noqa: F401
        AdamWHyperParams, CheckpointInfo, GradNormResult, OptimizerGroupInfo,
        OptimizerGroupList, OptimizerState, ParameterInit, ParameterOutput,
        ParameterOutputConfig, ParameterState, StepResult, StepStats, clip_factor)
    from qtx.shm import ShmRegion  # noqa: F401
else:
    _GRPC_NAMES = frozenset((
        "v1", "collective_pb2", "collective_pb2_grpc", "memory_pb2", "memory_pb2_grpc",
        "optimizer_pb2", "optimizer_pb2_grpc", "quantizer_pb2", "quantizer_pb2_grpc",
        "tensor_pb2", "MAX_MESSAGE_BYTES", "AllGatherResult", "Client", "QuantizedTensor",
        "ParameterAllGatherResult",
        "channel", "tensor_from_proto", "tensor_to_proto", "AdamWHyperParams",
        "CheckpointInfo", "OptimizerGroupInfo", "OptimizerGroupList", "OptimizerState",
        "ParameterInit", "ParameterOutput", "ParameterOutputConfig", "ParameterState",
        "StepResult", "StepStats", "ShmRegion", "GradNormResult", "clip_factor"))

    def __getattr__(name):  # PEP 562: a clear error for the grpc-based names
        if name not in _GRPC_NAMES:
            raise AttributeError("module 'qtx' has no attribute %r" % name)
        raise ImportError("qtx.%s needs grpcio, protobuf and the generated qtx.v1 stubs (%s); "
                          "qtx.cuda works without them"
                          % (name, _GRPC_MISSING))

__version__ = "0.1.0"
