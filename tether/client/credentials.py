"""How the SDK reaches admission: its API key (`authorization: Bearer <key>` on every call) and TLS.

Each comes from the client's parameter, else the environment: TETHER_API_KEY, and TETHER_TLS_CA /
TETHER_TLS_CERT / TETHER_TLS_KEY (paths of PEM files; the same variables the services read). TLS is on when any
of the three is set (or `tls=True`: the system's roots verify the server); `tls=False` forces plaintext.
A key sent in plaintext to a host other than this one can be read by anyone on the path: the SDK warns once.
"""

from __future__ import annotations

import ipaddress
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import grpc

API_KEY_ENV = "TETHER_API_KEY"
TLS_ENV = {"ca": "TETHER_TLS_CA", "cert": "TETHER_TLS_CERT", "key": "TETHER_TLS_KEY"}   # settings.TLS_*_ENV
_warned_plaintext = False


@dataclass(frozen=True)
class Connection:
    """What a client's channel and calls need: the key (None: send none) and TLS files (None: plaintext)."""

    api_key: str | None = None
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def __repr__(self) -> str:   # never show the key (tracebacks, logs)
        return (f"Connection(api_key={'***' if self.api_key else None}, tls={self.tls}, tls_ca={self.tls_ca!r}, "
                f"tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r})")


def resolve(api_key: str | None = None, tls: bool | None = None, tls_ca: str | os.PathLike | None = None,
            tls_cert: str | os.PathLike | None = None, tls_key: str | os.PathLike | None = None,
            environ: dict[str, str] | None = None) -> Connection:
    """The parameters, each falling back to its environment variable (an empty value counts as unset)."""
    env = os.environ if environ is None else environ
    key = api_key if api_key is not None else env.get(API_KEY_ENV) or None
    if key is not None:
        key = key.strip()
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"an API key is one word without spaces (check api_key= or ${API_KEY_ENV})")
    files = {name: str(given) if given is not None else env.get(var) or None
             for (name, var), given in zip(TLS_ENV.items(), (tls_ca, tls_cert, tls_key))}
    if (files["cert"] is None) != (files["key"] is None):
        raise ValueError("a TLS client certificate needs its key and a key its certificate: give tls_cert and "
                         f"tls_key together (or ${TLS_ENV['cert']} and ${TLS_ENV['key']})")
    on = any(files.values()) if tls is None else tls
    return Connection(key, on, files["ca"], files["cert"], files["key"]) if on else Connection(key)


def channel_credentials(conn: Connection) -> grpc.ChannelCredentials:
    """TLS credentials: verify admission against tls_ca (None: the system's roots), present tls_cert/tls_key."""
    try:
        from tether.security.tls import client_channel_credentials   # the services' helper, one TLS policy
    except ImportError:                                               # pragma: no cover - older tree
        client_channel_credentials = _local_credentials   # type: ignore[assignment]  # takes str paths only, all we pass
    try:
        return client_channel_credentials(conn.tls_ca, conn.tls_cert, conn.tls_key)
    except OSError as e:
        raise ValueError(f"cannot read a TLS file: {e}") from None


def _local_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    def pem(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=pem(ca), private_key=pem(key), certificate_chain=pem(cert))


def warn_if_exposed(target: str, conn: Connection) -> None:
    """Warn (once per process) before a key goes in plaintext to a host that is not this machine."""
    global _warned_plaintext
    if _warned_plaintext or not conn.api_key or conn.tls or is_loopback(target):
        return
    _warned_plaintext = True
    warnings.warn(f"tether: sending an API key without TLS to {target}: anyone on the network path can read it; "
                  f"use TLS (tls_ca=..., ${TLS_ENV['ca']}, or --tls-ca)", RuntimeWarning, stacklevel=3)


def is_loopback(target: str) -> bool:
    """Whether a gRPC target names this machine: localhost, 127.0.0.0/8, ::1 or a unix socket."""
    t = target.strip()
    if t.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            t = t[len(scheme):].split(",")[0]
            break
    if t.startswith("["):                     # [::1]:50051
        host = t[1:t.find("]")] if "]" in t else t[1:]
    elif t.count(":") == 1:                   # host:port
        host = t.split(":")[0]
    else:                                     # a bare host, or a bare IPv6 address
        host = t
    if host.lower() in ("localhost", "localhost.", "") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_channel(target: str, conn: Connection, aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """The client's channel to admission: TLS or plaintext as `conn` says, the SDK's message and keepalive
    options."""
    from tether import settings
    from tether.grpcutil import KEEPALIVE_OPTIONS, message_options
    warn_if_exposed(target, conn)
    options = message_options(settings.GRPC_MAX_MESSAGE_BYTES) + KEEPALIVE_OPTIONS
    grpc_ = grpc.aio if aio else grpc
    if conn.tls:
        return grpc_.secure_channel(target, channel_credentials(conn), options=options)
    return grpc_.insecure_channel(target, options=options)


def call_metadata(conn: Connection, trace: tuple[tuple[str, str], ...] | None) -> tuple[tuple[str, str], ...] | None:
    """A call's metadata: the key's authorization and the caller's traceparent, None when neither."""
    out = conn.metadata + (trace or ())
    return out or None
