"""Error classes of the qtx Python client.

Every failed call raises a ``QtxError`` subclass named after its gRPC status
code, the same codes (and numbers) as the C++ client's ``absl::StatusCode``:
``InvalidArgumentError`` is ``absl::StatusCode::kInvalidArgument``, and so
on. ``err.code`` is the ``grpc.StatusCode``; ``err.message`` the server's
message, which names the offending field and value.

grpc is optional here: without it (a GPU host with only qtx._native, say)
``code`` is a member of the ``StatusCode`` enum below, which has the same
names and numbers as ``grpc.StatusCode``.
"""

import enum

try:
    import grpc
    StatusCode = grpc.StatusCode
except ImportError:  # qtx.cuda works without grpcio
    grpc = None

    class StatusCode(enum.Enum):
        """grpc.StatusCode's members, for hosts without grpcio."""
        OK = (0, "ok")
        CANCELLED = (1, "cancelled")
        UNKNOWN = (2, "unknown")
        INVALID_ARGUMENT = (3, "invalid argument")
        DEADLINE_EXCEEDED = (4, "deadline exceeded")
        NOT_FOUND = (5, "not found")
        ALREADY_EXISTS = (6, "already exists")
        PERMISSION_DENIED = (7, "permission denied")
        RESOURCE_EXHAUSTED = (8, "resource exhausted")
        FAILED_PRECONDITION = (9, "failed precondition")
        ABORTED = (10, "aborted")
        OUT_OF_RANGE = (11, "out of range")
        UNIMPLEMENTED = (12, "unimplemented")
        INTERNAL = (13, "internal")
        UNAVAILABLE = (14, "unavailable")
        DATA_LOSS = (15, "data loss")
        UNAUTHENTICATED = (16, "unauthenticated")


class QtxError(Exception):
    """A qtxd call failed. ``code``: grpc.StatusCode; ``message``: str."""

    code = StatusCode.UNKNOWN

    def __init__(self, message, code=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self):
        return "%s: %s" % (self.code.name, self.message)


class CancelledError(QtxError):
    code = StatusCode.CANCELLED


class UnknownError(QtxError):
    code = StatusCode.UNKNOWN


class InvalidArgumentError(QtxError):
    code = StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(QtxError):
    code = StatusCode.DEADLINE_EXCEEDED


class NotFoundError(QtxError):
    code = StatusCode.NOT_FOUND


class AlreadyExistsError(QtxError):
    code = StatusCode.ALREADY_EXISTS


class PermissionDeniedError(QtxError):
    code = StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(QtxError):
    code = StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(QtxError):
    code = StatusCode.FAILED_PRECONDITION


class AbortedError(QtxError):
    code = StatusCode.ABORTED


class OutOfRangeError(QtxError):
    code = StatusCode.OUT_OF_RANGE


class UnimplementedError(QtxError):
    code = StatusCode.UNIMPLEMENTED


class InternalError(QtxError):
    code = StatusCode.INTERNAL


class UnavailableError(QtxError):
    code = StatusCode.UNAVAILABLE


class DataLossError(QtxError):
    code = StatusCode.DATA_LOSS


class UnauthenticatedError(QtxError):
    code = StatusCode.UNAUTHENTICATED


_BY_CODE = {
    cls.code: cls
    for cls in (
        CancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError,
        NotFoundError, AlreadyExistsError, PermissionDeniedError, ResourceExhaustedError,
        FailedPreconditionError, AbortedError, OutOfRangeError, UnimplementedError,
        InternalError, UnavailableError, DataLossError, UnauthenticatedError,
    )
}


def from_rpc_error(err):
    """The QtxError subclass instance for a grpc.RpcError."""
    code = err.code() if hasattr(err, "code") else StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, QtxError)
    return cls(details or "", code)


_BY_NUMBER = {cls.code.value[0]: cls for cls in _BY_CODE.values()}


def from_status(code, message):
    """The QtxError subclass instance for an absl::StatusCode number (as
    qtx._native reports a failed absl::Status) and its message. Unknown
    numbers give a plain QtxError with code UNKNOWN."""
    cls = _BY_NUMBER.get(int(code))
    if cls is None:
        return QtxError("status code %d: %s" % (int(code), message))
    return cls(message)
