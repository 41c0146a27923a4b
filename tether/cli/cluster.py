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
import shutil
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

from tether import ports, settings
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
    role: str = ""                       # "stage", "coordinator" or "admission"
    port_file: Path | None = None        # where it reports its ports (--port-file), when the launcher reads them

    def report(self) -> ports.Report | None:
        """What it last wrote to its --port-file (None: nothing yet, or no port file)."""
        return ports.read_report(self.port_file) if self.port_file is not None else None

    def pin_ports(self, report: ports.Report) -> None:
        """Take the ports it reported as its own: its address, and its flags, so that a restart listens where
        its peers already connect (a `--port 0` becomes the port the kernel gave it)."""
        host = self.address.rpartition(":")[0]
        for flag, port in report.ports.items():
            if flag in self.argv and self.argv[self.argv.index(flag) + 1] == "0":
                self.argv[self.argv.index(flag) + 1] = str(port)
        if "--port" in report.ports:
            self.address = f"{host}:{report.ports['--port']}"
        if "--http-port" in report.ports and self.http_address is not None:
            self.http_address = f"{host}:{report.ports['--http-port']}"
        if "--metrics-port" in report.ports and self.metrics_address is not None:
            self.metrics_address = f"{settings.METRICS_HOST}:{report.ports['--metrics-port']}"

    def exit_reason(self, code: int | None) -> str | None:
        """The one line a launcher says for an exit that restarting cannot mend (a port in use), else None."""
        if code != ports.EXIT_PORT_IN_USE:
            return None
        report = self.report()
        if report is None or report.error is None:
            return f"{self.name} could not bind a port (exit {code}): {self.log_tail(1)}"
        launcher_flag = LAUNCHER_FLAGS.get((self.role, report.flag or ""))
        if launcher_flag is None:   # a --metrics-port, or a flag given through extra arguments
            return f"{self.name}: {report.error}"
        return f"{self.name}: {report.error.replace(f'pass {report.flag} ', f'pass {launcher_flag} ')}"

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


def stage_command(model: str, host: str, port: int, i: int, stages: int, threads: int = 0,
                  pipelines: int = 1) -> list[str]:
    """`python -m services.stage_worker ...` of stage i of `stages` (in any pipeline)."""
    argv = [sys.executable, "-m", "services.stage_worker", "--host", host, "--port", str(port), "--model", model,
            "--layers", f"{i}/{stages}"]
    if threads:
        argv += ["--threads", str(threads)]
    if pipelines > 1:   # a step alone in its pipeline shares the cores with the other pipelines
        argv += ["--alone-threads", str(max(1, len(os.sched_getaffinity(0)) // pipelines))]
    return argv


def linear_inputs_flags(inputs: str) -> list[str]:
    """The stage flags that ask for `inputs` (dtypes.LINEAR_INPUTS), none for the default: what `tether up`,
    `tether bench --spawn` and the llama-server bench add to LocalCluster's `extra["stage"]`."""
    return [] if inputs == settings.LINEAR_INPUTS else ["--linear-inputs", inputs]


def coordinator_command(model: str, host: str, port: int, route: list[str]) -> list[str]:
    """`python -m services.coordinator ...` over the stages at `route` (HOST:PORT, in order)."""
    return [sys.executable, "-m", "services.coordinator", "--host", host, "--port", str(port), "--model", model,
            "--stages", ",".join(route)]


def admission_command(model: str, host: str, port: int, coordinators: list[str],
                      http_port: int | None = settings.HTTP_PORT) -> list[str]:
    """`python -m services.admission ...` in front of `coordinators` (HOST:PORT); `http_port` None: gRPC only."""
    return ([sys.executable, "-m", "services.admission", "--host", host, "--port", str(port), "--model", model,
             "--coordinator", ",".join(coordinators)]
            # admission's own default (settings.HTTP_PORT) is not repeated: the deploy files' commands match these
            + (["--no-http"] if http_port is None else [] if http_port == settings.HTTP_PORT else
               ["--http-port", str(http_port)]))


def _service(name: str, role: str, argv: list[str], host: str, port: int, cert: str, tls_dir: Path | None,
             metrics_port: int | None, extra: dict[str, list[str]]) -> Service:
    """A Service of `argv` with what every service gets alike: its certificate, /metrics, the extra flags."""
    svc = Service(name, argv, f"{host}:{port}", role=role)
    if tls_dir is not None:
        svc.argv += tls_config.service_flags(tls_dir, cert)
    if metrics_port is not None:
        svc.argv += ["--metrics-port", str(metrics_port)]
        # /metrics stays on loopback (--metrics-host's default) whatever --host the cluster serves on
        svc.metrics_address = f"{settings.METRICS_HOST}:{metrics_port}"
    svc.argv += extra.get(role, [])
    return svc


def service_commands(model: str, stages: int, host: str = "127.0.0.1", admission_port: int = settings.ADMISSION_PORT,
                     coordinator_port: int = settings.COORDINATOR_PORT, stage_ports: list[int] | None = None,
                     threads: int = 0, extra: dict[str, list[str]] | None = None,
                     metrics_ports: dict[str, int] | None = None, pipelines: int = 1,
                     coordinator_ports: list[int] | None = None, tls_dir: Path | None = None,
                     http_port: int | None = settings.HTTP_PORT) -> list[Service]:
    """The commands of a cluster on fixed ports, in start order (each pipeline's stages and coordinator, then
    admission): what docker-compose.yml and deploy/k8s run, each service in its own network namespace. Pipeline
    k's stage i listens on stage_ports[k * stages + i] and its coordinator on coordinator_port + k (or
    coordinator_ports[k]). `metrics_ports` (service name -> port, e.g. default_metrics_ports()) turns on every
    service's /metrics; None leaves them off. `tls_dir` (a `tether certs init` folder) gives every service its
    certificate: stage i of any pipeline stage-i's, the coordinators coordinator's, admission admission's.
    `http_port`: admission's OpenAI-compatible HTTP port; None serves gRPC only. (`LocalCluster` builds the same
    commands with the same functions, its internal ports the kernel's.)"""
    stage_ports = stage_ports or [settings.STAGE_BASE_PORT + i for i in range(stages * pipelines)]
    coordinator_ports = coordinator_ports or [coordinator_port + k for k in range(pipelines)]
    extra = extra or {}
    metrics = metrics_ports or {}
    services = []
    for k in range(pipelines):
        route = []
        for i in range(stages):
            port, name = stage_ports[k * stages + i], f"{pipeline_prefix(k)}stage{i}"
            services.append(_service(name, "stage", stage_command(model, host, port, i, stages, threads, pipelines),
                                     host, port, f"stage-{i}", tls_dir, metrics.get(name), extra))
            route.append(f"{host}:{port}")
        name = f"{pipeline_prefix(k)}coordinator"
        services.append(_service(name, "coordinator", coordinator_command(model, host, coordinator_ports[k], route),
                                 host, coordinator_ports[k], "coordinator", tls_dir, metrics.get(name), extra))
    coordinators = [f"{host}:{p}" for p in coordinator_ports]
    services.append(_service("admission", "admission",
                             admission_command(model, host, admission_port, coordinators, http_port),
                             host, admission_port, "admission", tls_dir, metrics.get("admission"), extra))
    if http_port is not None:
        services[-1].http_address, services[-1].http_tls = f"{host}:{http_port}", tls_dir is not None
    return services


class PortConflict(RuntimeError):
    """A child could not bind a port (it exited with ports.EXIT_PORT_IN_USE): the one line a user reads, naming
    the launcher's flag that moves the port. Restarting cannot help."""


# The launcher's flag that moves a port a child could not bind: (role, the child's flag) -> `tether up`'s flag.
LAUNCHER_FLAGS = {("stage", "--port"): "--stage-port", ("coordinator", "--port"): "--coordinator-port",
                  ("admission", "--port"): "--port", ("admission", "--http-port"): "--http-port"}


@dataclass
class LocalCluster:
    """A cluster of child processes on this machine. The internal services (stages, coordinators) listen on
    ports the kernel gives them (`--port 0`), which they report (`--port-file`), and each is started once the
    ones it connects to have reported: no port is picked before it is bound, so none can be taken meanwhile by
    an outgoing connection. The ports a user connects to (admission's gRPC and HTTP, /metrics with `metrics`)
    are fixed when `admission_port` is, and reserved before anything starts: a port in use fails the start at
    once, with one line. `admission_port=0` (the tests): every port the kernel's, reported."""
    model: str = settings.DEFAULT_MODEL
    stages: int = 2
    pipelines: int = 1               # independent pipelines (stages + coordinator each) behind one admission
    host: str = "127.0.0.1"
    admission_port: int = 0          # 0: every port the kernel's (tests); `tether up` passes the public ports
    coordinator_port: int | None = None   # pipeline k's coordinator on this + k; None: the kernel's pick
    stage_port: int | None = None    # stage i (of all pipelines) on stage_port + i; None: the kernel's pick
    threads: int = 0
    log_dir: Path | None = None      # None: children write to this process's stdout/stderr
    metrics: bool = False            # every service serves /metrics: on the kernel's ports when admission_port
                                     # is 0, else on default_metrics_ports()
    extra: dict[str, list[str]] = field(default_factory=dict)
    tls: bool = False                # mutual TLS between services, certificates from tls_dir
    tls_dir: Path | None = None      # a `tether certs init` folder; None with tls: one is made (log_dir/tls or a temp dir)
    http: bool = True                # admission serves the OpenAI-compatible HTTP API (on the kernel's port when
    http_port: int = settings.HTTP_PORT   # admission_port is 0, else on http_port)
    services: list[Service] = field(default_factory=list)
    _reports: Path | None = None     # the folder of the children's --port-file reports

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
        deadline = time.monotonic() + timeout
        self.launch(timeout, supervisor)
        for svc in self.services:
            if svc.name.endswith("coordinator"):
                self.wait_ready(max(1.0, deadline - time.monotonic()), svc.name, supervisor=supervisor)
        self.wait_ready(max(1.0, deadline - time.monotonic()), supervisor=supervisor)
        # Every child's last report (a stage may write it a moment after its coordinator saw it serve): the
        # ports bound after it started serving (/metrics) are known from it
        while not all(s.came_up for s in self.services):
            if time.monotonic() > deadline:
                late = ", ".join(s.name for s in self.services if not s.came_up)
                raise TimeoutError(f"{late} did not report serving in time")
            self._check_children(supervisor)
            time.sleep(0.02)
        return self

    def launch(self, timeout: float = 120.0, supervisor: StartupSupervisor | None = None) -> "LocalCluster":
        """Spawn every child, each once the ones it connects to have bound their ports (stages, then each
        pipeline's coordinator over their reported addresses, then admission); returns once admission has bound
        its ports, without waiting for anything to serve. The public ports are reserved first (PortInUse)."""
        folder = resolve_model(self.model)      # generate a preset once, before children race for it
        if self.tls:
            if self.tls_dir is None:
                self.tls_dir = (self.log_dir / "tls") if self.log_dir is not None else \
                    Path(tempfile.mkdtemp(prefix="tether-tls-"))
            certs.init(self.tls_dir, stages=self.stages)   # the CA and what is missing; existing files are kept
        num_layers = ModelConfig.from_folder(folder).num_hidden_layers
        even_split(num_layers, self.stages)     # fail early with a clear message
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._reports = Path(tempfile.mkdtemp(prefix="tether-ports-", dir=self.log_dir))
        auto = self.admission_port == 0
        n, stages, host, extra = self.pipelines, self.stages, self.host, self.extra
        tls_dir = self.tls_dir if self.tls else None
        metrics = None
        if self.metrics:
            # --metrics-port 0 means off, so not the kernel's pick: free ports below the ephemeral range, where no
            # outgoing connection can take one (free_port)
            metrics = {name: free_port(settings.METRICS_HOST) for name in default_metrics_ports(stages, n)} if auto \
                else default_metrics_ports(stages, n)
        http_port = None if not self.http else 0 if auto else self.http_port
        # What a user connects to is held from now until its service binds it: a second `tether up` on this
        # machine fails here, before a model is loaded.
        held: dict[str, list[socket.socket]] = {}
        try:
            if not auto:
                held["admission"] = [ports.reserve(host, self.admission_port, "--port")]
                if http_port is not None:
                    held["admission"].append(ports.reserve(host, http_port, "--http-port"))
            for name, port in (metrics or {}).items():
                held.setdefault(name, []).append(ports.reserve(
                    settings.METRICS_HOST, port, "--metrics", f"free it, or run without --metrics ({name}'s /metrics)"))
            self.services = []
            deadline = time.monotonic() + timeout
            coordinators = []
            for k in range(n):
                first = len(self.services)
                for i in range(stages):
                    port = 0 if self.stage_port is None else self.stage_port + k * stages + i
                    name = f"{pipeline_prefix(k)}stage{i}"
                    self._spawn_new(_service(name, "stage", stage_command(self.model, host, port, i, stages,
                                                                          self.threads, n),
                                             host, port, f"stage-{i}", tls_dir, (metrics or {}).get(name), extra),
                                    held)
                route = self._bound(self.services[first:], deadline, supervisor)
                port = 0 if self.coordinator_port is None else self.coordinator_port + k
                name = f"{pipeline_prefix(k)}coordinator"
                self._spawn_new(_service(name, "coordinator", coordinator_command(self.model, host, port, route),
                                         host, port, "coordinator", tls_dir, (metrics or {}).get(name), extra), held)
            coordinators = self._bound([s for s in self.services if s.role == "coordinator"], deadline, supervisor)
            admission = _service("admission", "admission",
                                 admission_command(self.model, host, 0 if auto else self.admission_port,
                                                   coordinators, http_port),
                                 host, 0 if auto else self.admission_port, "admission", tls_dir,
                                 (metrics or {}).get("admission"), extra)
            if http_port is not None:
                admission.http_address, admission.http_tls = f"{host}:{http_port}", tls_dir is not None
            self._spawn_new(admission, held)
            self._bound([admission], deadline, supervisor)
        finally:
            for sockets in held.values():
                for sock in sockets:
                    sock.close()
        return self

    def _spawn_new(self, svc: Service, held: dict[str, list[socket.socket]]) -> None:
        """Add `svc` to the cluster with its --port-file and spawn it, its reserved ports released just before."""
        assert self._reports is not None
        svc.port_file = self._reports / f"{svc.name}.json"
        svc.argv += ["--port-file", str(svc.port_file)]
        self.services.append(svc)
        for sock in held.pop(svc.name, []):
            sock.close()
        self.spawn(svc)

    def _bound(self, services: list[Service], deadline: float,
               supervisor: StartupSupervisor | None) -> list[str]:
        """Wait until each of `services` has reported its ports (bound, maybe not serving yet); their addresses."""
        pending = list(services)
        while pending:
            self._check_children(supervisor)
            for svc in list(pending):
                report = svc.report()
                if report is not None and report.error is None and report.ports:
                    svc.pin_ports(report)
                    pending.remove(svc)
            if pending:
                if time.monotonic() > deadline:
                    names = ", ".join(s.name for s in pending)
                    raise TimeoutError(f"{names} did not bind a port in time\n{pending[0].log_tail()}")
                time.sleep(0.02)
        return [svc.address for svc in services]

    def spawn(self, svc: Service) -> None:
        """Start `svc`'s process (again: with the ports it reported, and a fresh report)."""
        if svc.port_file is not None:
            svc.port_file.unlink(missing_ok=True)
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            svc.log_path = self.log_dir / f"{svc.name}.log"
            out = open(svc.log_path, "ab")
        # Bounded OpenMP waits and gRPC's log threshold (settings.SERVICE_ENV), unless the operator set them.
        env = {**settings.SERVICE_ENV, **os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
        try:
            svc.proc = forkserver.spawn(svc.argv, _repo_root(), env, out)
        finally:
            if out is not None:
                out.close()

    def _check_children(self, supervisor: StartupSupervisor | None) -> None:
        """Mark the children that serve as come up; fail the start for one that exited before it came up (or
        after, with no `supervisor` to restart it), and at once, in one line, for one whose port was taken."""
        for s in self.services:
            if s.proc is None:
                continue
            if not s.came_up and s.proc.poll() is None:
                report = s.report()
                if report is not None and report.ready:
                    s.pin_ports(report)   # with the ports bound once it served (/metrics)
                s.came_up = report.ready if report is not None else s.port_file is None and listening(s.address)
            code = s.proc.poll()
            if code is not None and (reason := s.exit_reason(code)) is not None:
                raise PortConflict(reason)
            if code is not None and (supervisor is None or not s.came_up):
                when = "during start-up" if not s.came_up else "after it came up, with nothing to restart it"
                raise RuntimeError(f"{s.name} exited with {code} {when}\n{s.log_tail()}")
        if supervisor is not None:
            supervisor.poll(time.monotonic())

    def wait_ready(self, timeout: float, name: str = "admission",
                   supervisor: StartupSupervisor | None = None) -> None:
        """Block until the service reports SERVING (for admission: a pipeline is up). A child that exits before
        it ever served fails the start (a bad flag, a port taken, a model that does not load: restarting
        would fail the same way); one that had come up is a crash like any later one: `supervisor` restarts it
        (without one, nothing would, so it fails the start too)."""
        svc = self.service(name)
        with self.channel(name) as ch:
            if wait_serving(ch, timeout, before_each=lambda: self._check_children(supervisor)):
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
        if self._reports is not None:
            shutil.rmtree(self._reports, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])
