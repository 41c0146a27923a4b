"""The SDK's exceptions: a gRPC status becomes one small, catchable class carrying `.code` and `.message`."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class TetherError(Exception):
    """Any failed call. `.code` is the grpc.StatusCode, `.message` the server's explanation, `.retry_after`
    the server's RetryInfo delay in seconds (None when it gave none).

    After the SDK's retries (tether.client.retry): `.attempts` is how many attempts the call made, `.gave_up`
    why no further one was made ("" when the code is simply not retried, or retries were off).
    """

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
                 retry_after: float | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.attempts = 1
        self.gave_up = ""


class InvalidArgument(TetherError):
    """The request broke a limit; the message names the field and the allowed range."""


class Unavailable(TetherError):
    """Admission or the pipeline behind it is not serving right now; retrying later may succeed."""


class Aborted(TetherError):
    """The server gave up on this run of the request (e.g. tokens it could not verify); a new attempt may
    succeed."""


class DeadlineExceeded(TetherError):
    """The call's timeout passed before the answer was complete."""


class ResourceExhausted(TetherError):
    """The server refused for overload. `.retry_after` (seconds) is its hint, None when it gave none."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
                 retry_after: float | None = None) -> None:
        super().__init__(message, code, retry_after)


class Unauthenticated(TetherError):
    """No API key, a garbled one or one admission does not know: pass api_key= or set TETHER_API_KEY."""


class PermissionDenied(TetherError):
    """The API key is valid but may not do this: another tenant than its own, or a priority its tenant may not
    use (the message names the allowed ones)."""


class ReceiptMismatch(TetherError):
    """The answer's receipt does not match the request this client sent: the answer must not be trusted."""

    def __init__(self, message: str) -> None:
        # DATA_LOSS is gRPC's code for corrupted data, which is what a mismatched answer is.
        super().__init__(message, grpc.StatusCode.DATA_LOSS)


_BY_CODE: dict[grpc.StatusCode, type[TetherError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def retry_after(trailing_metadata) -> float | None:
    """The RetryInfo delay in a google.rpc.Status carried in trailing metadata, if any."""
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY:
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:   # a garbled detail must not hide the status it came with
            return None
        for detail in status.details:
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                return info.retry_delay.ToTimedelta().total_seconds()
    return None


def from_rpc_error(error: grpc.RpcError) -> TetherError:
    """Translate a failed gRPC call (sync or aio) into the matching TetherError."""
    code, message = error.code(), error.details() or ""
    # Any code may carry RetryInfo: admission's overload refusals do, and so does UNAVAILABLE from an open
    # circuit breaker.
    return _BY_CODE.get(code, TetherError)(message, code, retry_after(error.trailing_metadata()))
