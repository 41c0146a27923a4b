"""Logging of every service: `--log-format text` (the default, for people) or `json` (one object per line, for
a log pipeline: Loki, Elasticsearch, `kubectl logs | jq`).

A line about a request carries its id as the field `request_id` (the internal id admission mints, which every
service keys by), found in this order:
1. `extra={"request_id": ...}` on the logging call;
2. the request context (`request_context`), a contextvar set for the code serving one request (admission's
   handler, the coordinator's per-request task): every line logged inside it, by any module, carries the id;
3. an internal id written in the message: admission mints 32 lowercase hex digits (uuid4().hex), so a line of
   the engine about a request ("request 3f2a...: ECHO_MISMATCH") carries it without the engine doing anything.
The caller's own label travels as `label` where it is known. `trace_id` is the request's trace (tracing.py):
set in `TRACE_ID` by the task serving a traced request (admission's handler, the coordinator's per-request
task) or passed as `extra={"trace_id": ...}` (the engine's lines about a traced request); never guessed.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
from collections.abc import Iterator
from datetime import datetime, timezone

from tether import settings

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("tether_request_id", default=None)
LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("tether_request_label", default=None)
TRACE_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("tether_trace_id", default=None)
INTERNAL_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")
_JSON = False   # set by configure(): whether `announce` should log instead of print
_CONFIG: tuple[str, str, str] | None = None   # configure()'s arguments, for worker processes (current())

# LogRecord's own attributes: anything else on a record came from `extra=` and is written as a field.
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


@contextlib.contextmanager
def request_context(request_id: str, label: str | None = None) -> Iterator[None]:
    """Every line logged inside (this task and the tasks it creates) carries `request_id` (and `label`)."""
    tokens = [REQUEST_ID.set(request_id), LABEL.set(label or None)]
    try:
        yield
    finally:
        LABEL.reset(tokens[1])
        REQUEST_ID.reset(tokens[0])


def set_request(request_id: str, label: str | None = None) -> None:
    """Like request_context, for the rest of the current task (a task's context is its own copy)."""
    REQUEST_ID.set(request_id)
    LABEL.set(label or None)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, service, logger, message, then request_id, label,
    trace_id where known, any `extra` fields, and exc_info (the formatted traceback) when there is one."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": message,
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id is None:
            m = INTERNAL_ID.search(message)
            request_id = m.group(0) if m else None
        if request_id:
            out["request_id"] = request_id
        label = getattr(record, "label", None) or LABEL.get()
        if label:
            out["label"] = label
        trace_id = getattr(record, "trace_id", None) or TRACE_ID.get()
        if trace_id:
            out["trace_id"] = trace_id
        for key, value in vars(record).items():
            if key not in _RESERVED and key not in out:
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False)


def configure(service: str, level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger of a service process (replaces any earlier handler)."""
    global _JSON, _CONFIG
    if fmt not in settings.LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(settings.LOG_FORMATS)}; got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    _JSON = fmt == "json"
    _CONFIG = (service, level, fmt)


def current() -> tuple[str, str, str] | None:
    """(service, level, format) of this process's configure(), for a spawned worker to configure itself alike;
    None if it was never called."""
    return _CONFIG


def announce(logger: logging.Logger, message: str) -> None:
    """A service's start-up line: printed as it always was in text format, a log record (so a JSON line) in
    json format, where every line of the process must parse."""
    if _JSON:
        logger.info(message)
    else:
        print(message, flush=True)
