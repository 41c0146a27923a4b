"""Who a peer is: the `spiffe://tether.local/...` URI SAN of the client certificate it presented.

Identities: spiffe://tether.local/admission, /coordinator, /operator, /stage/<i>, /client/<name>. The CA that
signed the certificate is the only thing that vouches for them, so only a peer whose certificate chain was
verified against --tls-ca (mutual TLS) has an identity; a plaintext peer has none.

Servers are checked the other way round: gRPC's Python API has no client-side hook to read the server's URI
SAN, so a service identity's certificate also carries `server_name` (stage-0.id.tether.local, ...), a DNS name
no other certificate of the CA carries, and a channel between services makes gRPC's TLS layer verify the server
under the name of the identity it expects (tether/grpcutil.py `channel`; SECURITY.md, "Who the server is").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tether import settings

PREFIX = f"spiffe://{settings.TLS_TRUST_DOMAIN}/"
ROLES = ("admission", "coordinator", "operator", "stage", "client")
NAMED_ROLES = ("stage", "client")   # these carry a name: the stage's index, the client's name
SERVICE_ROLES = ("admission", "coordinator", "stage")   # the roles that serve: only their certificates are servers


@dataclass(frozen=True)
class Identity:
    role: str        # one of ROLES
    name: str = ""   # the stage's index or the client's name; "" for the others

    @property
    def uri(self) -> str:
        return f"{PREFIX}{self.role}/{self.name}" if self.name else f"{PREFIX}{self.role}"

    def __str__(self) -> str:
        return self.uri

    @property
    def serves(self) -> bool:
        return self.role in SERVICE_ROLES

    @property
    def server_name(self) -> str:
        """The DNS name that only this service identity's certificate carries (what a channel to it verifies)."""
        if not self.serves:
            raise ValueError(f"{self.uri} is not a service identity: it has no server name")
        label = f"{self.role}-{self.name}" if self.name else self.role
        return f"{label}.{settings.TLS_SERVER_NAME_DOMAIN}"


COORDINATOR = Identity("coordinator")


def stage(index: int) -> Identity:
    return Identity("stage", str(index))


def stage_index(who: Identity | None) -> int | None:
    """The position a stage identity names (stage/<i> -> i); None for any other identity."""
    return int(who.name) if who is not None and who.role == "stage" else None


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


def of_certificate(pem: bytes) -> Identity | None:
    """The identity a certificate (PEM, e.g. this service's own --tls-cert) names in its one URI SAN of ours."""
    from cryptography import x509   # only where a certificate is read

    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    ours = {parse(u) for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(PREFIX)}
    return ours.pop() if len(ours) == 1 and None not in ours else None


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
