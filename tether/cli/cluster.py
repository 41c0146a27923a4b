"""A local tether cluster as child processes: what `tether up` runs and what the service tests start.

Each service is its own process talking gRPC on loopback, launched with exactly the command a container
runs (see docker-compose.yml). Readiness is the admission's gRPC health (SERVING only once the coordinator
has assembled its pipeline), never a sleep. Children die with the parent (tether/procutil.py) and are
stopped with SIGTERM, then SIGKILL after a grace period: no orphans. With `tls=True` every service gets its own
certificate from a `tether certs init` folder (made if missing) and the cluster runs mutual TLS between
services (docs/PROTOCOL.md, "Transport security").
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether import settings
from tether.forkserver import client as forkserver
from tether.procutil import PARENT_ENV, Proc
from tether.security import certs, tls as tls_config
from tether.model.config import ModelConfig, even_split
from tether.model.folder import resolve_model

SERVING = health_pb2.HealthCheckResponse.SERVING


def wait_serving(channel: grpc.Channel, timeout: float, before_each: Callable[[], None] | None = None) -> bool:
    """Poll the gRPC health (grpc.health.v1, the whole server) over `channel` until it says SERVING (True) or
    `timeout` seconds pass (False). `before_each` runs before every check: it raises to stop waiting (e.g. a
    process that should answer has exited)."""
    deadline = time.monotonic() + timeout
    stub = health_pb2_grpc.HealthStub(channel)
    while time.monotonic() < deadline:
        if before_each is not None:
            before_each()
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == SERVING:
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    return False


def listening(address: str) -> bool:
    """Whether something accepts TCP connections at HOST:PORT (a child that got as far as serving)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.2):
            return True
    except OSError:
        return False


class StartupSupervisor(Protocol):
    """What start-up hands a dead child that had come up to (tether/cli/supervisor.py `Supervisor`)."""

    def poll(self, now: float) -> None: ...


# Free ports are drawn below the kernel's ephemeral range: a port the kernel hands out (bind to 0) is in that range,
# where every outgoing connection also takes its local port, so between our check and the child's bind a client
# socket could take it ("Address already in use", seen under test load). Below the range only another picker can.
FREE_PORT_FLOOR = 10_000
_handed_out: set[tuple[str, int]] = set()
_random = random.SystemRandom()   # independent draws in parallel processes (no shared seed)


def ephemeral_floor(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port the kernel picks for outgoing connections (32768 where it cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` nothing listens on, below the ephemeral range, not handed out before by this process."""
    top = ephemeral_floor()
    for _ in range(64 if top > FREE_PORT_FLOOR + 1000 else 0):
        port = _random.randrange(FREE_PORT_FLOOR, top)
        if (host, port) in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add((host, port))
        return port
    with socket.socket() as s:   # no room below the range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    argv: list[str]
    address: str
    proc: Proc | None = None
    log_path: Path | None = None
    metrics_address: str | None = None   # HOST:PORT of its /metrics, when metrics are on
    came_up: bool = False                # it has listened on its port (since its first spawn): a healthy child
    http_address: str | None = None      # admission's HOST:PORT of the OpenAI-compatible HTTP API, when served
    http_tls: bool = False

    @property
    def base_url(self) -> str | None:
        """The OpenAI base URL of admission's HTTP API (what `openai.OpenAI(base_url=...)` takes)."""
        if self.http_address is None:
            return None
        return f"{'https' if self.http_tls else 'http'}://{self.http_address}/v1"

    @property
    def metrics_url(self) -> str | None:
        return f"http://{self.metrics_address}/metrics" if self.metrics_address else None

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def pipeline_prefix(k: int) -> str:
    """Service names of pipeline k: the first pipeline's are plain (stage0, coordinator), the others' are
    prefixed (p1-stage0, p1-coordinator)."""
    return f"p{k}-" if k else ""


def default_metrics_ports(stages: int, pipelines: int = 1) -> dict[str, int]:
    """Service name -> its --metrics-port in `tether up --metrics`, docker-compose.yml and deploy/k8s."""
    ports = {f"{pipeline_prefix(k)}stage{i}": settings.STAGE_METRICS_BASE_PORT + k * stages + i
             for k in range(pipelines) for i in range(stages)}
    ports.update({f"{pipeline_prefix(k)}coordinator": settings.COORDINATOR_METRICS_PORT + k for k in range(pipelines)})
    ports.update(admission=settings.ADMISSION_METRICS_PORT)
    return ports


def service_commands(model: str, stages: int, host: str = "127.0.0.1", admission_port: int = settings.ADMISSION_PORT,
                     coordinator_port: int = settings.COORDINATOR_PORT, stage_ports: list[int] | None = None,
                     threads: int = 0, extra: dict[str, list[str]] | None = None,
                     metrics_ports: dict[str, int] | None = None, pipelines: int = 1,
                     coordinator_ports: list[int] | None = None, tls_dir: Path | None = None,
                     http_port: int | None = settings.HTTP_PORT) -> list[Service]:
    """The commands of a cluster, in start order (each pipeline's stages and coordinator, then admission).
    Pipeline k's stage i listens on stage_ports[k * stages + i] and its coordinator on coordinator_port + k
    (or coordinator_ports[k]). `metrics_ports` (service name -> port, e.g. default_metrics_ports()) turns on
    every service's /metrics; None leaves them off. `tls_dir` (a `tether certs init` folder) gives every service
    its certificate: stage i of any pipeline stage-i's, the coordinators coordinator's, admission admission's.
    `http_port`: admission's OpenAI-compatible HTTP port; None serves gRPC only."""
    stage_ports = stage_ports or [settings.STAGE_BASE_PORT + i for i in range(stages * pipelines)]
    coordinator_ports = coordinator_ports or [coordinator_port + k for k in range(pipelines)]
    extra = extra or {}
    py = [sys.executable, "-m"]
    services = []

    def add(name: str, argv: list[str], port: int, role: str, cert: str) -> None:
        svc = Service(name, argv, f"{host}:{port}")
        if tls_dir is not None:
            svc.argv += tls_config.service_flags(tls_dir, cert)
        if metrics_ports is not None:
            svc.argv += ["--metrics-port", str(metrics_ports[name])]
            # /metrics stays on loopback (--metrics-host's default) whatever --host the cluster serves on
            svc.metrics_address = f"{settings.METRICS_HOST}:{metrics_ports[name]}"
        svc.argv += extra.get(role, [])
        services.append(svc)

    for k in range(pipelines):
        first = len(services)
        for i in range(stages):
            port = stage_ports[k * stages + i]
            argv = py + ["services.stage_worker", "--host", host, "--port", str(port), "--model", model,
                         "--layers", f"{i}/{stages}"]
            if threads:
                argv += ["--threads", str(threads)]
            if pipelines > 1:   # a step alone in its pipeline shares the cores with the other pipelines
                argv += ["--alone-threads", str(max(1, len(os.sched_getaffinity(0)) // pipelines))]
            add(f"{pipeline_prefix(k)}stage{i}", argv, port, "stage", f"stage-{i}")
        route = ",".join(s.address for s in services[first:])
        add(f"{pipeline_prefix(k)}coordinator", py + ["services.coordinator", "--host", host, "--port",
                                                      str(coordinator_ports[k]), "--model", model, "--stages", route],
            coordinator_ports[k], "coordinator", "coordinator")
    coordinators = ",".join(f"{host}:{p}" for p in coordinator_ports)
    add("admission", py + ["services.admission", "--host", host, "--port", str(admission_port), "--model", model,
                           "--coordinator", coordinators]
        # admission's own default (settings.HTTP_PORT) is not repeated: the deploy files' commands match these
        + (["--no-http"] if http_port is None else [] if http_port == settings.HTTP_PORT else
           ["--http-port", str(http_port)]),
        admission_port, "admission", "admission")
    if http_port is not None:
        services[-1].http_address, services[-1].http_tls = f"{host}:{http_port}", tls_dir is not None
    return services


@dataclass
class LocalCluster:
    model: str = settings.DEFAULT_MODEL
    stages: int = 2
    pipelines: int = 1               # independent pipelines (stages + coordinator each) behind one admission
    host: str = "127.0.0.1"
    admission_port: int = 0          # 0: pick free ports for every service (tests); `tether up` passes ports
    coordinator_port: int = settings.COORDINATOR_PORT
    stage_port: int = settings.STAGE_BASE_PORT   # stage i listens on stage_port + i
    threads: int = 0
    log_dir: Path | None = None      # None: children write to this process's stdout/stderr
    metrics: bool = False            # every service serves /metrics: on free ports when the gRPC ports are
                                     # free ones, else on default_metrics_ports()
    extra: dict[str, list[str]] = field(default_factory=dict)
    tls: bool = False                # mutual TLS between services, certificates from tls_dir
    tls_dir: Path | None = None      # a `tether certs init` folder; None with tls: one is made (log_dir/tls or a temp dir)
    http: bool = True                # admission serves the OpenAI-compatible HTTP API (on a free port when the
    http_port: int = settings.HTTP_PORT   # gRPC ports are free ones, else on http_port)
    services: list[Service] = field(default_factory=list)

    @property
    def target(self) -> str:
        return self.services[-1].address

    @property
    def base_url(self) -> str | None:
        """admission's OpenAI base URL (http://HOST:PORT/v1), None without the HTTP API."""
        return self.services[-1].base_url

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def start(self, timeout: float = 120.0, supervisor: StartupSupervisor | None = None) -> "LocalCluster":
        """Launch every child and wait until every pipeline serves (each coordinator SERVING: its stages
        handshaken), then admission. Admission alone turns SERVING with its first pipeline, so waiting on it
        only returned a cluster whose other pipelines might still be loading. With `supervisor`, a child that
        came up and then died meanwhile is restarted by it like any other (only one that never came up fails
        the start)."""
        self.launch()
        deadline = time.monotonic() + timeout
        for svc in self.services:
            if svc.name.endswith("coordinator"):
                self.wait_ready(max(1.0, deadline - time.monotonic()), svc.name, supervisor=supervisor)
        self.wait_ready(max(1.0, deadline - time.monotonic()), supervisor=supervisor)
        return self

    def launch(self) -> "LocalCluster":
        """Build every child's command and spawn them all (no waiting)."""
        folder = resolve_model(self.model)      # generate a preset once, before children race for it
        if self.tls:
            if self.tls_dir is None:
                self.tls_dir = (self.log_dir / "tls") if self.log_dir is not None else \
                    Path(tempfile.mkdtemp(prefix="tether-tls-"))
            certs.init(self.tls_dir, stages=self.stages)   # the CA and what is missing; existing files are kept
        num_layers = ModelConfig.from_folder(folder).num_hidden_layers
        even_split(num_layers, self.stages)     # fail early with a clear message
        free = self.admission_port == 0
        n, stages = self.pipelines, self.stages
        ports = [free_port(self.host) for _ in range(2 + n + n * stages)] if free else []
        metrics_ports = None
        if self.metrics:
            metrics_ports = default_metrics_ports(stages, n)
            if free:
                metrics_ports = {name: free_port(self.host) for name in metrics_ports}
        self.services = service_commands(
            self.model, stages, self.host,
            admission_port=ports[0] if free else self.admission_port,
            coordinator_port=self.coordinator_port, coordinator_ports=ports[1:1 + n] if free else None,
            stage_ports=ports[1 + n:-1] if free else [self.stage_port + i for i in range(n * stages)],
            threads=self.threads, extra=self.extra, metrics_ports=metrics_ports, pipelines=n,
            tls_dir=self.tls_dir if self.tls else None,
            http_port=None if not self.http else ports[-1] if free else self.http_port)
        for svc in self.services:
            self.spawn(svc)
        return self

    def spawn(self, svc: Service) -> None:
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            svc.log_path = self.log_dir / f"{svc.name}.log"
            out = open(svc.log_path, "ab")
        # Bounded OpenMP waits (settings.OMP_ENV): long spins starve the other services sharing the cores.
        env = {**settings.OMP_ENV, **os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
        try:
            svc.proc = forkserver.spawn(svc.argv, _repo_root(), env, out)
        finally:
            if out is not None:
                out.close()

    def wait_ready(self, timeout: float, name: str = "admission",
                   supervisor: StartupSupervisor | None = None) -> None:
        """Block until the service reports SERVING (for admission: a pipeline is up). A child that exits before
        it ever listened fails the start (a bad flag, a port taken, a model that does not load: restarting
        would fail the same way); one that had come up is a crash like any later one: `supervisor` restarts it
        (without one, nothing would, so it fails the start too)."""
        svc = self.service(name)

        def check_children() -> None:
            for s in self.services:
                if s.proc is None:
                    continue
                if not s.came_up and s.proc.poll() is None and listening(s.address):
                    s.came_up = True
                if s.proc.poll() is not None and (supervisor is None or not s.came_up):
                    when = "during start-up" if not s.came_up else "after it came up, with nothing to restart it"
                    raise RuntimeError(f"{s.name} exited with {s.proc.returncode} {when}\n{s.log_tail()}")
            if supervisor is not None:
                supervisor.poll(time.monotonic())
        with self.channel(name) as ch:
            if wait_serving(ch, timeout, before_each=check_children):
                return
        raise TimeoutError(f"{name} at {svc.address} not SERVING after {timeout:.0f}s\n{svc.log_tail()}")

    def channel(self, name: str, cert: str | None = "operator") -> grpc.Channel:
        """A blocking channel to service `name`; with TLS verified against the cluster's CA and presenting
        certificate `cert` of its folder (None: none)."""
        address = self.service(name).address
        if not self.tls:
            return grpc.insecure_channel(address)
        assert self.tls_dir is not None
        key = (self.tls_dir / f"{cert}.pem", self.tls_dir / f"{cert}.key") if cert else (None, None)
        return grpc.secure_channel(address, tls_config.client_channel_credentials(certs.ca_path(self.tls_dir), *key))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.service(name).proc
        assert proc is not None, f"{name} was never started"
        proc.send_signal(sig)
        proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        self.spawn(self.service(name))

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every child (admission first), then SIGKILL whatever outlives the grace period."""
        live = [s.proc for s in reversed(self.services) if s.proc is not None and s.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])
