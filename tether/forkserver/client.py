"""Starting the fork server and asking it for children (the protocol: tether/forkserver/server.py)."""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from tether import settings
from tether.forkserver import FORKED_MODULES, IMPORT_TIME_ENV_PREFIXES
from tether.procutil import Proc


class ForkServerError(RuntimeError):
    pass


class ForkedProcess:
    """A child of the fork server, answering what subprocess.Popen does (pid, poll, wait, returncode,
    send_signal, terminate, kill). Signals go through a pidfd, so they never reach a recycled pid."""

    def __init__(self, args: list[str], pid: int, pidfd: int, conn: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._conn = conn
        self._lock = threading.Lock()

    def _collect(self, timeout: float | None) -> None:
        """Read the child's exit status if the server sent it within `timeout` seconds."""
        with self._lock:
            if self.returncode is not None:
                return
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return
            msg = self._conn.recv(64)
            if msg.startswith(b"exit "):
                self.returncode = int(msg[5:])
            else:   # the server died without a word: the child goes with it (its parent-death signal is
                # SIGTERM), and only its parent could read its status, so it reads as SIGTERM once it has exited
                exited, _, _ = select.select([self._pidfd], [], [], timeout)
                if not exited:
                    return
                self.returncode = -signal.SIGTERM
            self._conn.close()
            os.close(self._pidfd)

    def poll(self) -> int | None:
        self._collect(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._collect(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass   # exited; its status is on the way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One fork server process (started here, stopped by `close` or when this process exits)."""

    def __init__(self, env: Mapping[str, str], cwd: str, kind: str = "stage", timeout: float = 120.0) -> None:
        self.env = dict(env)
        self.kind = kind
        self._dir = tempfile.mkdtemp(prefix="tether-fork-")
        self.path = str(Path(self._dir) / "socket")
        # stdin: a pipe only we hold, so the server sees EOF however this process ends
        self.proc = subprocess.Popen([sys.executable, "-m", "tether.forkserver", self.path, kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.env, cwd=cwd)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line.startswith(b"ready"):
            self.close()
            raise ForkServerError(f"the fork server did not start (exit {self.proc.poll()})")

    def compatible(self, env: Mapping[str, str]) -> bool:
        """Whether a child may run with `env`: it agrees with the server's on everything read at import."""
        def imported(e: Mapping[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES)}
        return imported(env) == imported(self.env)

    def popen(self, args: list[str], cwd: str, env: Mapping[str, str], stdout: int, stderr: int) -> ForkedProcess:
        """Fork `python -m args[0] args[1:]` with these descriptors as its stdout and stderr."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps({"args": args, "cwd": cwd, "env": dict(env)}).encode()],
                            [stdout, stderr])
            msg, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        except OSError as e:
            conn.close()
            raise ForkServerError(f"the fork server did not answer: {e}") from e
        if not msg.startswith(b"pid ") or len(fds) != 1:
            conn.close()
            for fd in fds:
                os.close(fd)
            raise ForkServerError(f"the fork server refused {args[:1]}: {msg.decode(errors='replace')}")
        return ForkedProcess(args, int(msg[4:]), fds[0], conn)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()   # EOF: the server stops its children and exits
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def forkable(argv: list[str]) -> list[str] | None:
    """The `python -m` module and its arguments, where `argv` runs a module the server forks; else None."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in FORKED_MODULES:
        return argv[2:]
    return None


_shared: dict[str, ForkServer] = {}
_shared_lock = threading.Lock()


def shared(kind: str, env: Mapping[str, str], cwd: str) -> ForkServer:
    """This process's fork server of `kind`, started on first use with `env` (its children must be
    compatible), closed at exit."""
    with _shared_lock:
        server = _shared.get(kind)
        if server is None or server.proc.poll() is not None:
            if not _shared:
                atexit.register(_close_shared)
            server = _shared[kind] = ForkServer(env, cwd, kind)
        return server


def _close_shared() -> None:
    for server in _shared.values():
        server.close()


def enabled() -> bool:
    return os.environ.get(settings.FORK_SERVER_ENV) == "1"


def spawn(argv: list[str], cwd: str, env: Mapping[str, str], stdout: IO[Any] | None = None) -> Proc:
    """`argv` as a child process: forked by this process's fork server where it is on (`enabled`), runs a
    module it forks and `env` is compatible; a plain subprocess otherwise. stdout (and stderr) go to `stdout`,
    or where ours go."""
    module = forkable(argv) if enabled() else None
    if module is not None:
        server = shared(FORKED_MODULES[module[0]], env, cwd)
        if server.compatible(env):
            out = stdout.fileno() if stdout is not None else sys.stdout.fileno()
            return server.popen(module, cwd, env, out, out if stdout is not None else sys.stderr.fileno())
    return subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None,
                            env=dict(env), cwd=cwd)
