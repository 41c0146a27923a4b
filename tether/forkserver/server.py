"""The fork server: imports its kind's PRELOADS, then forks one child per request until its launcher goes.

Protocol (AF_UNIX SOCK_SEQPACKET, one connection per child, messages whole): the client sends a JSON request
{"args": [module, arg...], "cwd": str, "env": {str: str}} with its stdout and stderr descriptors attached
(SCM_RIGHTS); the server answers "pid N" with a pidfd of the child attached (signals sent through it cannot
reach a recycled pid), and, when it has reaped the child, "exit CODE" (subprocess's returncode: negative for
a signal), then closes the connection. stdin is the launcher's pipe: at EOF (the launcher exited, however it
died) or on SIGTERM the server sends SIGTERM to its children, SIGKILL after a grace, and exits.

Single-threaded by construction: a fork copies only the calling thread, so no other thread's lock can be
held in a child. Threads the preloaded libraries start (numpy's OpenBLAS pool) are fork-aware.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from tether.forkserver import FORKED_MODULES, PRELOADS
from tether.procutil import PARENT_ENV

MAX_REQUEST = 1 << 20   # bytes of one request (its environment included)
STOP_GRACE_S = 5.0


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in PRELOADS:
        raise SystemExit(f"usage: python -m tether.forkserver SOCKET {{{','.join(PRELOADS)}}} "
                         "(started by tether.forkserver.client)")
    # no PR_SET_PDEATHSIG here (it follows the launcher's *thread*, which may be short-lived): stdin's EOF
    kind = argv[1]
    for name in PRELOADS[kind]:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(argv[0])
    listener.listen(64)
    Server(listener, kind).run()


class Server:
    def __init__(self, listener: socket.socket, kind: str) -> None:
        self.listener = listener
        self.kind = kind
        self.children: dict[int, socket.socket] = {}
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)   # wakes select through the wakeup fd
        signal.signal(signal.SIGTERM, self._stop)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, self._accept)
        self.selector.register(self.wake_r, selectors.EVENT_READ, self._reap)
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, self._launcher)

    def _stop(self, *_: Any) -> None:
        self.stopping = True

    def run(self) -> None:
        print(f"ready {os.getpid()}", flush=True)   # the client waits for this line
        while not self.stopping:
            for key, _ in self.selector.select():
                key.data()
        self._shutdown()

    def _launcher(self) -> None:
        if not os.read(sys.stdin.fileno(), 4096):   # EOF: the launcher is gone
            self.stopping = True

    def _accept(self) -> None:
        """One request: refused with "error ..." (the server goes on serving), or forked."""
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 2)
            request = json.loads(msg)
            args, cwd, env = request["args"], request["cwd"], request["env"]
            if len(fds) != 2 or not args or FORKED_MODULES.get(args[0]) != self.kind:
                raise ValueError(f"refused: {args[:1]} with {len(fds)} descriptors")
            sys.stdout.flush()
            sys.stderr.flush()
            server = os.getpid()   # read before the fork: a child that asks getppid() after we died gets init
            pid = os.fork()
        except (OSError, ValueError, KeyError, TypeError) as e:   # a bad request, or no fork (EAGAIN, ENOMEM)
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"error {e}".encode()[:4096])
            except OSError:
                pass
            conn.close()
            return
        if pid == 0:
            self._become_child(conn, fds, args, cwd, env, server)   # never returns
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)   # before any reap, so it names this child
        try:
            socket.send_fds(conn, [f"pid {pid}".encode()], [pidfd])
        except OSError:
            pass   # the client went away: the child runs on, and is reaped like any other
        os.close(pidfd)
        self.children[pid] = conn

    def _reap(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}".encode())
                except OSError:
                    pass
                conn.close()

    def _shutdown(self) -> None:
        for pid in self.children:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        for pid in self.children:
            _signal(pid, signal.SIGKILL)

    def _become_child(self, conn: socket.socket, fds: list[int], args: list[str], cwd: str,
                      env: dict[str, str], server: int) -> None:
        """In the forked child: the server's state dropped, the request's descriptors, directory, environment
        and argv taken, then `python -m args[0] args[1:]` run as the interpreter would; exits with its code."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            self.selector.close()
            for s in (self.listener, conn, *self.children.values()):
                s.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                os.close(fd)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            os.environ[PARENT_ENV] = str(server)   # follow_parent() then dies with the server, or exits if it has
            sys.argv = ["-m", *args[1:]]
            code = _run_module(args[0])
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)


def _run_module(module: str) -> int:
    """`python -m module` inside this process: its exit code, after what the interpreter does at exit
    (non-daemon threads joined, atexit handlers, streams flushed)."""
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first: join non-daemon threads
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
