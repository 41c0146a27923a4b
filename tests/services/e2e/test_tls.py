"""A cluster with `tls=True` (what `tether up --tls` runs): mutual TLS between services from `tether certs init`
certificates, TLS on the public port, who-may-call-what enforced on the internal services, and an API key
required at the front door (issue 14 end to end: every layer on at once).

It serves exactly what a plaintext cluster does (the reference's tokens); a caller without a certificate of the
cluster's CA cannot even connect to a stage; other services' certificates get PERMISSION_DENIED (counted) and
change nothing. One cluster for the module: tiny model, two stages, few tokens.
"""

from __future__ import annotations

import grpc
import pytest

from services.admission.auth import key_digest
from tether import reference, settings
from tether.cli import healthcheck
from tether.cli.cluster import LocalCluster
from tether.model.loader import model_fingerprint, resolve_model
from tether.security import certs, tls
from tether.v1 import admission_pb2, admission_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.helpers import started

CASES = [dict(prompt="Explain in under 30 words why the sky is blue.", max_tokens=8),
         dict(prompt="请用不超过50字向老人解释血糖仪读数", max_tokens=6, temperature=0.8, top_p=0.9, seed=7)]


KEY = "tk_test-" + "k" * 40
BEARER = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    tenants = logs / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\napi_keys_sha256 = ["{key_digest(KEY)}"]\n')
    with started(tmp_path_factory, log_dir=logs, tls=True, extra={"admission": ["--tenants", str(tenants)]}) as c:
        yield c


def _generate(cluster: LocalCluster, case: dict, metadata=BEARER) -> admission_pb2.GenerateResponse:
    """Through the public port over TLS, verifying it with the cluster's CA and presenting no certificate, with
    the tenant's API key."""
    params = {k: v for k, v in case.items() if k != "prompt"}
    with cluster.channel("admission", cert=None) as ch:
        return admission_pb2_grpc.AdmissionStub(ch).Generate(admission_pb2.GenerateRequest(
            prompt=case["prompt"].encode(), sampling=reference.sampling_params(**params)), timeout=120,
            metadata=metadata)


def _assert_serves_the_reference(cluster: LocalCluster) -> None:
    for case in CASES:
        got = _generate(cluster, case)
        want = reference.generate(case["prompt"], "tiny", namespace="acme",   # the key's tenant salts the chain
                                  **{k: v for k, v in case.items() if k != "prompt"})
        assert list(got.token_ids) == want.token_ids and got.text == want.text, case
        assert got.receipt.context_hash == want.receipt.context_hash


def _refusals(cluster: LocalCluster, name: str) -> int:
    """PERMISSION_DENIED refusals in the stage's Stats, asked with the operator certificate."""
    with cluster.channel(name, cert="operator") as ch:
        stats = stage_pb2_grpc.StageStub(ch).Stats(stage_pb2.StageStatsRequest(), timeout=10)
    return stats.refusals["PERMISSION_DENIED"]


def _epoch(cluster: LocalCluster) -> int:
    with cluster.channel("coordinator", cert="operator") as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=10).pipeline_epoch


def test_a_tls_cluster_serves_exactly_the_reference(secure):
    _assert_serves_the_reference(secure)


def test_over_tls_the_front_door_still_wants_the_key(secure):
    for metadata in ((), (("authorization", "Bearer tk_not-a-key"),)):
        with pytest.raises(grpc.RpcError) as e:
            _generate(secure, CASES[0], metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata


def test_a_plaintext_caller_cannot_reach_a_stage(secure):
    address = secure.service("stage0").address
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            stage_pb2_grpc.StageStub(ch).Handshake(stage_pb2.HandshakeRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_without_a_key_cannot_handshake(secure, tmp_path):
    """A forged handshake: a 'coordinator' certificate from another CA (a process without the cluster CA's key)
    cannot complete TLS with a stage, and the pipeline keeps its epoch and keeps serving."""
    before = _epoch(secure)
    certs.init(tmp_path, stages=1)      # the same identities, signed by a CA the cluster does not trust
    forged = grpc.ssl_channel_credentials((secure.tls_dir / "ca.pem").read_bytes(),
                                          (tmp_path / "coordinator.key").read_bytes(),
                                          (tmp_path / "coordinator.pem").read_bytes())
    for name in ("stage0", "stage1"):
        with grpc.secure_channel(secure.service(name).address, forged) as ch:
            with pytest.raises(grpc.RpcError) as e:
                stage_pb2_grpc.StageStub(ch).Handshake(stage_pb2.HandshakeRequest(index=0), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # no client certificate at all (verifying the stage with the right CA): no connection either
    with grpc.secure_channel(secure.service("stage0").address,
                             tls.client_channel_credentials(secure.tls_dir / "ca.pem")) as ch:
        with pytest.raises(grpc.RpcError) as e:
            stage_pb2_grpc.StageStub(ch).Handshake(stage_pb2.HandshakeRequest(index=0), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _epoch(secure) == before
    _assert_serves_the_reference(secure)


@pytest.mark.parametrize("cert", ["admission", "client"])
def test_other_services_certificates_are_refused_and_counted(secure, cert):
    before = _refusals(secure, "stage0"), _epoch(secure)
    with secure.channel("stage0", cert=cert) as ch:
        stub = stage_pb2_grpc.StageStub(ch)
        calls = [lambda: stub.Handshake(stage_pb2.HandshakeRequest(index=0), timeout=5),
                 lambda: stub.Release(stage_pb2.ReleaseRequest(request_ids=["x"]), timeout=5),
                 lambda: stub.SyncState(stage_pb2.SyncRequest(request_ids=["x"]), timeout=5),
                 lambda: stub.Stats(stage_pb2.StageStatsRequest(), timeout=5)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"spiffe://tether.local/{'client/default' if cert == 'client' else cert} may not call" in e.value.details()
    assert _refusals(secure, "stage0") == before[0] + len(calls)
    assert _epoch(secure) == before[1]
    _assert_serves_the_reference(secure)


def test_only_admission_submits_to_the_coordinator(secure):
    with secure.channel("coordinator", cert="stage-0") as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Submit(coordinator_pb2.SubmitRequest(request_id="intruder", prompt_token_ids=[1]), timeout=5))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:
            stub.Cancel(coordinator_pb2.CancelRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_probes_use_the_services_own_certificate(secure):
    d = secure.tls_dir
    for name, cert in (("stage1", "stage-1"), ("coordinator", "coordinator"), ("admission", "admission")):
        ok, seen = healthcheck.check(secure.service(name).address, tls_ca=str(d / "ca.pem"),
                                     tls_cert=str(d / f"{cert}.pem"), tls_key=str(d / f"{cert}.key"))
        assert ok, (name, seen)
    ok, seen = healthcheck.check(secure.service("stage1").address)   # plaintext against a TLS port
    assert not ok
    # the command line, configured from the environment as in a container
    assert healthcheck.main([secure.service("coordinator").address, "-q", "--tls-ca", str(d / "ca.pem"),
                             "--tls-cert", str(d / "coordinator.pem"), "--tls-key", str(d / "coordinator.key")]) == 0


def _handshake(cluster: LocalCluster, to: str, cert: str, index: int, route: list[str]) -> stage_pb2.HandshakeReply:
    """A well-formed handshake (the right fingerprint, a stamp key of the sender's) claiming `index`."""
    req = stage_pb2.HandshakeRequest(
        protocol_version=settings.PROTOCOL_VERSION, model_fingerprint=model_fingerprint(resolve_model("tiny")),
        route=[stage_pb2.RouteEntry(address=a) for a in route], index=index, prev_layer_end=0,
        pipeline_epoch=12345, coordinator_instance="takeover", stamp_key=b"s" * 32)
    with cluster.channel(to, cert=cert) as ch:
        return stage_pb2_grpc.StageStub(ch).Handshake(req, timeout=10)


def test_a_stage_certificate_cannot_take_stage_0_over_with_a_claimed_index(secure):
    """The takeover: the stage-1 certificate sends stage 0 Handshake(index=1, route=[x, stage0, stage1]). Stage 0
    knows it is stage 0 from its own certificate, so only the coordinator may handshake it: refused, counted,
    its key and requests untouched, the pipeline keeps its epoch and serves."""
    before = _refusals(secure, "stage0"), _epoch(secure)
    s0, s1 = secure.service("stage0").address, secure.service("stage1").address
    for cert, index, route in (("stage-1", 1, ["127.0.0.1:1", s0, s1]), ("stage-1", 0, [s0, s1]),
                               ("stage-0", 0, [s0, s1])):
        with pytest.raises(grpc.RpcError) as e:
            _handshake(secure, "stage0", cert, index, route)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (cert, index)
        assert "only the coordinator may handshake stage 0" in e.value.details()
    assert _refusals(secure, "stage0") == before[0] + 3
    assert _epoch(secure) == before[1]
    _assert_serves_the_reference(secure)


def test_stage_1_takes_a_handshake_only_from_stage_0_and_only_for_its_own_position(secure):
    before = _epoch(secure)
    s0, s1 = secure.service("stage0").address, secure.service("stage1").address
    for cert in ("coordinator", "stage-1"):
        with pytest.raises(grpc.RpcError) as e:
            _handshake(secure, "stage1", cert, 1, [s0, s1])
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "only spiffe://tether.local/stage/0 may relay a handshake to stage 1" in e.value.details()
    # stage 0's own certificate, telling stage 1 it is at position 0: refused by the handler, nothing changes
    reply = _handshake(secure, "stage1", "stage-0", 0, [s1, s0])
    assert not reply.ok and "stage 1 by its certificate" in reply.error
    assert _epoch(secure) == before
    _assert_serves_the_reference(secure)
