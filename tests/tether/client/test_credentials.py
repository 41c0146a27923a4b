"""The SDK's credentials (tether/client/credentials.py): the API key and TLS files from parameters or the
environment, the metadata every call carries, and the warning before a key leaves in plaintext."""

import warnings

import grpc
import pytest

from tether.client import credentials
from tether.client.credentials import Connection, call_metadata, is_loopback, resolve


def test_the_key_comes_from_the_parameter_else_the_environment():
    assert resolve(environ={}).api_key is None
    assert resolve(environ={"TETHER_API_KEY": "tk_env"}).api_key == "tk_env"
    assert resolve("tk_param", environ={"TETHER_API_KEY": "tk_env"}).api_key == "tk_param"
    assert resolve(environ={"TETHER_API_KEY": ""}).api_key is None          # empty: unset
    with pytest.raises(ValueError, match="one word"):
        resolve("tk a", environ={})


def test_every_call_carries_the_key_and_the_trace_context():
    conn = resolve("tk_secret", environ={})
    assert call_metadata(conn, None) == (("authorization", "Bearer tk_secret"),)
    assert call_metadata(conn, (("traceparent", "00-x"),)) == (("authorization", "Bearer tk_secret"),
                                                                 ("traceparent", "00-x"))
    assert call_metadata(Connection(), None) is None
    assert "tk_secret" not in repr(conn)


def test_tls_is_on_when_a_file_is_given_or_asked_for():
    assert not resolve(environ={}).tls
    on = resolve(environ={"TETHER_TLS_CA": "/ca.pem"})
    assert on.tls and on.tls_ca == "/ca.pem" and on.tls_cert is None
    assert resolve(tls=True, environ={}).tls                                 # the system's roots
    assert not resolve(tls=False, environ={"TETHER_TLS_CA": "/ca.pem"}).tls
    both = resolve(tls_cert="/c.pem", tls_key="/c.key", environ={"TETHER_TLS_CA": "/ca.pem"})
    assert (both.tls_ca, both.tls_cert, both.tls_key) == ("/ca.pem", "/c.pem", "/c.key")
    with pytest.raises(ValueError, match="needs its key"):
        resolve(tls_cert="/c.pem", environ={})


def test_credentials_from_missing_files_are_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="TLS"):
        credentials.channel_credentials(resolve(tls_ca=tmp_path / "missing.pem", environ={}))


@pytest.mark.parametrize("target,local", [
    ("127.0.0.1:50051", True), ("localhost:50051", True), ("[::1]:50051", True), ("127.3.2.1:1", True),
    ("ipv4:127.0.0.1:50051", True), ("dns:///localhost:50051", True), ("unix:/tmp/s", True), ("::1", True),
    ("10.0.0.5:50051", False), ("admission.example.com:443", False), ("dns:///tether-admission:50051", False),
    ("[2001:db8::1]:50051", False),
])
def test_loopback_targets(target, local):
    assert is_loopback(target) == local


def test_a_key_sent_in_plaintext_off_this_host_warns_once(monkeypatch):
    monkeypatch.setattr(credentials, "_warned_plaintext", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        credentials.warn_if_exposed("127.0.0.1:50051", resolve("tk_k", environ={}))      # loopback: fine
        credentials.warn_if_exposed("10.0.0.5:50051", resolve(environ={}))               # no key: fine
        credentials.warn_if_exposed("10.0.0.5:50051", resolve("tk_k", tls=True, environ={}))   # TLS: fine
        assert not seen
        credentials.warn_if_exposed("10.0.0.5:50051", resolve("tk_k", environ={}))
        credentials.warn_if_exposed("10.0.0.6:50051", resolve("tk_k", environ={}))
    assert len(seen) == 1 and "without TLS to 10.0.0.5:50051" in str(seen[0].message)
    assert "tk_k" not in str(seen[0].message)


def test_clients_open_tls_channels(tmp_path):
    from tether.client import AsyncClient, Client
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"")   # never read by a handshake here: the channel is lazy
    with Client("127.0.0.1:1", api_key="tk_k", tls_ca=str(ca)) as c:
        assert isinstance(c._channel, grpc.Channel) and c._conn.tls
    import asyncio

    async def aio() -> None:
        async with AsyncClient("127.0.0.1:1", api_key="tk_k", tls=True) as c:
            assert c._conn.tls and c._metadata()[0] == ("authorization", "Bearer tk_k")
    asyncio.run(aio())
