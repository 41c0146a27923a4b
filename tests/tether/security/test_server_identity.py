"""A channel between services talks to the identity it expects and to nobody else: real TLS servers holding
each certificate of a `tether certs init` CA, a channel expecting stage/0 (what the coordinator opens to route
position 0). Only stage-0's certificate is served to; every other one is refused by TLS before a call is sent,
and server_check says who answered instead (counted)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tether import grpcutil
from tether.security import certs, identity, server_check, tls
from tether.security.server_check import Presented, explain
from tether.v1 import stage_pb2, stage_pb2_grpc


class Recording(stage_pb2_grpc.StageServicer):
    """A Stage server that records every handshake it receives (what an impostor would harvest)."""

    def __init__(self) -> None:
        self.handshakes: list[stage_pb2.HandshakeRequest] = []

    async def Handshake(self, request, context):
        self.handshakes.append(request)
        return stage_pb2.HandshakeReply(ok=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    certs.init(folder, stages=2)
    return folder


async def _handshake_as_coordinator(pki, server_cert: str) -> tuple[grpc.StatusCode | None, list, str | None]:
    servicer = Recording()
    server = grpcutil.Server("127.0.0.1", 0, ["tether.v1.Stage"], tls=tls.for_service(pki, server_cert))
    stage_pb2_grpc.add_StageServicer_to_server(servicer, server.server)
    await server.start()
    address = f"127.0.0.1:{server.port}"
    coordinator = tls.for_service(pki, "coordinator")
    try:
        async with grpcutil.channel(address, tls=coordinator, expect=identity.stage(0)) as ch:
            try:
                await stage_pb2_grpc.StageStub(ch).Handshake(stage_pb2.HandshakeRequest(stamp_key=b"k" * 32), timeout=5)
                code = None
            except grpc.aio.AioRpcError as e:
                code = e.code()
        why = await server_check.refusal(address, coordinator, identity.stage(0))
        return code, servicer.handshakes, why
    finally:
        await server.server.stop(0)


def test_the_expected_stage_is_served_to(pki):
    code, handshakes, why = asyncio.run(_handshake_as_coordinator(pki, "stage-0"))
    assert code is None and len(handshakes) == 1 and why is None


@pytest.mark.parametrize("cert,presents", [
    ("client", "not for serving|client/default"),       # clientAuth only: TLS refuses it as a server
    ("operator", "operator"),
    ("stage-1", "spiffe://tether.local/stage/1, not spiffe://tether.local/stage/0"),
    ("admission", "spiffe://tether.local/admission, not"),
    ("coordinator", "spiffe://tether.local/coordinator, not"),
])
def test_any_other_certificate_of_the_ca_is_refused_before_a_call_and_named(pki, cert, presents):
    before = server_check.REFUSED["spiffe://tether.local/stage/0"]
    code, handshakes, why = asyncio.run(_handshake_as_coordinator(pki, cert))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert handshakes == []                                  # never sent the stamp key
    assert why is not None and any(p in why for p in presents.split("|")), why
    assert server_check.REFUSED["spiffe://tether.local/stage/0"] == before + 1


def test_a_tls_channel_must_say_whom_it_expects(pki):
    with pytest.raises(ValueError, match="which service identity it expects"):
        grpcutil.channel("127.0.0.1:1", tls=tls.for_service(pki, "coordinator"))


def test_explain_decides_on_every_property():
    stage0 = identity.stage(0)
    right = Presented(stage0, (stage0.server_name, "localhost"), server_auth=True, from_our_ca=True)
    assert explain(stage0, right) is None and explain(stage0, None) is None
    assert "not signed by our CA" in explain(stage0, Presented(stage0, right.dns_names, True, False))
    assert "presents no spiffe" in explain(stage0, Presented(None, ("localhost",), True, True))
    assert "presents spiffe://tether.local/client/default" in explain(
        stage0, Presented(identity.Identity("client", "default"), (), False, True))
    assert "no serverAuth" in explain(stage0, Presented(stage0, right.dns_names, False, True))
    assert "lacks the server name stage-0.id.tether.local" in explain(stage0, Presented(stage0, ("localhost",), True, True))
