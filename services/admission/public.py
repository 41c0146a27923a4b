"""What admission's public port may say about a failure: what the caller can act on, never the internals.

Errors from inside the cluster (a coordinator's status, a broken session stream, a bug) carry internal
addresses, stage names and exception reprs that the caller cannot act on and an attacker can map the cluster
with. A caller gets instead one sentence per status code saying what to do, plus a reference (the request's
trace id when it is traced, else admission's request id) that finds the full detail in admission's log, which
the caller of `failure_message` writes. A coordinator's message is passed on only for codes about the request
itself (its input, its limits, its deadline), and only when it names nothing internal.
"""

from __future__ import annotations

import re

import grpc

from tether.telemetry import logs

# Codes that mean a bug somewhere: the words said with them are never the caller's business.
BUGS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})

WHAT_TO_DO = {
    grpc.StatusCode.UNAVAILABLE: "the pipeline serving this request became unavailable; retry (the SDK does)",
    grpc.StatusCode.ABORTED: "the request could not be completed with verified state; retry it",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request ran past its deadline",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the service is out of capacity for this request; retry later",
    grpc.StatusCode.CANCELLED: "the request was cancelled",
}
INTERNAL_ERROR = "admission hit an internal error on this request"
REDACTED = "<internal>"

# An address: host:port (a gRPC resolver prefix included), [IPv6](:port), a bare IPv4
_ADDRESS = re.compile(
    r"(?:\b(?:ipv4|ipv6|dns|unix|unix-abstract):)?"
    r"(?:\[[0-9A-Fa-f:.]+\](?::\d{1,5})?|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"
    r"|\b[A-Za-z0-9][A-Za-z0-9.-]*:\d{2,5}\b)")
# A Python repr or traceback: a bug's words, never passed on even redacted
_REPR = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*(?:Error|Exception)\(|<[^>]* at 0x[0-9a-f]+>|Traceback \(most recent")


def names_internals(text: str) -> bool:
    """Whether `text` names an address, a gRPC target or a Python repr (what the public port must not say)."""
    return _ADDRESS.search(text) is not None or _REPR.search(text) is not None


def redact(text: str) -> str:
    """`text` with every address replaced by <internal>; "" when it holds a repr or traceback."""
    if _REPR.search(text):
        return ""
    return _ADDRESS.sub(REDACTED, text)


def reference(request_id: str = "") -> str:
    """What the caller quotes to find the detail in admission's log: the trace id if traced, else the id."""
    trace = logs.TRACE_ID.get()
    if trace:
        return f"trace {trace}"
    return f"request {request_id}" if request_id else "the time of the call"


def failure_message(code: grpc.StatusCode, detail: str, request_id: str = "") -> str:
    """The public message of a request that failed with `code` inside the cluster. `detail` (what was said
    there, which the caller of this logs in full) is passed on with its addresses redacted, unless the code
    means a bug or the detail holds a repr; then a sentence of what to do stands instead. Either way the
    message ends with the reference under which admission's log has the detail."""
    said = "" if code in BUGS else redact(detail)
    what = said or WHAT_TO_DO.get(code, INTERNAL_ERROR)
    return f"{what} (details in admission's log under {reference(request_id)})"
