"""`tether certs init`: a CA, one certificate per service with its identity and host names, keys 0600."""

from __future__ import annotations

import ipaddress
import stat

from cryptography import x509

from tether.cli import certs as certs_cli
from tether.security import certs


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
