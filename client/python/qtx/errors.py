"""Error classes of the qtx Python client.

Every failed call raises a ``QtxError`` subclass named after its gRPC status
code, the same codes (and numbers) as the C++ client's ``absl::StatusCode``:
``InvalidArgumentError`` is ``absl::StatusCode::kInvalidArgument``, and so
on. ``err.code`` is the ``grpc.StatusCode``; ``err.message`` the server's
message, which names the offending field and value.
"""

import grpc


class QtxError(Exception):
    """A qtxd call failed. ``code``: grpc.StatusCode; ``message``: str."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message, code=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self):
        return "%s: %s" % (self.code.name, self.message)


class CancelledError(QtxError):
    code = grpc.StatusCode.CANCELLED


class UnknownError(QtxError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(QtxError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(QtxError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(QtxError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(QtxError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(QtxError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(QtxError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(QtxError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(QtxError):
    code = grpc.StatusCode.ABORTED


class OutOfRangeError(QtxError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(QtxError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(QtxError):
    code = grpc.StatusCode.INTERNAL


class UnavailableError(QtxError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLossError(QtxError):
    code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(QtxError):
    code = grpc.StatusCode.UNAUTHENTICATED


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
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, QtxError)
    return cls(details or "", code)
