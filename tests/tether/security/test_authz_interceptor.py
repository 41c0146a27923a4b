"""The interceptor in a real gRPC server over mutual TLS: identities from real certificates, refusals with
PERMISSION_DENIED before the handler runs, counted; allowed calls (unary and streaming) reach the handler."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tether import grpcutil
from tether.security import authz, certs, identity, tls
from tether.security.identity import Identity, of_peer
from tether.v1 import stage_pb2, stage_pb2_grpc


class Stage(stage_pb2_grpc.StageServicer):
    def __init__(self, position: int) -> None:
        self.position = position   # as the stage's certificate names it (the real servicer reads its own)
        self.handshake_peer = None
        self.released: list[str] = []

    async def Handshake(self, request, context):
        self.handshake_peer = of_peer(context)
        return stage_pb2.HandshakeReply(ok=True)

    async def Release(self, request, context):
        self.released.extend(request.request_ids)
        return stage_pb2.ReleaseReply(released=len(request.request_ids))

    async def Forward(self, request_iterator, context):   # writes its replies (the real stage's shape)
        async for frame in request_iterator:
            await context.write(stage_pb2.FrameReply(stream_seq=frame.stream_seq))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    certs.init(folder, stages=2)
    return folder


def test_policy_enforced_over_mutual_tls(pki):
    async def run():
        refusals = []
        guard = authz.AuthzInterceptor(on_refusal=lambda m, why: refusals.append(m))
        server = grpcutil.Server("127.0.0.1", 0, ["tether.v1.Stage"], tls=tls.for_service(pki, "stage-1"),
                                 interceptors=[guard])
        servicer = Stage(position=1)
        guard.state = servicer
        stage_pb2_grpc.add_StageServicer_to_server(servicer, server.server)
        await server.start()
        target = f"127.0.0.1:{server.port}"

        def stub(name):
            return stage_pb2_grpc.StageStub(grpcutil.channel(target, tls=tls.for_service(pki, name),
                                                             expect=identity.stage(1)))
        try:
            # relayed handshake from the stage before it: allowed, and the handler sees who sent it
            assert (await stub("stage-0").Handshake(stage_pb2.HandshakeRequest(index=1), timeout=5)).ok
            assert servicer.handshake_peer == Identity("stage", "0")
            # the coordinator may not relay; admission may not handshake at all; nor another stage; nothing changed
            for name, index in (("coordinator", 1), ("admission", 0), ("client", 0), ("stage-1", 1)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub(name).Handshake(stage_pb2.HandshakeRequest(index=index), timeout=5)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert servicer.handshake_peer == Identity("stage", "0")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub("admission").Release(stage_pb2.ReleaseRequest(request_ids=["r"]), timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "may not call Release" in e.value.details()
            assert servicer.released == []
            assert (await stub("coordinator").Release(stage_pb2.ReleaseRequest(request_ids=["r"]), timeout=5)).released == 1
            # Forward: from the handshake's peer only (a bidirectional stream, replies written by the handler)
            call = stub("stage-0").Forward(iter([stage_pb2.Frame(stream_seq=1), stage_pb2.Frame(stream_seq=2)]))
            assert [r.stream_seq async for r in call] == [1, 2]
            # the refusal comes before any frame is read; a client still writing a frame when it lands may see
            # its write fail (INTERNAL from grpc's core) instead of the status, so this caller writes none
            denied = stub("coordinator").Forward()
            assert await denied.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "spiffe://tether.local/stage/0" in await denied.details()
            assert len(refusals) == 6 and sum(guard.refused.values()) == 6
        finally:
            await server.server.stop(0)
    asyncio.run(run())


def test_no_client_certificate_no_connection(pki):
    async def run():
        server = grpcutil.Server("127.0.0.1", 0, ["tether.v1.Stage"], tls=tls.for_service(pki, "stage-0"),
                                 interceptors=[authz.AuthzInterceptor()])
        stage_pb2_grpc.add_StageServicer_to_server(Stage(position=0), server.server)
        await server.start()
        try:
            creds = tls.client_channel_credentials(pki / "ca.pem")   # verifies the server, presents nothing
            async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", creds) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stage_pb2_grpc.StageStub(ch).Handshake(stage_pb2.HandshakeRequest(), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.server.stop(0)
    asyncio.run(run())
