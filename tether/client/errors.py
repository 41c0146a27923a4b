"""The SDK's exceptions: a gRPC status becomes one small, catchable class carrying `.code` and `.message`."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class TetherError(Exception):
    """Any failed call. `.code` is the grpc.StatusCode, `.message` the server's explanation."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidArgument(TetherError):
    """The request broke a limit; the message names the field and the allowed range."""


class Unavailable(TetherError):
    """Admission or the pipeline behind it is not serving right now; retrying later may succeed."""


class DeadlineExceeded(TetherError):
    """The call's timeout passed before the answer was complete."""


class ResourceExhausted(TetherError):
    """The server refused for overload. `.retry_after` (seconds) is its hint, None when it gave none."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
                 retry_after: float | None = None) -> None:
        super().__init__(message, code)
        self.retry_after = retry_after


class ReceiptMismatch(TetherError):
    """The answer's receipt does not match the request this client sent: the answer must not be trusted."""

    def __init__(self, message: str) -> None:
        # DATA_LOSS is gRPC's code for corrupted data, which is what a mismatched answer is.
        super().__init__(message, grpc.StatusCode.DATA_LOSS)


_BY_CODE: dict[grpc.StatusCode, type[TetherError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def retry_after(trailing_metadata) -> float | None:
    """The RetryInfo delay in a google.rpc.Status carried in trailing metadata, if any."""
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                return info.retry_delay.ToTimedelta().total_seconds()
    return None


def from_rpc_error(error: grpc.RpcError) -> TetherError:
    """Translate a failed gRPC call (sync or aio) into the matching TetherError."""
    code, message = error.code(), error.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(message, code, retry_after(error.trailing_metadata()))
    return _BY_CODE.get(code, TetherError)(message, code)
