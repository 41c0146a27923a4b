"""--log-format json: one object per line, the request id on every line about a request."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from tether.telemetry import logs

RID = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def capture():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("coordinator"))
    logger = logging.getLogger("tether.test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False

    def lines() -> list[dict]:
        return [json.loads(ln) for ln in stream.getvalue().splitlines()]
    yield logger, lines
    logger.removeHandler(handler)


def test_fields_of_a_plain_line(capture):
    log, lines = capture
    log.warning("pipeline broken, recovering: %s", "stage 1 gone")
    (r,) = lines()
    assert r["level"] == "WARNING" and r["service"] == "coordinator" and r["logger"] == "tether.test.logs"
    assert r["message"] == "pipeline broken, recovering: stage 1 gone"
    assert r["ts"].endswith("+00:00")
    assert "request_id" not in r and "trace_id" not in r


def test_request_id_from_the_message(capture):
    """The engine's lines name the id in their text; the formatter finds admission's 32-hex ids there."""
    log, lines = capture
    log.info("request %s: %s (%s)", RID, "ECHO_MISMATCH", "echoed stamp differs")
    log.info("request %s preempted", RID.upper())   # not an id admission mints
    a, b = lines()
    assert a["request_id"] == RID
    assert "request_id" not in b


def test_request_context_wins_and_is_per_task(capture):
    log, lines = capture

    async def handler(rid: str, label: str) -> None:
        logs.set_request(rid, label)
        await asyncio.sleep(0)
        log.info("admitting a request failed")   # no id in the text: the context carries it

    async def main() -> None:
        await asyncio.gather(handler("a" * 32, "mine"), handler("b" * 32, ""))
        log.info("after")                         # the handlers' contexts did not leak into this one

    asyncio.run(main())
    records = lines()
    assert sorted((r.get("request_id"), r.get("label")) for r in records[:2]) == [("a" * 32, "mine"),
                                                                                  ("b" * 32, None)]
    assert "request_id" not in records[2]
    with logs.request_context("c" * 32, "x"):
        log.info("inside")
    log.info("outside")
    inside, outside = lines()[3:]
    assert inside["request_id"] == "c" * 32 and inside["label"] == "x"
    assert "request_id" not in outside


def test_extra_fields_trace_id_and_exceptions(capture):
    log, lines = capture
    token = logs.TRACE_ID.set("4bf92f3577b34da6a3ce929d0e0e4736")
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("step failed", extra={"request_id": "d" * 32, "stage": 1, "obj": object()})
    finally:
        logs.TRACE_ID.reset(token)
    (r,) = lines()
    assert r["request_id"] == "d" * 32 and r["stage"] == 1 and r["obj"].startswith("<object")
    assert r["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert "ValueError: boom" in r["exc_info"]


def test_configure_checks_the_format_and_announce_follows_it(capsys):
    with pytest.raises(ValueError, match="--log-format"):
        logs.configure("stage", "INFO", "xml")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("stage", "INFO", "json")
        assert logs.current() == ("stage", "INFO", "json")   # what admission's tag workers configure alike
        logs.announce(logging.getLogger("stage"), "stage listening on 127.0.0.1:1")
        err = capsys.readouterr().err.strip().splitlines()
        assert json.loads(err[-1])["message"] == "stage listening on 127.0.0.1:1"
        logs.configure("stage", "INFO", "text")
        logs.announce(logging.getLogger("stage"), "stage listening on 127.0.0.1:1")
        assert capsys.readouterr().out == "stage listening on 127.0.0.1:1\n"
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
