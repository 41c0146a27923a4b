"""`tether certs init`: a CA, one certificate per service with its identity and host names, keys 0600; each
certificate says what it is for (serverAuth only on services, whose server name only they carry)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tether import settings
from tether.cli import certs as certs_cli
from tether.security import certs
from tether.security.identity import of_service


def _sans(path):
    ext = x509.load_pem_x509_certificate(path.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    return (ext.get_values_for_type(x509.UniformResourceIdentifier), ext.get_values_for_type(x509.DNSName),
            ext.get_values_for_type(x509.IPAddress))


def test_init_makes_every_service_certificate(tmp_path):
    folder = tmp_path / "pki"
    certs_cli.main(["init", str(folder), "--stages", "3", "--host", "tether.example", "--host", "10.0.0.7"])
    names = {p.stem for p in folder.glob("*.pem")}
    assert names == {"ca", "admission", "coordinator", "stage-0", "stage-1", "stage-2", "operator", "client"}
    for key in folder.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    uris, dns, ips = _sans(folder / "stage-1.pem")
    assert uris == ["spiffe://tether.local/stage/1"]
    assert {"localhost", "stage1", "tether-stage-1.tether-stage", "tether.example"} <= set(dns)
    assert {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"), ipaddress.ip_address("10.0.0.7")} <= set(ips)
    assert _sans(folder / "client.pem")[0] == ["spiffe://tether.local/client/default"]
    assert _sans(folder / "coordinator.pem")[0] == ["spiffe://tether.local/coordinator"]
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    leaf = x509.load_pem_x509_certificate((folder / "admission.pem").read_bytes())
    leaf.verify_directly_issued_by(ca)


def test_a_second_run_keeps_what_exists_and_adds_what_is_missing(tmp_path):
    first = {i.name: i.cert.read_bytes() for i in certs.init(tmp_path, stages=1)}
    again = certs.init(tmp_path, stages=2)
    assert [i.name for i in again if i.created] == ["stage-1"]
    assert all(i.cert.read_bytes() == first[i.name] for i in again if i.name in first)


def _usage(path) -> set:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_certificates_say_what_they_are_for(tmp_path):
    """Services serve and call; operator and client certificates only call and name no host, so no TLS client
    takes them for a server (a tenant holding `client` cannot pose as admission's public name or a stage)."""
    certs.init(tmp_path, stages=2, hosts=["tether.example"], clients=["client", "client-acme"])
    for name in ("admission", "coordinator", "stage-0", "stage-1"):
        assert _usage(tmp_path / f"{name}.pem") == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        assert "tether.example" in _sans(tmp_path / f"{name}.pem")[1]
    for name in ("operator", "client", "client-acme"):
        assert _usage(tmp_path / f"{name}.pem") == {ExtendedKeyUsageOID.CLIENT_AUTH}, name
        uris, dns, ips = _sans(tmp_path / f"{name}.pem")
        assert len(uris) == 1 and dns == [] and ips == [], name


def test_each_service_name_is_on_its_own_certificate_only(tmp_path):
    certs.init(tmp_path, stages=3)
    names = {p.stem: set(_sans(p)[1]) for p in tmp_path.glob("*.pem") if p.stem != "ca"}
    for cert_name, dns in names.items():
        who = of_service(cert_name)
        mine = {d for d in dns if d.endswith("." + settings.TLS_SERVER_NAME_DOMAIN)}
        assert mine == ({who.server_name} if who.serves else set()), cert_name
    assert of_service("stage-1").server_name == "stage-1.id.tether.local"
    assert of_service("coordinator").server_name == "coordinator.id.tether.local"


def test_a_second_run_issues_again_a_certificate_of_the_old_shape(tmp_path):
    """A folder from before server names: its service certificates would be refused by every channel, and its
    client certificate could serve. `tether certs init` on it brings both up to date, keeping the CA."""
    ca = certs.load_or_create_ca(tmp_path)[:2]
    for name in ("stage-0", "client"):
        certs.issue(tmp_path, name, ca)   # for its key file; the certificate is replaced by an old-shaped one
    ca_cert = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    for name, uri in (("stage-0", "spiffe://tether.local/stage/0"), ("client", "spiffe://tether.local/client/default")):
        now = dt.datetime.now(dt.timezone.utc)
        legacy = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                  .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(1)
                  .not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
                  .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri),
                                                              x509.DNSName("localhost")]), critical=False)
                  .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                        ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                  .sign(ca[1], hashes.SHA256()))
        (tmp_path / f"{name}.pem").write_bytes(legacy.public_bytes(serialization.Encoding.PEM))
    issued = {i.name: i.created for i in certs.init(tmp_path, stages=1)}
    assert issued["stage-0"] and issued["client"]
    assert not any(i.created for i in certs.init(tmp_path, stages=1))   # today's shape is kept
    assert "stage-0.id.tether.local" in _sans(tmp_path / "stage-0.pem")[1]
    assert _usage(tmp_path / "client.pem") == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert (tmp_path / "ca.pem").read_bytes() == ca_cert.public_bytes(serialization.Encoding.PEM)
