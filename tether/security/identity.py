"""Who a peer is: the `spiffe://tether.local/...` URI SAN of the client certificate it presented.

Identities: spiffe://tether.local/admission, /coordinator, /operator, /stage/<i>, /client/<name>. The CA that
signed the certificate is the only thing that vouches for them, so only a peer whose certificate chain was
verified against --tls-ca (mutual TLS) has an identity; a plaintext peer has none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tether import settings

PREFIX = f"spiffe://{settings.TLS_TRUST_DOMAIN}/"
ROLES = ("admission", "coordinator", "operator", "stage", "client")
NAMED_ROLES = ("stage", "client")   # these carry a name: the stage's index, the client's name


@dataclass(frozen=True)
class Identity:
    role: str        # one of ROLES
    name: str = ""   # the stage's index or the client's name; "" for the others

    @property
    def uri(self) -> str:
        return f"{PREFIX}{self.role}/{self.name}" if self.name else f"{PREFIX}{self.role}"

    def __str__(self) -> str:
        return self.uri


def parse(uri: str) -> Identity | None:
    """The identity a URI SAN names, or None when it is not one of ours (wrong trust domain, unknown role)."""
    if not uri.startswith(PREFIX):
        return None
    parts = uri[len(PREFIX):].split("/")
    role, rest = parts[0], parts[1:]
    if role not in ROLES:
        return None
    if role in NAMED_ROLES:
        if len(rest) != 1 or not rest[0]:
            return None
        if role == "stage" and not rest[0].isdigit():
            return None
        return Identity(role, rest[0])
    return Identity(role) if not rest else None


def of_service(name: str) -> Identity:
    """The identity of a certificate name of `tether certs init`: admission, coordinator, operator, stage-<i>,
    client-<name> (or client: client/default)."""
    if name.startswith("stage-"):
        return Identity("stage", name[len("stage-"):])
    if name == "client":
        return Identity("client", "default")
    if name.startswith("client-"):
        return Identity("client", name[len("client-"):])
    return Identity(name)


def from_auth_context(auth: Mapping[str, Iterable[bytes]] | None) -> Identity | None:
    """The peer's identity from a gRPC auth context (`context.auth_context()`): only when the transport is TLS and
    the certificate carries exactly one of our URI SANs (two would be ambiguous: refuse rather than guess)."""
    if not auth:
        return None
    if b"ssl" not in auth.get("transport_security_type", ()):
        return None
    uris = {v.decode("utf-8", "replace") for key in ("peer_uri", "peer_spiffe_id") for v in auth.get(key, ())}
    ours = {parse(u) for u in uris if u.startswith(PREFIX)}
    if len(ours) != 1 or None in ours:
        return None
    return ours.pop()


def of_peer(context) -> Identity | None:
    """The identity of the peer of a gRPC call (None without a context, e.g. a call made in-process)."""
    if context is None:
        return None
    try:
        return from_auth_context(context.auth_context())
    except Exception:   # noqa: BLE001 - a context without an auth context is an anonymous peer
        return None
