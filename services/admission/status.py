"""How admission says a request ended, whichever face it came by: `Rejected` (the status a caller gets, with
its RetryInfo delay), the wire form of that delay for gRPC, and the names of codes and finish reasons.

The front door (door.py) raises `Rejected`; each face turns it into its own wire form: gRPC aborts the call
with the code and a `grpc-status-details-bin` trailer (server.py), HTTP answers with a status and a JSON error.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from tether.v1 import common_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"
STATUS_CODES = {c.value[0]: c for c in grpc.StatusCode}
# FINISH_REASON_LENGTH -> "length": the `finished_reason` label of tether:request_success_total
FINISH_REASONS = {v: n.removeprefix("FINISH_REASON_").lower() for n, v in common_pb2.FinishReason.items()}


class Rejected(Exception):
    """A request refused or failed with a status the caller should see: a gRPC code, a message a person
    understands, and how long to wait before retrying when waiting helps (a RetryInfo detail)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message, self.retry_after_s = code, message, retry_after_s

    def trailers(self) -> tuple[tuple[str, bytes], ...]:
        """The gRPC trailing metadata that carries the RetryInfo delay, if any."""
        if self.retry_after_s is None:
            return ()
        return ((STATUS_DETAILS_KEY, retry_status_details(self.code, self.message, self.retry_after_s)),)


def retry_status_details(code: grpc.StatusCode, message: str, retry_after_s: float) -> bytes:
    """A serialized google.rpc.Status with a RetryInfo detail (the value of grpc-status-details-bin)."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_after_s * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status_pb2.Status(code=code.value[0], message=message, details=[detail]).SerializeToString()
