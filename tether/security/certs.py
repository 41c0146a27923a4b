"""A local certificate authority and one certificate per service (`tether certs init DIR`).

DIR/ca.pem + ca.key is the CA; DIR/<name>.pem + <name>.key one certificate per name, its identity as a URI SAN
(tether/security/identity.py). Certificates say what they are for: a service's (admission, coordinator,
stage-<i>) is TLS server and client (serverAuth + clientAuth: each serves and calls the next one) and carries
its server name (<role>[-<i>].id.tether.local, which only it carries: what channels between services verify)
and the host names it is reached by as DNS/IP SANs; operator and client certificates are clientAuth only and
carry no host name, so a TLS client refuses them as servers. Keys are EC P-256 and written 0600. Existing files
are kept: a second run adds what is missing (e.g. more stages) under the same CA, and issues again a
certificate made before certificates said what they are for.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tether import settings
from tether.security.identity import of_service

# Reached by on one machine and under docker-compose.yml / deploy/k8s names (a service's own names are added).
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_NAME = "ca"


def service_hosts(name: str) -> list[str]:
    """The compose and k8s names of a certificate name: stage-1 -> stage1, tether-stage-1.tether-stage, ..."""
    if name.startswith("stage-"):
        i = name[len("stage-"):]
        return [f"stage{i}", f"tether-stage-{i}", f"tether-stage-{i}.tether-stage"]
    if name in ("admission", "coordinator"):
        return [name, f"tether-{name}"] + (["tether-coordinators"] if name == "coordinator" else [])
    return []


def certificate_names(stages: int, clients: Iterable[str] = ("client",)) -> list[str]:
    return ["admission", "coordinator", *(f"stage-{i}" for i in range(stages)), "operator", *clients]


@dataclass(frozen=True)
class Issued:
    name: str
    cert: Path
    key: Path
    identity: str
    created: bool    # False: it existed already and was kept


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)   # never readable by others, not even briefly
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _sans(hosts: Iterable[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def _says_what_it_is_for(path: Path, server_name: str | None) -> bool:
    """Whether a certificate already there has today's shape: a service's carries its server name, a caller's
    has no serverAuth (one made before either existed is issued again: channels would refuse it)."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        dns = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        return False
    if server_name is None:
        return ExtendedKeyUsageOID.SERVER_AUTH not in usage and not dns
    return server_name in dns


def load_or_create_ca(folder: Path, days: int = settings.TLS_CA_DAYS
                      ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, bool]:
    cert_path, key_path = folder / f"{CA_NAME}.pem", folder / f"{CA_NAME}.key"
    if cert_path.exists() and key_path.exists():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path} is not an elliptic-curve key: not a CA `tether certs init` made")
        return cert, key, False
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tether local CA ({settings.TLS_TRUST_DOMAIN})")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, True


def issue(folder: Path, name: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
          hosts: Iterable[str] = (), days: int = settings.TLS_CERT_DAYS) -> Issued:
    """DIR/<name>.pem and .key for `name` (its identity from identity.of_service), unless present; `hosts` go
    on service certificates only."""
    who = of_service(name)
    ident = who.uri
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    if cert_path.exists() and key_path.exists() and _says_what_it_is_for(cert_path, who.server_name if who.serves
                                                                        else None):
        return Issued(name, cert_path, key_path, ident, False)
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(ident)]
    if who.serves:
        sans += _sans([who.server_name, *LOCAL_HOSTS, *service_hosts(name), *hosts])
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    else:   # operator, client-*: callers only. No host name, and a TLS client refuses them as a server
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Issued(name, cert_path, key_path, ident, True)


def init(folder: Path, stages: int = 4, hosts: Iterable[str] = (), clients: Iterable[str] = ("client",)
         ) -> list[Issued]:
    """The CA (created unless present) and every service's certificate in `folder`."""
    if stages < 1:
        raise ValueError("--stages must be at least 1")
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    ca_cert, ca_key, _ = load_or_create_ca(folder)
    hosts = list(hosts)
    return [issue(folder, n, (ca_cert, ca_key), hosts) for n in certificate_names(stages, clients)]


def ca_path(folder: Path) -> Path:
    return folder / f"{CA_NAME}.pem"
