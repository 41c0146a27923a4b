"""The fork server (tether/forkserver/): a forked stage is a real process that behaves like a fresh one:
its argv, directory, environment, output, exit status and signals; the server refuses what it must not fork,
falls back to a subprocess where a fork would be wrong, and takes its children with it when its launcher goes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tether import settings
from tether.cli.cluster import free_port, wait_serving
from tether.forkserver import client as forkserver
from tether.forkserver.client import ForkedProcess, ForkServer, ForkServerError
from tests.helpers import alive

REPO = str(Path(__file__).resolve().parents[2])
STAGE = [sys.executable, "-m", "services.stage_worker"]


@pytest.fixture(scope="module")
def server():
    """This test process's stage server (the shared one: another would import torch again)."""
    return forkserver.shared("stage", {**os.environ, "PYTHONUNBUFFERED": "1"}, REPO)


def _fork(server: ForkServer, log: Path, *args: str, env: dict[str, str] | None = None) -> ForkedProcess:
    with open(log, "ab") as out:
        return server.popen(["services.stage_worker", *args], REPO, {**server.env, **(env or {})},
                            out.fileno(), out.fileno())


def test_a_forked_command_gets_its_argv_output_and_exit_status(server, tmp_path):
    ok = _fork(server, tmp_path / "help.log", "--help")
    assert ok.wait(timeout=30) == 0 and ok.poll() == 0
    assert "usage:" in (tmp_path / "help.log").read_text() and "--max-streams" in (tmp_path / "help.log").read_text()
    bad = _fork(server, tmp_path / "bad.log", "--no-such-flag")
    assert bad.wait(timeout=30) == 2                      # argparse's exit status, as from a fresh interpreter
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "bad.log").read_text()


def test_a_forked_stage_serves_and_answers_signals_like_a_fresh_one(server, tmp_path):
    port, home = free_port(), tmp_path / "home"
    stage = _fork(server, tmp_path / "stage.log", "--port", str(port), "--model", "tiny", "--threads", "1",
                  env={settings.TETHER_HOME_ENV: str(home)})
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        assert wait_serving(ch, 120), (tmp_path / "stage.log").read_text()
    # the request's environment, read by tether's modules after the fork: the preset was generated there
    assert any(home.rglob("config.json")), list(home.rglob("*"))
    assert Path(f"/proc/{stage.pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(server.proc.pid)
    assert Path(f"/proc/{stage.pid}/cwd").resolve() == Path(REPO)
    with pytest.raises(subprocess.TimeoutExpired):
        stage.wait(timeout=0.2)
    stage.terminate()                                     # graceful: drains and exits 0
    assert stage.wait(timeout=30) == 0
    killed = _fork(server, tmp_path / "killed.log", "--port", str(free_port()), "--model", "tiny")
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL
    killed.kill()                                         # after its exit: nothing is signalled, nothing raised
    assert killed.poll() == -signal.SIGKILL and not alive(killed.pid)


def test_the_server_refuses_a_module_it_does_not_fork(server, tmp_path):
    """A stage server forks no coordinator (it would map torch), and nothing runs a module outside the list."""
    with open(tmp_path / "x.log", "ab") as out, pytest.raises(ForkServerError, match="refused"):
        server.popen(["services.coordinator", "--help"], REPO, server.env, out.fileno(), out.fileno())
    with open(tmp_path / "x.log", "ab") as out, pytest.raises(ForkServerError, match="refused"):
        server.popen(["tether.cli.main", "--help"], REPO, server.env, out.fileno(), out.fileno())
    assert forkserver.forkable([sys.executable, "-m", "tether.cli.main"]) is None
    assert forkserver.forkable([sys.executable, "-m", "services.coordinator", "-h"]) == ["services.coordinator", "-h"]
    assert forkserver.forkable([*STAGE, "--port", "1"]) == ["services.stage_worker", "--port", "1"]
    assert forkserver.forkable(["/usr/bin/python3", "-m", "services.stage_worker"]) is None


def test_an_environment_read_at_import_is_never_forked(server):
    assert server.compatible({**server.env, "TETHER_FAULTS": "drop:0.1", "NEW_VAR": "x"})
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED", "LD_PRELOAD", "TORCH_LOGS", "GRPC_TRACE"):
        assert not server.compatible({**server.env, key: "7"}), key


def test_spawn_forks_only_when_on_and_compatible(monkeypatch, tmp_path):
    monkeypatch.setenv("TETHER_FORK_SERVER", "1")
    # this test's own shared servers: one an earlier test of this worker started (a cluster's, with
    # OMP_WAIT_POLICY set) would make this env incompatible, and the forks plain subprocesses
    servers: dict = {}
    monkeypatch.setattr(forkserver, "_shared", servers)
    try:
        _spawn_forks_only_when_on_and_compatible(monkeypatch, tmp_path)
    finally:
        for s in servers.values():
            s.close()


def _spawn_forks_only_when_on_and_compatible(monkeypatch, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "a.log", "ab") as out:
        forked = forkserver.spawn([*STAGE, "--help"], REPO, env, out)
        fresh = forkserver.spawn([*STAGE, "--help"], REPO, {**env, "OMP_NUM_THREADS": "1"}, out)
        other = forkserver.spawn([sys.executable, "-c", "print('plain')"], REPO, env, out)
    with open(tmp_path / "c.log", "ab") as out:
        coordinator = forkserver.spawn([sys.executable, "-m", "services.coordinator", "--help"], REPO, env, out)
    assert isinstance(forked, ForkedProcess) and isinstance(coordinator, ForkedProcess)
    assert coordinator.wait(timeout=60) == 0 and "usage:" in (tmp_path / "c.log").read_text()
    assert forkserver.shared("service", env, REPO) is not forkserver.shared("stage", env, REPO)
    assert isinstance(fresh, subprocess.Popen) and isinstance(other, subprocess.Popen)
    assert [p.wait(timeout=60) for p in (forked, fresh, other)] == [0, 0, 0]
    monkeypatch.setenv("TETHER_FORK_SERVER", "0")
    with open(tmp_path / "b.log", "ab") as out:
        assert isinstance(forkserver.spawn([*STAGE, "--help"], REPO, env, out), subprocess.Popen)


def test_children_die_with_the_server_and_the_server_with_its_launcher(tmp_path):
    # a coordinator whose stages never answer runs until stopped; its server imports no torch (quick)
    s = ForkServer({**os.environ, "PYTHONUNBUFFERED": "1"}, REPO, kind="service")
    with open(tmp_path / "c.log", "ab") as out:
        child = s.popen(["services.coordinator", "--port", str(free_port()), "--model", "tiny",
                         "--stages", f"127.0.0.1:{free_port()}"], REPO, s.env, out.fileno(), out.fileno())
    assert child.poll() is None and alive(child.pid), (tmp_path / "c.log").read_text()
    s.close()                                             # the launcher's pipe closed: SIGTERM, then SIGKILL
    assert not alive(s.proc.pid)
    deadline = time.monotonic() + 10
    while alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child.pid)


def test_a_bad_request_is_refused_and_the_server_goes_on(server, tmp_path):
    import socket
    with open(tmp_path / "x.log", "ab") as out, socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.connect(server.path)
        socket.send_fds(conn, [b"not json"], [out.fileno(), out.fileno()])
        assert conn.recv(4096).startswith(b"error ")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:   # a client gone before the answer
        conn.connect(server.path)
        conn.send(b"{}")
    ok = _fork(server, tmp_path / "help.log", "--help")
    assert ok.wait(timeout=30) == 0


def test_a_child_whose_server_was_killed_exits_and_reads_as_sigterm(tmp_path):
    s = ForkServer({**os.environ, "PYTHONUNBUFFERED": "1"}, REPO, kind="service")
    with open(tmp_path / "c.log", "ab") as out:
        child = s.popen(["services.coordinator", "--port", str(free_port()), "--model", "tiny",
                         "--stages", f"127.0.0.1:{free_port()}"], REPO, s.env, out.fileno(), out.fileno())
    s.proc.kill()                                         # no word to its clients: the child's parent-death signal
    s.proc.wait()
    assert child.wait(timeout=30) == -signal.SIGTERM and not alive(child.pid)
    s.close()
