"""A stage knows its position from its own certificate (spiffe://tether.local/stage/<i>), not from what a
handshake claims; and when the handshake peer changes, the Forward streams another peer opened end."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.stage_worker.server import StageServicer
from services.stage_worker.worker import StageWorker
from tether import settings
from tether.model.config import ModelConfig
from tether.model.loader import load_slice, model_fingerprint, resolve_model
from tether.security import certs, tls
from tether.v1 import stage_pb2


@pytest.fixture(scope="module")
def folder():
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    certs.init(d, stages=2)
    return d


class _Context:
    """A call's context as the handler reads it: the peer's verified identity (or none)."""

    def __init__(self, uri: str | None) -> None:
        self.auth = {"transport_security_type": [b"ssl"], "peer_uri": [uri.encode()]} if uri else {}

    def auth_context(self) -> dict:
        return self.auth


class _Relay:
    """An open Forward stream, as the servicer sees it: who opened it, and how it was ended."""

    def __init__(self, opener: str) -> None:
        self.context = _Context(opener)
        self.ended: tuple[grpc.StatusCode, str] | None = None

    async def fail(self, code: grpc.StatusCode, details: str) -> None:
        self.ended = (code, details)


def whole(folder, tls_config=None) -> StageServicer:
    layers = ModelConfig.from_folder(folder).num_hidden_layers
    return StageServicer(StageWorker(load_slice(folder, 0, layers), 0, 1024), model_fingerprint(folder),
                         "127.0.0.1:1", tls=tls_config)


def handshake(folder, index: int = 0, stages: int = 1) -> stage_pb2.HandshakeRequest:
    return stage_pb2.HandshakeRequest(
        protocol_version=settings.PROTOCOL_VERSION, model_fingerprint=model_fingerprint(folder),
        route=[stage_pb2.RouteEntry(address=f"127.0.0.1:{i + 1}") for i in range(stages)], index=index,
        pipeline_epoch=9, dtype="float32", coordinator_instance="c", stamp_key=b"k" * 32)


def test_the_position_is_the_certificates(folder, pki):
    stage = whole(folder, tls.for_service(pki, "stage-1"))
    assert stage.position == 1 and stage.worker.index == 1
    why = stage._refusal(handshake(folder, index=0, stages=2))
    assert why is not None and "stage 1 by its certificate" in why and "position 0" in why


@pytest.mark.parametrize("cert", ["coordinator", "operator", "client"])
def test_a_stage_will_not_start_with_a_certificate_that_is_not_a_stages(folder, pki, cert):
    with pytest.raises(ValueError, match="must name spiffe://tether.local/stage/<i>"):
        whole(folder, tls.for_service(pki, cert))


def test_streams_of_another_peer_end_when_the_handshake_peer_changes(folder, pki):
    stage = whole(folder, tls.for_service(pki, "stage-0"))
    coordinator, other = "spiffe://tether.local/coordinator", "spiffe://tether.local/stage/7"
    ours, theirs = _Relay(coordinator), _Relay(other)
    stage.relays |= {ours, theirs}
    reply = asyncio.run(stage.Handshake(handshake(folder), _Context(coordinator)))
    assert reply.ok, reply.error
    assert stage.handshake_peer is not None and stage.handshake_peer.uri == coordinator
    assert theirs.ended is not None and theirs.ended[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert other in theirs.ended[1] and ours.ended is None
    # the same peer again (a re-handshake of its coordinator): its streams stay
    assert asyncio.run(stage.Handshake(handshake(folder), _Context(coordinator))).ok
    assert ours.ended is None
