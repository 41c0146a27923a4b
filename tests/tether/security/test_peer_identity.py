"""The peer's identity comes from exactly one spiffe://tether.local URI SAN of a verified TLS peer."""

from __future__ import annotations

import pytest

from tether.security.identity import Identity, from_auth_context, of_service, parse


@pytest.mark.parametrize("uri, want", [
    ("spiffe://tether.local/coordinator", Identity("coordinator")),
    ("spiffe://tether.local/admission", Identity("admission")),
    ("spiffe://tether.local/operator", Identity("operator")),
    ("spiffe://tether.local/stage/3", Identity("stage", "3")),
    ("spiffe://tether.local/client/alice", Identity("client", "alice")),
    ("spiffe://other.domain/coordinator", None),     # another trust domain
    ("spiffe://tether.local/root", None),             # unknown role
    ("spiffe://tether.local/stage/x", None),          # a stage is named by its index
    ("spiffe://tether.local/stage", None),
    ("spiffe://tether.local/coordinator/extra", None),
    ("https://tether.local/coordinator", None),
])
def test_parse(uri, want):
    assert parse(uri) == want
    if want is not None:
        assert want.uri == uri


def test_certificate_names_map_to_identities():
    assert of_service("stage-2") == Identity("stage", "2")
    assert of_service("client") == Identity("client", "default")
    assert of_service("client-bob") == Identity("client", "bob")
    assert of_service("coordinator") == Identity("coordinator")


def _ssl(*uris: bytes) -> dict:
    return {"transport_security_type": [b"ssl"], "peer_uri": list(uris)}


def test_from_auth_context():
    assert from_auth_context(_ssl(b"spiffe://tether.local/coordinator")) == Identity("coordinator")
    # peer_spiffe_id repeats the same URI: still one identity
    both = {**_ssl(b"spiffe://tether.local/stage/1"), "peer_spiffe_id": [b"spiffe://tether.local/stage/1"]}
    assert from_auth_context(both) == Identity("stage", "1")


@pytest.mark.parametrize("auth", [
    None, {},
    {"transport_security_type": [b"insecure"], "peer_uri": [b"spiffe://tether.local/coordinator"]},
    _ssl(),                                                                       # a certificate without our SAN
    _ssl(b"spiffe://tether.local/coordinator", b"spiffe://tether.local/admission"),   # ambiguous: refuse
    _ssl(b"spiffe://tether.local/nobody"),
])
def test_no_identity(auth):
    assert from_auth_context(auth) is None
