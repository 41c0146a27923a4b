"""Python SDK of tether: `Client` (blocking) and `AsyncClient` (asyncio) for the Admission service.

    from tether.client import Client
    with Client("127.0.0.1:50051") as c:          # api_key= (or $TETHER_API_KEY) when admission asks for keys
        print(c.generate("Hello", max_tokens=16).text)
        s = c.stream("你好")
        for delta in s:
            print(delta.text, end="")
        print(s.result.receipt)
        print(c.chat([{"role": "user", "content": "Hi"}]).text)   # a conversation; stream_chat too

Every answer's receipt is checked against what this client sent; a mismatch raises ReceiptMismatch.
Refused, unavailable and aborted calls are retried (tether.client.retry; `retry=` on the clients), a stream that
broke after tokens reached you resuming where it stopped (`Client(targets=[...])` gives it other admissions to
try); `result.attempts` says how many attempts a call took.
"""

from tether.client.aio import AsyncClient, AsyncStream
from tether.client.errors import (Aborted, DeadlineExceeded, InvalidArgument, PermissionDenied, ReceiptMismatch,
                                  ResourceExhausted, TetherError, Unauthenticated, Unavailable)
from tether.client.retry import Retrier, RetryBudget, RetryPolicy
from tether.client.sync import Client, Stream
from tether.client.wire import GenerateResult
from tether.types import Delta, Receipt

__all__ = [
    "AsyncClient", "AsyncStream", "Client", "Stream", "Delta", "GenerateResult", "Receipt", "TetherError",
    "InvalidArgument", "Unavailable", "Aborted", "DeadlineExceeded", "ResourceExhausted", "ReceiptMismatch",
    "Unauthenticated", "PermissionDenied",
    "RetryPolicy", "RetryBudget", "Retrier",
]
