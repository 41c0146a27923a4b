"""`tether up` supervises its children: a SIGKILLed stage is restarted with the same command and ports, the
coordinator replays the requests that were in flight, and they finish with exactly the reference tokens.
A child that keeps crashing makes the launcher give up, stop everything and say why."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from tether import reference, settings
from tether.cli.cluster import free_port, wait_serving
from tether.cli.up import build_parser
from tether.client import AsyncClient, Client, TetherError
from tests.helpers import alive

TETHER = [sys.executable, "-m", "tether.cli.main"]
EXPLICIT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED}
CALL_DEADLINE_S = settings.RECOVERY_WINDOW_S + 60   # recovery window + restart + the rest of the generation
MAX_TOKENS = 64      # ~1.5 s for 8 concurrent streams on the tiny model: the kill lands well inside that
CASES = [dict(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for p in [
    "请用不超过50字向老人解释血糖仪读数",
    "Explain in under 30 words why the sky is blue.",
    "写一首关于秋天的短诗",
    "def fib(n):",
    "Summarize: the quick brown fox jumps over the lazy dog.",
    "你好",
    "把这句话翻译成英文：今天天气很好。",
    "A" * 200,
]]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports() -> tuple[int, int, int]:
    """(admission, coordinator, stage base) with stage ports base and base + 1 free and all four distinct."""
    for _ in range(100):
        admission, coordinator, base = free_port(), free_port(), free_port()
        if len({admission, coordinator, base, base + 1}) == 4 and _bindable(base + 1):
            return admission, coordinator, base
    raise RuntimeError("no free port pair for the stages")


class Launcher:
    """`tether up` as a subprocess; a thread collects its output lines (children log to --log-dir)."""

    def __init__(self, log_dir: Path, *flags: str) -> None:
        self.admission, coordinator, stage = _ports()
        self.target = f"127.0.0.1:{self.admission}"
        self.proc = subprocess.Popen(
            TETHER + ["up", "--model", "tiny", "--stages", "2", "--threads", "1", "--port", str(self.admission),
                      "--coordinator-port", str(coordinator), "--stage-port", str(stage),
                      "--log-dir", str(log_dir), "--no-http", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.pids: dict[str, list[int]] = {}   # every pid each service has had, in order
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                if m := re.match(r"\s*(\w+)\s+\S+\s+\(pid (\d+)\)|(\w+) restarted \(pid (\d+)\)", line):
                    name, pid = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
                    self.pids.setdefault(name, []).append(int(pid))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first output line matching `pattern`, waiting up to `timeout` s for it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    pytest.fail(f"no line matching {pattern!r} in tether up's output:\n{''.join(self.lines)}")
                self._changed.wait(min(left, 1.0))

    def all_pids(self) -> list[int]:
        with self._changed:
            return [p for pids in self.pids.values() for p in pids]

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:   # never leave a launcher behind, whatever failed
                self.proc.kill()
                self.proc.wait()
            self._reader.join(10)


def _wait_serving(target: str, timeout: float) -> None:
    with grpc.insecure_channel(target) as ch:
        if not wait_serving(ch, timeout):
            pytest.fail(f"{target} not SERVING after {timeout:.0f} s")


def _assert_no_child_left(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "a child outlived tether up"


async def _stream_and_kill(target: str, pid: int) -> tuple[list, list[int], float | None]:
    """CASES as concurrent streams; SIGKILL `pid` once every stream has yielded a token (mid-generation).
    Returns (result or TetherError per case, tokens per stream at the kill, seconds to the first token after)."""
    first = [asyncio.Event() for _ in CASES]
    counts = [0] * len(CASES)
    token_times: list[float] = []

    async def run(client: AsyncClient, i: int):
        stream = client.stream(**CASES[i])
        try:
            async for _ in stream:
                counts[i] += 1
                token_times.append(time.monotonic())
                first[i].set()
            return stream.result
        except TetherError as e:
            return e
        finally:
            first[i].set()   # a stream that failed early must not hold the kill back

    async with AsyncClient(target, timeout=CALL_DEADLINE_S) as client:
        tasks = [asyncio.create_task(run(client, i)) for i in range(len(CASES))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 60)
        at_kill = list(counts)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.gather(*tasks)
    after = [t for t in token_times if t > killed_at]
    return results, at_kill, (min(after) - killed_at) if after else None


def test_help_explains_the_restart_policy():
    text = " ".join(build_parser().format_help().split())
    assert "restart policy" in text and "--max-restarts" in text and "--no-restart" in text
    assert f"after {settings.SUPERVISE_BACKOFF_BASE_S:g} s" in text and f"{settings.SUPERVISE_WINDOW_S:g} s" in text


def test_sigkilled_stage_is_restarted_and_in_flight_requests_complete_exactly(tmp_path):
    up = Launcher(tmp_path)
    try:
        up.wait_for("tether is up", 180)
        _wait_serving(up.target, 60)
        old = up.pids["stage1"][0]
        t0 = time.monotonic()
        results, at_kill, resumed_after = asyncio.run(_stream_and_kill(up.target, old))
        elapsed = time.monotonic() - t0
        assert sum(n < MAX_TOKENS for n in at_kill) >= 6, f"the kill did not land mid-generation: {at_kill}"

        up.wait_for(re.escape(f"stage1 exited with -9; restarting in {settings.SUPERVISE_BACKOFF_BASE_S:g} s "
                              f"(crash 1 of {settings.SUPERVISE_MAX_RESTARTS} in "
                              f"{settings.SUPERVISE_WINDOW_S:g} s)"), 10)
        new = int(up.wait_for(r"stage1 restarted \(pid (\d+)\)", 10).group(1))
        assert new != old and alive(new)

        exact, failed = 0, []
        for case, got in zip(CASES, results):
            if isinstance(got, TetherError):
                assert got.code in EXPLICIT, (got.code, got.message)
                failed.append(got.code.name)
                continue
            want = reference.generate(case["prompt"], "tiny", **{k: v for k, v in case.items() if k != "prompt"})
            assert got.token_ids == want.token_ids, f"a recovered request differs from its reference: {case}"
            exact += 1
        print(f"\nSIGKILL of stage1 with tokens {at_kill} streamed: first token again after {resumed_after:.2f} s, "
              f"{exact}/{len(CASES)} exact, failed {failed}, all done in {elapsed:.1f} s")
        assert exact >= 6, f"only {exact} of {len(CASES)} recovered exactly (failed: {failed})"

        with Client(up.target, timeout=60) as client:   # the restarted cluster serves new work exactly
            got = client.generate("写一首关于秋天的短诗", max_tokens=24)
        assert got.token_ids == reference.generate("写一首关于秋天的短诗", "tiny", max_tokens=24).token_ids
    finally:
        rc = up.terminate()
    assert rc == 0, up.output
    assert "stopped." in up.output
    _assert_no_child_left(up.all_pids())


@pytest.mark.parametrize("flags, kills", [(["--max-restarts", "1"], 2), (["--no-restart"], 1)])
def test_launcher_gives_up_after_too_many_crashes(tmp_path, flags, kills):
    up = Launcher(tmp_path, *flags)
    try:
        up.wait_for("tether is up", 180)
        for k in range(kills):
            pid = up.pids["stage1"][-1]
            os.kill(pid, signal.SIGKILL)     # as soon as it is back: a crash loop
            if k + 1 < kills:
                up.wait_for(rf"stage1 restarted \(pid (?!{pid}\b)\d+\)", 15)
        rc = up.proc.wait(timeout=60)
    finally:
        up.terminate()
    out = up.output
    assert rc != 0, out
    if kills > 1:
        assert "stage1 exited with -9: 2 crashes within 60 s, more than the 1 restart(s) allowed; giving up" in out
    else:
        assert "stage1 exited with -9; restarts are off: stopping the cluster" in out
    log = (tmp_path / "stage1.log").read_text().strip().splitlines()
    assert log and "--- last lines of stage1's log ---\n" in out and log[-1] in out, out
    assert "stopped." in out
    _assert_no_child_left(up.all_pids())
