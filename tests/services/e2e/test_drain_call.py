"""`tether drain`: a real coordinator (tiny model, one stage, mutual TLS as deployed) drained by the command, as an
operator would run it. The same drain SIGTERM starts (services/coordinator/drain.py): its load report and Stats
say draining, a new Submit is refused with UNAVAILABLE, asking again is harmless, and the process stays up
until a call asks it to exit. A client certificate may not drain, and an address with nobody there is an error
that says so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tether import reference
from tether.cli.cluster import LocalCluster, free_port
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.helpers import started

ROOT = Path(__file__).resolve().parents[3]


def tether_drain(*args: str) -> subprocess.CompletedProcess:
    """The command, in its own process (`python -m tether.cli.main drain ...`, what the k8s image would run)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tether.cli.main", "drain", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    with started(tmp_path_factory, stages=1, tls=True) as c:
        yield c


def _stats(cluster: LocalCluster) -> coordinator_pb2.StatsReply:
    with cluster.channel("coordinator", cert="operator") as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=30)


def _first_load_report(cluster: LocalCluster) -> coordinator_pb2.LoadReport:
    with cluster.channel("coordinator", cert="admission") as ch:
        stream = coordinator_pb2_grpc.CoordinatorStub(ch).Watch(coordinator_pb2.WatchRequest(), timeout=30)
        report = next(stream)
        stream.cancel()
        return report


def _submit(cluster: LocalCluster, request_id: str) -> list[coordinator_pb2.TokenEvent]:
    """A Submit as admission sends one (its certificate), read to the end."""
    req = coordinator_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=[72, 105],
                                        sampling=reference.sampling_params(max_tokens=3))
    with cluster.channel("coordinator", cert="admission") as ch:
        return list(coordinator_pb2_grpc.CoordinatorStub(ch).Submit(req, timeout=60))


def test_a_client_certificate_may_not_drain(secure, tmp_path):
    # a folder whose "operator" is the tenant's client certificate: what a client holding it could try
    shutil.copy(secure.tls_dir / "ca.pem", tmp_path / "ca.pem")
    shutil.copy(secure.tls_dir / "client.pem", tmp_path / "operator.pem")
    shutil.copy(secure.tls_dir / "client.key", tmp_path / "operator.key")
    address = secure.service("coordinator").address
    out = tether_drain("--coordinator", address, "--tls-dir", str(tmp_path))
    assert out.returncode == 1, out
    assert "refused the drain" in out.stderr and "PERMISSION_DENIED" in out.stderr, out.stderr
    stats = _stats(secure)
    assert not stats.draining and stats.serving


def test_tether_drain_takes_the_coordinator_out_of_service_and_exits_only_when_asked(secure):
    address, proc = secure.service("coordinator").address, secure.service("coordinator").proc
    assert proc is not None
    assert _submit(secure, "before")[-1].finish_reason   # it serves until told to drain
    assert not _first_load_report(secure).draining

    out = tether_drain("--coordinator", address, "--tls-dir", str(secure.tls_dir), "--drain-seconds", "1")
    assert out.returncode == 0, out
    assert "drain started" in out.stdout, out.stdout

    report = _first_load_report(secure)
    assert report.draining and not report.serving and report.status == "draining"
    stats = _stats(secure)
    assert stats.draining and not stats.serving and stats.status == "draining"
    with pytest.raises(grpc.RpcError) as refused:
        _submit(secure, "after")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()

    again = tether_drain("--coordinator", address, "--tls-dir", str(secure.tls_dir))   # idempotent
    assert again.returncode == 0 and "already draining" in again.stdout, again
    assert proc.poll() is None, "a drain by call leaves the process up unless asked to exit"
    assert _stats(secure).draining

    last = tether_drain("--coordinator", address, "--tls-dir", str(secure.tls_dir), "--exit")
    assert last.returncode == 0 and "then it exits" in last.stdout, last
    assert proc.wait(30) == 0   # stopped as SIGTERM stops it


def test_nobody_there_is_an_error_that_says_so():
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    out = tether_drain("--coordinator", address, "--timeout", "5")
    assert out.returncode == 1
    assert f"cannot reach a coordinator at {address}" in out.stderr, out.stderr


def test_a_deadline_out_of_range_is_a_usage_error():
    out = tether_drain("--coordinator", "127.0.0.1:1", "--drain-seconds", "-1")
    assert out.returncode == 2 and "--drain-seconds must be 0 to" in out.stderr, out.stderr
