"""Why a channel to another service refused its server, said so a person can act on it, logged and counted.

The refusal itself is gRPC's TLS layer's (tether/grpcutil.py `channel`: the server's certificate must chain to
the CA, allow serverAuth and carry the expected identity's server name), and it happens before any byte of a
call is sent. All gRPC reports then is "failed to connect". When a call to a service fails that way, `refusal`
looks at what the address presents (one TLS handshake of its own, trusting nothing it reads: only the
message is made of it) and says whether it is someone else than the identity expected. `explain` is the pure
decision; `REFUSED` counts refusals by expected identity (tether:server_identity_refusals_total).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import Counter
from dataclasses import dataclass

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tether.security import identity
from tether.security.identity import Identity
from tether.security.tls import TlsConfig

log = logging.getLogger(__name__)

REFUSED: Counter[str] = Counter()   # expected identity URI -> servers refused (this process)
PROBE_TIMEOUT_S = 3.0
LOG_EVERY_S = 30.0                  # the same refusal again (retried every second) is logged this often
_logged: dict[tuple[str, str], float] = {}   # (address, why) -> when last logged


@dataclass(frozen=True)
class Presented:
    """What a server's certificate says, unverified (it is only described, never trusted)."""

    identity: Identity | None     # its spiffe://tether.local identity, if it names exactly one
    dns_names: tuple[str, ...]
    server_auth: bool             # its extended key usage allows serving TLS (or it has none)
    from_our_ca: bool             # signed by our CA (a signature check only: not a full verification)


def describe(der: bytes, ca_pem: bytes) -> Presented:
    cert = x509.load_der_x509_certificate(der)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris, dns = sans.get_values_for_type(x509.UniformResourceIdentifier), sans.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        uris, dns = [], []
    ours = {identity.parse(u) for u in uris if u.startswith(identity.PREFIX)}
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        server_auth = ExtendedKeyUsageOID.SERVER_AUTH in eku
    except x509.ExtensionNotFound:
        server_auth = True
    try:
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
        from_ca = True
    except Exception:   # noqa: BLE001 - any failure (another issuer, a bad signature) means: not ours
        from_ca = False
    return Presented(ours.pop() if len(ours) == 1 and None not in ours else None, tuple(dns), server_auth, from_ca)


def explain(expected: Identity, seen: Presented | None) -> str | None:
    """Why the server that presented `seen` is not `expected`; None when it looks like `expected` (the failure
    was then something else: unreachable, a timeout) or nothing could be read."""
    if seen is None:
        return None
    if not seen.from_our_ca:
        return f"its certificate is not signed by our CA (it is not {expected.uri})"
    if seen.identity != expected:
        who = seen.identity.uri if seen.identity is not None else "no spiffe://tether.local identity"
        return f"it presents {who}, not {expected.uri}"
    if not seen.server_auth:
        return f"its certificate ({expected.uri}) is not for serving TLS (no serverAuth)"
    if expected.server_name not in seen.dns_names:
        return (f"its certificate ({expected.uri}) lacks the server name {expected.server_name}: re-issue it "
                f"(`tether certs init` into a new folder, or add the DNS name)")
    return None


async def presented(address: str, ca_pem: bytes, timeout_s: float = PROBE_TIMEOUT_S) -> Presented | None:
    """The certificate the server at `address` (host:port) presents, or None when none could be read."""
    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE   # to describe whoever answers; what it says is never trusted
    ctx.set_alpn_protocols(["h2"])
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port), ssl=ctx), timeout_s)
    except (OSError, ValueError, asyncio.TimeoutError, ssl.SSLError):
        return None
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return describe(der, ca_pem) if der else None
    except ValueError:   # not a certificate cryptography can read
        return None
    finally:
        writer.close()


async def refusal(address: str, tls: TlsConfig | None, expected: Identity) -> str | None:
    """After a call to `address` failed: why its server is not `expected` (logged and counted), or None."""
    if tls is None:
        return None   # plaintext: no identities to check
    why = explain(expected, await presented(address, tls.ca))
    if why is not None:
        REFUSED[expected.uri] += 1
        now, key = time.monotonic(), (address, why)
        if now - _logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
            _logged[key] = now
            log.error("SERVER IDENTITY: refused the server at %s, expected %s: %s (refused %d time(s) so far)",
                      address, expected.uri, why, REFUSED[expected.uri])
    return why
