"""API keys mapped to tenants (services/admission/auth.py): the tenants file's keys, the authorization header,
and what a key's tenant may ask for."""

import grpc
import pytest

from services.admission.auth import (DEFAULT_PRIORITIES, ApiKeys, AuthError, Principal, authorize, key_digest)
from services.admission.limits import TenantLimit, TenantLimits, read_tenants_file

KEY_A, KEY_B = "tk_alpha-key-000", "tk_beta-key-111"


def keys_file(tmp_path, body: str):
    f = tmp_path / "tenants.toml"
    f.write_text(body)
    data = read_tenants_file(f)
    return ApiKeys.from_config(data, str(f)), TenantLimits.from_config(data, str(f))


def two_tenants(tmp_path) -> tuple[ApiKeys, TenantLimits]:
    return keys_file(tmp_path, f"""
[tenants.acme]
requests_per_s = 5
api_keys_sha256 = ["{key_digest(KEY_A)}"]
[tenants.globex]
api_keys_sha256 = ["{key_digest(KEY_B).upper()}"]
priorities = ["sheddable", "critical"]
""")


def test_keys_are_found_by_their_hash_and_limits_still_read(tmp_path):
    keys, limits = two_tenants(tmp_path)
    assert keys.active and len(keys.by_digest) == 2
    assert KEY_A not in str(keys.by_digest)                        # only digests are kept
    assert keys.authenticate([("authorization", f"Bearer {KEY_A}")]) == Principal("acme", DEFAULT_PRIORITIES)
    # upper-case hex in the file, scheme in any case, extra spaces, other metadata around
    got = keys.authenticate([("traceparent", "x"), ("authorization", f"bearer   {KEY_B} ")])
    assert got == Principal("globex", ("critical", "sheddable"))   # canonical order
    assert limits.tenants["acme"] == TenantLimit(requests_per_s=5) and "globex" in limits.tenants


@pytest.mark.parametrize("metadata,reason", [
    ([], "missing"),
    (None, "missing"),
    ([("x-api-key", KEY_A)], "missing"),
    ([("authorization", KEY_A)], "malformed"),                    # no scheme
    ([("authorization", f"Basic {KEY_A}")], "malformed"),
    ([("authorization", "Bearer ")], "malformed"),
    ([("authorization", "Bearer a b")], "malformed"),
    ([("authorization", "Bearer " + "x" * 600)], "malformed"),
    ([("authorization", b"Bearer \xff")], "malformed"),
    ([("authorization", f"Bearer {KEY_A}"), ("authorization", f"Bearer {KEY_B}")], "malformed"),
    ([("authorization", "Bearer tk_not-a-key")], "unknown_key"),
    ([("authorization", f"Bearer {KEY_A}x")], "unknown_key"),
])
def test_a_call_without_a_known_key_is_unauthenticated(tmp_path, metadata, reason):
    keys, _ = two_tenants(tmp_path)
    got = keys.authenticate(metadata)
    assert isinstance(got, AuthError) and got.code == grpc.StatusCode.UNAUTHENTICATED and got.reason == reason
    assert KEY_A not in got.message and KEY_B not in got.message   # never echo a key
    if reason == "missing":
        assert got.message.startswith("missing API key") and "authorization: Bearer <key>" in got.message


def test_the_key_decides_the_tenant_and_its_priorities():
    acme = Principal("acme", DEFAULT_PRIORITIES)
    assert authorize(acme, "", "standard") == "acme"               # empty tenant: the key's
    assert authorize(acme, "acme", "sheddable") == "acme"
    other = authorize(acme, "globex", "standard")
    assert isinstance(other, AuthError) and other.code == grpc.StatusCode.PERMISSION_DENIED
    assert other.reason == "tenant" and "'acme'" in other.message and "'globex'" in other.message
    critical = authorize(acme, "", "critical")
    assert isinstance(critical, AuthError) and critical.code == grpc.StatusCode.PERMISSION_DENIED
    assert critical.reason == "priority" and "standard, sheddable" in critical.message
    assert authorize(acme, "", "urgent") == "acme"                 # not a priority: validation's to refuse
    assert authorize(Principal("ops", ("critical",)), "", "critical") == "ops"


def test_no_key_configured_means_nobody_is_authenticated(tmp_path):
    keys, _ = keys_file(tmp_path, "[defaults]\nrequests_per_s = 5\n[tenants.acme]\nrequests_per_s = 1\n")
    assert not keys.active
    assert not ApiKeys().active


@pytest.mark.parametrize("body,why", [
    ('[tenants.a]\napi_keys_sha256 = ["{key}"]\n[tenants.b]\napi_keys_sha256 = ["{key}"]\n', "one tenant"),
    ('[tenants.a]\napi_keys_sha256 = ["tk_plain-key-pasted-here"]\n', r"api_keys_sha256\[0\] is not 64 hex"),
    ('[tenants.a]\napi_keys_sha256 = []\n', "non-empty list"),
    ('[tenants.a]\napi_keys_sha256 = "{key}"\n', "non-empty list"),
    ('[tenants.a]\napi_keys_sha256 = ["{key}"]\npriorities = ["urgent"]\n', "unknown priorities"),
    ('[tenants.a]\napi_keys_sha256 = ["{key}"]\npriorities = []\n', "non-empty list"),
    ('[tenants.a]\npriorities = ["critical"]\n', "without api_keys_sha256"),
    ('[defaults]\napi_keys_sha256 = ["{key}"]\n', r"\[tenants.NAME\]"),
    ('[tenants."a b"]\napi_keys_sha256 = ["{key}"]\n', "A-Za-z0-9"),
    ('[tenants.a]\napi_key = ["{key}"]\n', "unknown key"),
])
def test_a_bad_keys_entry_stops_admission_with_the_reason(tmp_path, body, why):
    with pytest.raises(ValueError, match=why) as info:
        keys_file(tmp_path, body.replace("{key}", key_digest(KEY_A)))
    assert "tk_plain" not in str(info.value)                       # a pasted key is never repeated


def test_a_dotted_tenant_name_is_quoted(tmp_path):
    keys, _ = keys_file(tmp_path, f'[tenants."acme.eu"]\napi_keys_sha256 = ["{key_digest(KEY_A)}"]\n')
    assert keys.authenticate([("authorization", f"Bearer {KEY_A}")]).tenant == "acme.eu"
