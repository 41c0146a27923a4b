"""The SDK over TLS against a real gRPC server on loopback (a stand-in Admission servicer, certificates from
`tether certs init`): the server is verified against tls_ca, a client certificate is presented when given,
the API key travels in the authorization metadata, and a plaintext client cannot talk to a TLS port."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from tether.client import AsyncClient, Client, TetherError
from tether.security import certs
from tether.security.tls import for_service
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2


class EchoAuth(admission_pb2_grpc.AdmissionServicer):
    """Tag answers with the caller's authorization metadata as its tenant tag, and records it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def Tag(self, request, context):
        auth = dict(context.invocation_metadata()).get("authorization", "")
        self.seen.append(auth)
        return admission_pb2.TagResponse(tags=common_pb2.IntentTags(tenant=auth))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    certs.init(d, stages=1)
    return d


def serve(folder, require_client_auth: bool):
    servicer = EchoAuth()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    admission_pb2_grpc.add_AdmissionServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0",
                                  for_service(folder, "admission", require_client_auth).server_credentials())
    server.start()
    return server, servicer, f"127.0.0.1:{port}"


def test_tls_with_a_key(folder, monkeypatch):
    monkeypatch.delenv("TETHER_API_KEY", raising=False)
    server, servicer, target = serve(folder, require_client_auth=False)
    try:
        with Client(target, timeout=10, retry=None, api_key="tk_over-tls", tls_ca=str(folder / "ca.pem")) as c:
            assert c.tag("hi")["tenant"] == "Bearer tk_over-tls"
        monkeypatch.setenv("TETHER_TLS_CA", str(folder / "ca.pem"))      # the environment's CA
        monkeypatch.setenv("TETHER_API_KEY", "tk_from-env")

        async def aio() -> str:
            async with AsyncClient(target, timeout=10, retry=None) as c:
                return (await c.tag("hi"))["tenant"]
        assert asyncio.run(aio()) == "Bearer tk_from-env"
        monkeypatch.delenv("TETHER_TLS_CA")
        with Client(target, timeout=5, retry=None, api_key="tk_k") as plain:   # plaintext to a TLS port
            with pytest.raises(TetherError) as info:
                plain.tag("hi")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
    assert servicer.seen == ["Bearer tk_over-tls", "Bearer tk_from-env"]


def test_mutual_tls_presents_the_client_certificate(folder):
    server, servicer, target = serve(folder, require_client_auth=True)
    try:
        with Client(target, timeout=10, retry=None, api_key="tk_m", tls_ca=str(folder / "ca.pem"),
                    tls_cert=str(folder / "client.pem"), tls_key=str(folder / "client.key")) as c:
            assert c.tag("hi")["tenant"] == "Bearer tk_m"
        with Client(target, timeout=5, retry=None, tls_ca=str(folder / "ca.pem")) as no_cert:
            with pytest.raises(TetherError) as info:
                no_cert.tag("hi")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
