"""TLS settings from flags and the environment: all three files or none; a CA alone is not TLS."""

from __future__ import annotations

import argparse

import pytest

from tether.security import certs, tls


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    certs.init(folder, stages=1)
    return folder


def _parse(argv, public=False, env=None, monkeypatch=None):
    for k in ("TETHER_TLS_CA", "TETHER_TLS_CERT", "TETHER_TLS_KEY", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    tls.add_flags(p, public=public)
    return tls.from_args(p.parse_args(argv))


def test_no_flags_is_plaintext(monkeypatch):
    assert _parse([], monkeypatch=monkeypatch) is None


def test_grpc_roots_alone_do_not_turn_tls_on(pki, monkeypatch):
    assert _parse([], env={"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(pki / "ca.pem")}, monkeypatch=monkeypatch) is None


def test_flags_give_mutual_tls(pki, monkeypatch):
    cfg = _parse(tls.service_flags(pki, "stage-0"), monkeypatch=monkeypatch)
    assert cfg.require_client_auth and cfg.ca == (pki / "ca.pem").read_bytes()
    assert cfg.cert == (pki / "stage-0.pem").read_bytes()


def test_grpc_roots_are_never_the_services_ca(pki, monkeypatch):
    """gRPC's roots variable is usually the system's public CAs: trusting them would let any public CA's
    certificate authenticate to a service."""
    env = {"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(pki / "ca.pem"), "TETHER_TLS_CERT": str(pki / "admission.pem"),
           "TETHER_TLS_KEY": str(pki / "admission.key")}
    with pytest.raises(ValueError, match="missing --tls-ca"):
        _parse([], public=True, env=env, monkeypatch=monkeypatch)


def test_environment_defaults(pki, monkeypatch):
    env = {"TETHER_TLS_CA": str(pki / "ca.pem"), "TETHER_TLS_CERT": str(pki / "admission.pem"),
           "TETHER_TLS_KEY": str(pki / "admission.key")}
    cfg = _parse([], public=True, env=env, monkeypatch=monkeypatch)
    assert cfg.ca == (pki / "ca.pem").read_bytes() and not cfg.require_client_auth   # public port: none by default
    cfg = _parse(["--tls-client-auth", "require"], public=True, env=env, monkeypatch=monkeypatch)
    assert cfg.require_client_auth


def test_half_a_configuration_is_an_error(pki, monkeypatch):
    with pytest.raises(ValueError, match="missing --tls-key"):
        _parse(["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "operator.pem")], monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="cannot read the TLS key"):
        _parse(["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "operator.pem"),
                "--tls-key", str(pki / "nope.key")], monkeypatch=monkeypatch)


def test_client_credentials_need_cert_and_key_together(pki):
    assert tls.client_channel_credentials(pki / "ca.pem") is not None
    assert tls.client_channel_credentials(pki / "ca.pem", pki / "client.pem", pki / "client.key") is not None
    with pytest.raises(ValueError):
        tls.client_channel_credentials(pki / "ca.pem", pki / "client.pem")
