"""`tether up` never loses a start to a port taken by chance, and says so in one line when a port it must use is
taken: its internal services bind ports the kernel gives them (so holding the old fixed ones changes nothing),
while a public port in use fails the start at once, before any model loads, naming the port, its holder and the
flag that moves it; an explicit internal port in use fails the same way, never restarted."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

from tether import settings
from tether.cli.cluster import free_port
from tether.client import Client

TETHER = [sys.executable, "-m", "tether.cli.main"]
ENV = {**os.environ, settings.FORK_SERVER_ENV: "0"}   # as users run it: plain processes


@contextlib.contextmanager
def held(*ports: int, listen: bool = False):
    """Hold `ports` on 127.0.0.1 as something else on the machine would: bound (an outgoing connection's local
    port is bound like this) or listening. A port that is busy already stays busy: held either way."""
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                if listen:
                    s.listen()
            except OSError:
                s.close()
                continue
            socks.append(s)
        yield
    finally:
        for s in socks:
            s.close()


def _up(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(TETHER + ["up", "--model", "tiny", "--stages", "2", "--threads", "1", *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def test_the_old_internal_ports_held_busy_do_not_stop_the_start(tmp_path):
    port, http = free_port(), free_port()
    old = [settings.COORDINATOR_PORT, settings.STAGE_BASE_PORT, settings.STAGE_BASE_PORT + 1]
    with held(*old):
        up = subprocess.Popen(TETHER + ["up", "--model", "tiny", "--stages", "2", "--threads", "1", "--port",
                                        str(port), "--http-port", str(http), "--log-dir", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        lines = []
        try:
            assert up.stdout is not None
            for line in up.stdout:
                lines.append(line)
                if "tether is up" in line:
                    break
            out = "".join(lines)
            assert "tether is up" in out, out
            listed = [line.split()[1] for line in lines if line.startswith("  ") and "(pid" in line]
            assert len(listed) == 4 and all(int(a.rpartition(":")[2]) not in old for a in listed[:3]), out
            assert listed[3] == f"127.0.0.1:{port}"                        # the public port is the one asked for
            with Client(f"127.0.0.1:{port}", timeout=60) as c:
                assert len(c.generate("hello", max_tokens=3, ignore_eos=True).token_ids) == 3
        finally:
            up.terminate()
            up.wait(timeout=60)


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_public_port_in_use_fails_at_once_in_one_line(flag):
    ports = {"--port": free_port(), "--http-port": free_port()}
    with held(ports[flag], listen=True):
        started = time.monotonic()
        r = _up("--port", str(ports["--port"]), "--http-port", str(ports["--http-port"]))
        took = time.monotonic() - started
    assert r.returncode != 0
    errors = r.stderr.strip().splitlines()
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith(f"tether up: port {ports[flag]} on 127.0.0.1 is in use (by pid {os.getpid()}, ")
    assert errors[0].endswith(f", listening) — pass {flag} or free it"), errors
    assert "stopping" not in r.stdout, r.stdout   # nothing was started, so nothing to stop
    assert took < 20, took   # before any model loads (a start of tiny takes longer than the interpreter's start)


def test_an_explicit_stage_port_in_use_fails_the_start_without_restarts(tmp_path):
    base = free_port()
    with held(base + 1, listen=True):   # stage 1's port
        r = _up("--port", str(free_port()), "--http-port", str(free_port()), "--stage-port", str(base),
                "--log-dir", str(tmp_path), timeout=120)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, r.stderr
    assert f"stage1: port {base + 1} on 127.0.0.1 is in use" in errors[0] and "pass --stage-port or free it" in \
        errors[0], errors
    assert "restart" not in r.stdout and "Traceback" not in r.stderr, r.stdout
