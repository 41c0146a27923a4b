"""From the attacker's side: a peer holding some certificate of the cluster's CA takes the address where a
service should be (DNS inside a cluster, the port during a restart) and waits for what the others send it.

Real processes with their own TLS files from `tether certs init`: a coordinator whose route's stage 0 is an
impostor Stage server, and admission whose coordinator is an impostor. Whatever certificate the impostor holds
(a tenant's `client`, `operator`, another stage's, admission's), it is never sent a single call (no
HandshakeRequest, hence no stamp key and no prompt): the caller refuses it at TLS, says so in its status and
log, counts it in tether:server_identity_refusals_total, and stays down.
"""

from __future__ import annotations

import http.client
import sys
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tether.cli.cluster import LocalCluster, Service, free_port
from tether.security import certs, tls
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc

HOST = "127.0.0.1"


class Recorder(grpc.GenericRpcHandler):
    """Answers nothing, records the method of every call that reaches it (an impostor's harvest)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def service(self, handler_call_details):
        self.calls.append(handler_call_details.method)
        return None   # UNIMPLEMENTED to the caller: the call was received all the same


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    certs.init(folder, stages=2)
    return folder


def impostor(pki, cert: str) -> tuple[grpc.Server, Recorder, str]:
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[recorder])
    creds = tls.for_service(pki, cert).server_credentials()   # mutual TLS, like a real service
    port = server.add_secure_port(f"{HOST}:0", creds)
    server.start()
    return server, recorder, f"{HOST}:{port}"


def spawn(pki, log_dir, name: str, module: str, flags: list[str], cert: str) -> tuple[LocalCluster, Service]:
    port, metrics_port = free_port(HOST), free_port(HOST)
    svc = Service(name, [sys.executable, "-m", module, "--host", HOST, "--port", str(port), "--model", "tiny",
                         "--metrics-port", str(metrics_port), *flags, *tls.service_flags(pki, cert)],
                  f"{HOST}:{port}", metrics_address=f"{HOST}:{metrics_port}")
    cluster = LocalCluster(model="tiny", log_dir=log_dir, tls=True, tls_dir=pki, services=[svc])
    cluster.spawn(svc)
    return cluster, svc


def refusals(svc: Service, expected: str) -> float:
    """tether:server_identity_refusals_total{expected} on the service's /metrics (0 while it is not up yet)."""
    try:
        with urllib.request.urlopen(svc.metrics_url, timeout=5) as r:
            text = r.read().decode()
    except (OSError, http.client.HTTPException):   # not listening yet, or busy (the bounded /metrics server)
        return 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tether:server_identity_refusals_total" and s.labels.get("expected") == expected:
                return s.value
    return 0.0


def wait_for(what, timeout_s: float, svc: Service):
    """Poll `what()` until it is truthy (the service must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        assert svc.proc.poll() is None, f"{svc.name} exited\n{svc.log_tail()}"
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s\n{svc.log_tail()}")


@pytest.mark.parametrize("cert", ["client", "operator", "stage-1"])
def test_an_impostor_stage_0_never_receives_a_handshake(pki, tmp_path, cert):
    server, recorder, address = impostor(pki, cert)
    cluster, coordinator = spawn(pki, tmp_path, "coordinator", "services.coordinator", ["--stages", address],
                                 "coordinator")
    try:
        expected = "spiffe://tether.local/stage/0"
        # until the coordinator counts a refusal, or the impostor got a call (the hole: it would get handshakes)
        wait_for(lambda: recorder.calls or refusals(coordinator, expected) >= 1, 90, coordinator)
        assert recorder.calls == [], "the impostor was sent calls"
        with cluster.channel("coordinator", cert="operator") as ch:
            stats = coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=10)
        assert not stats.serving
        assert f"refused the server at {address} as stage 0" in stats.status, stats.status
        assert "SERVER IDENTITY: refused the server at" in coordinator.log_path.read_text()
        # it keeps refusing (the pipeline stays down), and still nothing reaches the impostor
        wait_for(lambda: refusals(coordinator, expected) >= 2, 30, coordinator)
        assert recorder.calls == []
    finally:
        cluster.stop()
        server.stop(0)


@pytest.mark.parametrize("cert", ["client", "stage-0"])
def test_an_impostor_coordinator_never_receives_a_call_from_admission(pki, tmp_path, cert):
    server, recorder, address = impostor(pki, cert)
    cluster, admission = spawn(pki, tmp_path, "admission", "services.admission", ["--coordinator", address, "--no-http"],
                               "admission")
    try:
        wait_for(lambda: recorder.calls or refusals(admission, "spiffe://tether.local/coordinator") >= 1, 90,
                 admission)
        assert recorder.calls == [], "the impostor was sent calls"
        assert "SERVER IDENTITY: refused the server at" in admission.log_path.read_text()
    finally:
        cluster.stop()
        server.stop(0)
