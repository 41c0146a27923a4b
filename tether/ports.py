"""Ports: who holds one, a bind failure worded as the configuration error it is, and the port report a service
writes for its launcher.

A launcher (`tether up`, the tests' clusters) starts its internal services on port 0 and wires the route from
the ports they report (`--port-file`): a port the launcher picked in advance could be taken by any outgoing
connection on the machine before the child binds it, since Linux hands out local ports from the same range
(`/proc/sys/net/ipv4/ip_local_port_range`). Only the ports a user connects to are fixed, and the launcher reserves
those before it starts anything (`reserve`).

A port that cannot be bound is a configuration error, not a crash: the service exits with `EXIT_PORT_IN_USE`
and one line naming the port, its holder where this machine lets us see it, and the flag that moves it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

# sysexits.h EX_CONFIG: the launcher does not restart a child that exits with it (restarting cannot help)
EXIT_PORT_IN_USE = 78


class PortInUse(OSError):
    """`port` on `host` is taken; `flag` is the option that moves it. str() is the one line a user reads."""

    def __init__(self, host: str, port: int, flag: str, holder: str | None = None, advice: str | None = None) -> None:
        self.host, self.port, self.flag, self.holder = host, port, flag, holder
        by = f" (by {holder})" if holder else ""
        super().__init__(errno.EADDRINUSE, f"port {port} on {host} is in use{by} — {advice or f'pass {flag} or free it'}")

    def __str__(self) -> str:
        return self.strerror or ""


def _socket_inodes(port: int) -> dict[int, bool]:
    """Inodes of the TCP sockets whose local port is `port` -> whether that socket listens."""
    found: dict[int, bool] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or int(cols[1].rsplit(":", 1)[1], 16) != port:
                continue
            inode = int(cols[9])
            if inode:
                found[inode] = found.get(inode, False) or cols[3] == "0A"   # 0A: LISTEN
    return found


def holder(port: int) -> str | None:
    """Who holds TCP `port` on this machine: "pid N, NAME" (", listening" or ", an outgoing connection"), or None
    where /proc does not say (another user's process, another network namespace, no /proc)."""
    inodes = _socket_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{inode}]": listens for inode, listens in inodes.items()}
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link in targets:
                name = _command(pid)
                how = "listening" if targets[link] else "an outgoing connection"
                return f"pid {pid}, {name}, {how}"
    return None


def _command(pid: str) -> str:
    """A process's command, short: the program's name and its arguments up to the first option."""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    words = [os.path.basename(argv[0])]
    for arg in argv[1:]:
        if arg.startswith("--") or len(words) == 4:
            break
        words.append(arg)
    return " ".join(words)


def _bindable(host: str) -> socket.socket:
    """A TCP socket that binds as our servers do (SO_REUSEADDR, as gRPC and uvicorn set it): a port whose only
    sockets are closed connections waiting out TIME_WAIT (a server stopped a moment ago, whose clients it had
    closed) binds; one that anything listens on, or that a live connection holds, does not."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s


def in_use(host: str, port: int) -> bool:
    """Whether binding `port` on `host` as a server does fails with EADDRINUSE right now."""
    if port == 0:
        return False
    try:
        with _bindable(host) as s:
            s.bind((host, port))
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    return False


def bind_error(host: str, port: int, flag: str, cause: BaseException | str) -> OSError:
    """The error for a failed bind of `port` on `host` (moved by `flag`): PortInUse when the port is taken,
    else an OSError that names the flag and the cause."""
    if in_use(host, port):
        return PortInUse(host, port, flag, holder(port))
    reason = getattr(cause, "strerror", None) or str(cause)
    return OSError(f"{flag} {port}: cannot listen on {host}:{port}: {reason}")


def reserve(host: str, port: int, flag: str, advice: str | None = None) -> socket.socket:
    """Hold `port` on `host` until the service that will serve it starts: nothing else (an outgoing connection's
    local port, another launcher's reservation) can take it meanwhile. Bound as a server binds, so the TIME_WAIT
    of a cluster stopped a moment ago does not count as in use, and listening (backlog 0; a client that connects
    before the service starts is reset when this closes), so that a second reservation, which binds the same
    way, is refused. PortInUse (saying `advice`, else to pass `flag`) when it is taken now."""
    s = _bindable(host)
    try:
        s.bind((host, port))
        s.listen(0)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(host, port, flag, holder(port), advice) from None
        raise OSError(f"{flag} {port}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return s


@dataclass(frozen=True)
class Report:
    """What a service wrote to its --port-file: its ports by flag ("--port", "--http-port", "--metrics-port"),
    whether it serves yet (`ready`), or the port error that ended it (`error`, `flag`, `port`)."""
    ports: dict[str, int]
    ready: bool = False
    error: str | None = None
    flag: str | None = None
    port: int | None = None


def write_report(path: str | os.PathLike[str], report: Report) -> None:
    """Write `report` to `path` whole (a temporary file renamed over it): a reader never sees half of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "ports": report.ports, "ready": report.ready, "error": report.error,
                   "flag": report.flag, "port": report.port}, f)
    os.replace(tmp, path)


def read_report(path: str | os.PathLike[str]) -> Report | None:
    """The report at `path`, None while there is none."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return Report({str(k): int(v) for k, v in (data.get("ports") or {}).items()}, bool(data.get("ready")),
                  data.get("error"), data.get("flag"), data.get("port"))
