"""qtx: Python client for the qtxd sidecar, from the generated qtx.v1 stubs.

The stubs (qtx.v1.*_pb2, *_pb2_grpc) are generated at build time by the CMake
target ``qtx_python`` with Debian's protoc and grpc_python_plugin; put the
build's ``client/python`` directory on PYTHONPATH::

    import qtx
    from qtx.v1 import quantizer_pb2, tensor_pb2
    channel = qtx.channel("unix:///tmp/qtxd.sock")
    stub = qtx.v1.quantizer_pb2_grpc.QuantizerStub(channel)

A richer Python API comes later; this package is the generated stubs plus
``channel()``, which raises the gRPC message size limits for inline tensors.
"""

import grpc

DEFAULT_TARGET = "unix:///tmp/qtxd.sock"
MAX_MESSAGE_BYTES = 2**31 - 1


def channel(target=DEFAULT_TARGET, max_message_bytes=MAX_MESSAGE_BYTES):
    """Returns an insecure grpc.Channel to qtxd with raised message limits.

    target: "unix:///abs/path", an absolute socket path, or "host:port".
    """
    if target.startswith("/"):
        target = "unix://" + target
    return grpc.insecure_channel(
        target,
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ],
    )


from qtx import v1  # noqa: E402  (generated subpackage)
from qtx.v1 import memory_pb2, memory_pb2_grpc  # noqa: E402,F401
from qtx.v1 import quantizer_pb2, quantizer_pb2_grpc  # noqa: E402,F401
from qtx.v1 import tensor_pb2  # noqa: E402,F401
