"""A refused handshake does not tell an unauthenticated peer the stage's model fingerprint (the value it would
need to send a valid one); an authenticated coordinator or stage still learns it (to say what is wrong)."""

from __future__ import annotations

import asyncio

import pytest

from services.stage_worker.server import StageServicer
from services.stage_worker.worker import StageWorker
from tether import settings
from tether.model.loader import load_slice, model_fingerprint, resolve_model
from tether.v1 import stage_pb2


class _Context:
    """What the handler reads of a call's context: the peer's auth context."""

    def __init__(self, auth: dict) -> None:
        self.auth = auth

    def auth_context(self) -> dict:
        return self.auth


@pytest.fixture(scope="module")
def stage():
    folder = resolve_model("tiny")
    return StageServicer(StageWorker(load_slice(folder, 0, 2), 0, 1024), model_fingerprint(folder), "127.0.0.1:1")


def _refused(stage, context):
    wrong = stage_pb2.HandshakeRequest(protocol_version=settings.PROTOCOL_VERSION, model_fingerprint="f" * 16,
                                       route=[stage_pb2.RouteEntry(address="127.0.0.1:1")], index=0)
    reply = asyncio.run(stage.Handshake(wrong, context))
    assert not reply.ok and "fingerprints differ" in reply.error
    return reply


@pytest.mark.parametrize("context", [None, _Context({}),
                                     _Context({"transport_security_type": [b"ssl"], "peer_uri": [b"https://x"]})])
def test_an_unauthenticated_peer_does_not_learn_the_fingerprint(stage, context):
    reply = _refused(stage, context)
    assert stage.fingerprint not in reply.error and stage.fingerprint not in str(reply)
    assert reply.stages[0].model_fingerprint == "" and reply.stages[0].layer_end == 2   # the rest is still said


def test_an_authenticated_coordinator_does(stage):
    ctx = _Context({"transport_security_type": [b"ssl"], "peer_uri": [b"spiffe://tether.local/coordinator"]})
    assert _refused(stage, ctx).stages[0].model_fingerprint == stage.fingerprint
