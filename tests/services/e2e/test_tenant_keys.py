"""API keys end to end (real processes on loopback, tiny model, 2 stages): admission with a tenants file that
gives two tenants a key each. A call without a known key is UNAUTHENTICATED; a key cannot act as another
tenant or use a priority its tenant lacks (PERMISSION_DENIED); answers stay exact and run as the key's tenant;
and two tenants' identical prompts never share prefix-cache blocks (the coordinator's and stages' Stats)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.admission.auth import key_digest
from tether.cli.cluster import LocalCluster
from tether.client import Client, PermissionDenied, Unauthenticated
from tether.v1 import admission_pb2, admission_pb2_grpc
from tests.helpers import coordinator_stats, exact_ids, stage_stats, started, tenants_file

KEY_A = "tk_test-acme-" + "a" * 32       # tests' keys: any one-word token works; real ones come from `tether keys new`
KEY_B = "tk_test-globex-" + "b" * 32
# ~330 bytes (the tiny model's tokenizer is byte-level): five full 64-position KV blocks
SHARED = ("Tenant isolation check. You are the archive's assistant: quote the catalogue number, keep answers "
          "short, and never guess a date that the record does not hold. " * 2 + "Which box holds the 1911 maps?")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tenants = tenants_file(tmp_path_factory, f"""
[tenants.acme]
api_keys_sha256 = ["{key_digest(KEY_A)}"]
[tenants.globex]
api_keys_sha256 = ["{key_digest(KEY_B)}"]
priorities = ["critical", "standard", "sheddable"]
""")
    with started(tmp_path_factory, metrics=True, extra={"admission": ["--tenants", str(tenants)]}) as c:
        yield c


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch):
    monkeypatch.delenv("TETHER_API_KEY", raising=False)


def _stage_hits(cluster: LocalCluster) -> list[int]:
    return [s.prefix_hits for s in stage_stats(cluster)]


def _auth_failures(cluster: LocalCluster) -> dict[str, float]:
    with urllib.request.urlopen(cluster.service("admission").metrics_url, timeout=10) as r:
        text = r.read().decode()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "tether:auth_failures" for s in f.samples if s.name.endswith("_total")}


def test_without_a_known_key_every_call_is_unauthenticated(keyed):
    with Client(keyed.target, timeout=60, retry=None) as anonymous:
        for call in (lambda: anonymous.generate("hello", max_tokens=2), lambda: list(anonymous.stream("hello")),
                     lambda: anonymous.tag("hello")):
            with pytest.raises(Unauthenticated, match="missing API key: send gRPC metadata 'authorization: Bearer"):
                call()
    with Client(keyed.target, timeout=60, retry=None, api_key="tk_not-a-key") as stranger:
        with pytest.raises(Unauthenticated, match="unknown API key") as info:
            stranger.generate("hello", max_tokens=2)
    assert "tk_not-a-key" not in info.value.message
    with grpc.insecure_channel(keyed.target) as ch:                # garbled: not 'Bearer <key>'
        with pytest.raises(grpc.RpcError) as raw:
            admission_pb2_grpc.AdmissionStub(ch).Generate(admission_pb2.GenerateRequest(prompt=b"hi"), timeout=30,
                                                          metadata=(("authorization", KEY_A),))
    assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED and "not 'Bearer <key>'" in raw.value.details()
    failures = _auth_failures(keyed)
    assert failures.get("missing", 0) >= 3 and failures.get("unknown_key", 0) >= 1 and failures.get("malformed", 0) >= 1


def test_a_key_cannot_act_as_another_tenant_nor_use_a_priority_its_tenant_lacks(keyed):
    with Client(keyed.target, timeout=60, retry=None, api_key=KEY_A) as acme:
        with pytest.raises(PermissionDenied, match="belongs to tenant 'acme'.*tenant 'globex'"):
            acme.generate("hello", max_tokens=2, tenant="globex")
        with pytest.raises(PermissionDenied, match="belongs to tenant 'acme'"):
            list(acme.stream("hello", max_tokens=2, tenant="globex"))
        with pytest.raises(PermissionDenied, match="may not send critical requests; its priorities are standard, "
                                                   "sheddable"):
            acme.generate("hello", max_tokens=2, priority="critical")
        with pytest.raises(PermissionDenied, match="may not send critical"):
            acme.tag("hello", priority="critical")
        assert acme.tag("hello", priority="sheddable")["tenant"] == "acme"
    with Client(keyed.target, timeout=60, retry=None, api_key=KEY_B) as globex:   # its tenant lists critical
        result = globex.generate("hello", max_tokens=3, priority="critical", tenant="globex", ignore_eos=True)
    assert result.tags["tenant"] == "globex" and result.tags["priority"] == "critical"
    assert result.token_ids == exact_ids("hello", 3)
    failures = _auth_failures(keyed)
    assert failures.get("tenant", 0) >= 2 and failures.get("priority", 0) >= 2


def test_answers_are_exact_and_run_as_the_keys_tenant(keyed, monkeypatch):
    prompt = "The quick brown fox"
    with Client(keyed.target, timeout=120, retry=None, api_key=KEY_A) as acme:
        result = acme.generate(prompt, max_tokens=8, ignore_eos=True)
        stream = acme.stream(prompt, max_tokens=8, ignore_eos=True)
        streamed = "".join(d.text for d in stream)
    assert result.token_ids == exact_ids(prompt, 8) == stream.result.token_ids and streamed == result.text
    assert result.tags["tenant"] == "acme" == stream.tags["tenant"]
    monkeypatch.setenv("TETHER_API_KEY", KEY_B)                    # the SDK's fallback
    with Client(keyed.target, timeout=120, retry=None) as from_env:
        assert from_env.generate(prompt, max_tokens=8, ignore_eos=True).tags["tenant"] == "globex"


def test_two_tenants_identical_prompts_never_share_cache_blocks(keyed):
    def ask(key: str) -> list[int]:
        with Client(keyed.target, timeout=120, retry=None, api_key=key) as client:
            return client.generate(SHARED, max_tokens=4, ignore_eos=True).token_ids

    want = exact_ids(SHARED, 4)
    assert ask(KEY_A) == want                                      # cold: fills acme's cache
    before, stages_before = coordinator_stats(keyed), _stage_hits(keyed)
    assert ask(KEY_A) == want                                      # same key, same prompt: a hit
    after = coordinator_stats(keyed)
    assert after.prefix_hits == before.prefix_hits + 1
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 2 * 64
    assert [h - b for h, b in zip(_stage_hits(keyed), stages_before)] == [1, 1]

    before, stages_before = after, _stage_hits(keyed)
    assert ask(KEY_B) == want                                      # same prompt, the other tenant's key
    after = coordinator_stats(keyed)
    assert after.prefix_queries == before.prefix_queries + 1
    assert after.prefix_hits == before.prefix_hits and after.prefix_hit_tokens == before.prefix_hit_tokens
    assert _stage_hits(keyed) == stages_before


def test_the_cli_takes_the_key_from_the_environment_or_a_flag(keyed):
    cmd = [sys.executable, "-m", "tether.cli.main", "generate", "--target", keyed.target, "--max-tokens", "3",
           "--retries", "0", "--json", "Hi"]
    env = {k: v for k, v in os.environ.items() if k != "TETHER_API_KEY"}
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "UNAUTHENTICATED: missing API key" in refused.stderr
    by_env = subprocess.run(cmd, env={**env, "TETHER_API_KEY": KEY_A}, capture_output=True, text=True, timeout=120)
    assert by_env.returncode == 0, by_env.stderr
    assert '"tenant": "acme"' in by_env.stdout
    by_flag = subprocess.run(cmd + ["--api-key", KEY_B, "--priority", "critical"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert by_flag.returncode == 0, by_flag.stderr
    assert '"tenant": "globex"' in by_flag.stdout
