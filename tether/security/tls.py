"""TLS configuration of a service, from its flags or the environment, and the gRPC credentials it makes.

A service with --tls-cert/--tls-key serves TLS; between services the server requires a client certificate
signed by --tls-ca (mutual TLS), and every channel it opens presents its own certificate. The public admission
port may instead leave client certificates optional (--tls-client-auth none). Without a certificate a service
is plaintext and unauthenticated (for a trusted network or local development) and warns so once at start-up.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from tether import settings


@dataclass(frozen=True)
class TlsConfig:
    ca: bytes                    # PEM of the CA that signs every tether certificate
    cert: bytes                  # this service's certificate chain (PEM)
    key: bytes                   # and its private key (PEM)
    require_client_auth: bool = True
    source: str = ""             # where it was read from, for the start-up line

    @classmethod
    def from_files(cls, ca: str | Path, cert: str | Path, key: str | Path,
                   require_client_auth: bool = True) -> "TlsConfig":
        def read(what: str, path: str | Path) -> bytes:
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"cannot read the TLS {what} {path}: {e.strerror}") from None
        return cls(read("CA", ca), read("certificate", cert), read("key", key), require_client_auth,
                   source=f"cert {cert}, CA {ca}")

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For this service's own calls to other services: verify them against the CA, present our certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def describe(self) -> str:
        auth = "mutual TLS (client certificates required)" if self.require_client_auth else \
            "TLS (client certificates optional)"
        return f"{auth}; {self.source}"


def client_channel_credentials(ca: str | Path | bytes | None, cert: str | Path | bytes | None = None,
                               key: str | Path | bytes | None = None) -> grpc.ChannelCredentials:
    """Channel credentials for a client of tether (SDK, CLI, probes): verify the server against `ca` (None: the
    system's roots), and present `cert`/`key` (paths or PEM bytes) when both are given."""
    def pem(x: str | Path | bytes | None) -> bytes | None:
        return x if x is None or isinstance(x, bytes) else Path(x).read_bytes()
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(root_certificates=pem(ca), private_key=pem(key), certificate_chain=pem(cert))


def env_defaults(environ: dict[str, str] | None = None) -> dict[str, str | None]:
    env = os.environ if environ is None else environ
    # Not gRPC's GRPC_DEFAULT_SSL_ROOTS_FILE_PATH: that is usually the system's public roots, and a service that
    # trusted them would accept client certificates from any public CA. The deployment's CA is named explicitly.
    return {"ca": env.get(settings.TLS_CA_ENV) or None,
            "cert": env.get(settings.TLS_CERT_ENV) or None, "key": env.get(settings.TLS_KEY_ENV) or None}


def add_flags(parser: argparse.ArgumentParser, public: bool = False) -> None:
    """--tls-ca, --tls-cert, --tls-key (and on the public port --tls-client-auth), defaults from the environment."""
    env = env_defaults()
    g = parser.add_argument_group(
        "transport security", "Without --tls-cert the service speaks plaintext gRPC with no authentication (it "
        "warns at start-up): for local development on a trusted network only. `tether certs init DIR` makes a "
        "CA and every service's certificate.")
    g.add_argument("--tls-ca", metavar="PEM", default=env["ca"],
                   help=f"CA certificate that signs the other services' certificates; required with --tls-cert "
                        f"(default: ${settings.TLS_CA_ENV}; never the system's public roots)")
    g.add_argument("--tls-cert", metavar="PEM", default=env["cert"],
                   help=f"this service's certificate; it identifies the service by its spiffe://"
                        f"{settings.TLS_TRUST_DOMAIN}/... URI SAN, as server and as client of the services it "
                        f"calls (default: ${settings.TLS_CERT_ENV})")
    g.add_argument("--tls-key", metavar="PEM", default=env["key"],
                   help=f"the private key of --tls-cert (default: ${settings.TLS_KEY_ENV})")
    if public:
        g.add_argument("--tls-client-auth", choices=settings.TLS_CLIENT_AUTH, default="none",
                       help="on this public port: none (any client; requests are authorized by API key) or require "
                            "(only clients with a certificate signed by --tls-ca). Its own calls to coordinators "
                            "always present --tls-cert (default: %(default)s)")


def from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The TLS configuration the flags ask for; None for plaintext. ValueError for half a configuration."""
    given = {k: getattr(args, f"tls_{k}", None) for k in ("ca", "cert", "key")}
    if given["cert"] is None and given["key"] is None:
        return None   # a CA alone (e.g. $TETHER_TLS_CA exported for the SDK) is not TLS
    missing = [f"--tls-{k}" for k, v in given.items() if not v]
    if missing:
        raise ValueError(f"TLS needs --tls-ca, --tls-cert and --tls-key together; missing {', '.join(missing)} "
                         f"(or ${settings.TLS_CA_ENV}, ${settings.TLS_CERT_ENV}, ${settings.TLS_KEY_ENV})")
    require = getattr(args, "tls_client_auth", "require") == "require"
    ca, cert, key = given["ca"], given["cert"], given["key"]
    assert ca and cert and key   # none missing: checked above
    return TlsConfig.from_files(ca, cert, key, require_client_auth=require)


def service_flags(folder: Path, name: str) -> list[str]:
    """The command-line flags that give the service `name` (a `tether certs init` name) its certificate."""
    return ["--tls-ca", str(folder / "ca.pem"), "--tls-cert", str(folder / f"{name}.pem"),
            "--tls-key", str(folder / f"{name}.key")]


def for_service(folder: Path, name: str, require_client_auth: bool = True) -> TlsConfig:
    """The configuration of certificate `name` in a `tether certs init` folder (tests, the launcher)."""
    return TlsConfig.from_files(folder / "ca.pem", folder / f"{name}.pem", folder / f"{name}.key",
                                require_client_auth)
