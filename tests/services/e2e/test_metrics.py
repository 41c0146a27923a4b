"""Every service's /metrics, scraped over HTTP from a real 2-stage cluster, against what was sent.

The cluster runs with `--metrics-port` (free ports) and `--log-format json` on every service, admission at
DEBUG so that it writes one line per request: the structured logs are checked on the same run.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tether.cli.cluster import LocalCluster
from tether.client import AsyncClient
from tether.client.errors import InvalidArgument
from tether.telemetry.metrics import metric_names
from tests.helpers import started

SERVICES = ("stage0", "stage1", "coordinator", "admission")
CASES = [  # prompt, max_tokens, tenant, streamed
    ("The capital of France is", 5, "acme", False),
    ("Explain in under 30 words why the sky is blue.", 9, "acme", True),
    ("def fib(n):", 1, "", False),
    ("请用不超过50字向老人解释血糖仪读数", 12, "globex", True),
    ("A" * 300, 7, "", False),
]


@pytest.fixture(scope="module")
def mcluster(tmp_path_factory):
    extra = {role: ["--log-format", "json"] for role in ("stage", "coordinator")}
    extra["admission"] = ["--log-format", "json", "--log-level", "DEBUG"]
    with started(tmp_path_factory, metrics=True, extra=extra) as c:
        yield c


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[Samples, set[str]]:
    """(sample name, sorted labels) -> value, and the families' names as exposed."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples: Samples = {}
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name + ("_total" if family.type == "counter" else ""))
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, names


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def scrape_all(cluster: LocalCluster) -> dict[str, Samples]:
    return {name: scrape(cluster.service(name).metrics_url)[0] for name in SERVICES}


def send(target: str) -> list:
    async def one(client: AsyncClient, prompt: str, max_tokens: int, tenant: str, streamed: bool):
        if not streamed:
            return await client.generate(prompt, max_tokens=max_tokens, tenant=tenant, ignore_eos=True,
                                         request_id=f"label-{max_tokens}")
        stream = client.stream(prompt, max_tokens=max_tokens, tenant=tenant, ignore_eos=True)
        async for _ in stream:
            pass
        return stream.result

    async def run():
        async with AsyncClient(target, timeout=120, retry=None) as client:
            return await asyncio.gather(*(one(client, *case) for case in CASES))
    return asyncio.run(run())


def poll(check, timeout: float = 20.0):
    """Call check() until it returns without an AssertionError, or re-raise its last one at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_metrics_match_what_was_sent(mcluster):
    before = scrape_all(mcluster)
    results = send(mcluster.target)
    prompt_tokens = sum(r.receipt.prompt_tokens for r in results)
    generated = [len(r.token_ids) for r in results]
    assert generated == [c[1] for c in CASES]       # ignore_eos: each request makes exactly max_tokens

    def admission_counted():
        a, a0 = scrape(mcluster.service("admission").metrics_url)[0], before["admission"]

        def delta(name: str, **labels: str) -> float:
            return value(a, name, **labels) - value(a0, name, **labels)
        assert delta("tether:requests_total", tenant="acme") == 2
        assert delta("tether:requests_total", tenant="globex") == 1
        assert delta("tether:requests_total", tenant="(default)") == 2
        assert delta("tether:prompt_tokens_total") == prompt_tokens
        assert delta("tether:generation_tokens_total") == sum(generated)
        assert delta("tether:time_to_first_token_seconds_count") == len(CASES)
        assert delta("tether:time_to_first_token_seconds_bucket", le="+Inf") == len(CASES)
        assert delta("tether:e2e_request_latency_seconds_count") == len(CASES)
        assert delta("tether:inter_token_latency_seconds_count") == sum(n - 1 for n in generated)
        assert delta("tether:request_success_total", finished_reason="length") == len(CASES)
        assert delta("tether:time_to_first_token_seconds_sum") > 0
        # every request's e2e latency covers its TTFT
        assert delta("tether:e2e_request_latency_seconds_sum") >= delta("tether:time_to_first_token_seconds_sum")
        assert value(a, "tether:admission_ready") == 1
        assert value(a, "tether:admission_requests_in_flight") == 0
        return a
    poll(admission_counted)

    def coordinator_counted():
        c, c0 = scrape(mcluster.service("coordinator").metrics_url)[0], before["coordinator"]

        def delta(name: str) -> float:
            return value(c, name) - value(c0, name)
        assert delta("tether:request_queue_time_seconds_count") == len(CASES)
        assert delta("tether:engine_generation_tokens_total") == sum(generated)
        assert delta("tether:engine_requests_finished_total") == len(CASES)
        assert delta("tether:engine_requests_failed_total") == 0
        assert value(c, "tether:num_requests_running") == 0
        assert value(c, "tether:num_requests_waiting") == 0
        assert value(c, "tether:pipeline_serving") == 1
        assert value(c, "tether:kv_blocks_total") > 0
        assert total(c, "tether:integrity_rejections_total") == 0
        assert value(c, "tether:rebuilds_total") == 0
        # every context token the engine started is a prompt token here (no preemption on an idle pipeline)
        assert delta("tether:engine_prompt_tokens_total") == prompt_tokens
    poll(coordinator_counted)

    def stages_counted():
        for name in ("stage0", "stage1"):
            s, s0 = scrape(mcluster.service(name).metrics_url)[0], before[name]
            assert value(s, "tether:stage_steps_total") > value(s0, "tether:stage_steps_total"), name
            assert value(s, "tether:stage_busy_seconds_total") > value(s0, "tether:stage_busy_seconds_total")
            assert value(s, "tether:stage_kv_blocks_total") > 0, name
            assert value(s, "tether:stage_requests_held") == 0, name     # every request released
            assert total(s, "tether:stage_rejections_total") == 0, name
            assert value(s, "process_resident_memory_bytes") > 0, name
    poll(stages_counted)


def test_shed_requests_are_counted_by_reason(mcluster):
    url = mcluster.service("admission").metrics_url
    before = scrape(url)[0]

    async def run():
        async with AsyncClient(mcluster.target, timeout=30, retry=None) as client:
            with pytest.raises(InvalidArgument):
                await client.generate("hello", max_tokens=4, temperature=99.0)   # over MAX_TEMPERATURE
    asyncio.run(run())

    def counted():
        after = scrape(url)[0]
        assert value(after, "tether:requests_shed_total", reason="invalid") \
            - value(before, "tether:requests_shed_total", reason="invalid") == 1
        # refused before the coordinator: not a request of any tenant, no latency observed
        assert total(after, "tether:requests_total") == total(before, "tether:requests_total")
        assert value(after, "tether:time_to_first_token_seconds_count") \
            == value(before, "tether:time_to_first_token_seconds_count")
    poll(counted)


def test_every_exposed_name_is_known_and_every_known_name_is_exposed(mcluster):
    """metric_names() (what the Grafana dashboard and docs are checked against) is exactly what is served."""
    exposed: set[str] = set()
    for name in SERVICES:
        exposed |= {n for n in scrape(mcluster.service(name).metrics_url)[1] if n.startswith("tether:")}
    histograms = {n.removesuffix("_bucket") for n in metric_names() if n.endswith("_bucket")}
    known = {n for n in metric_names() if not n.endswith(("_bucket", "_sum", "_count"))} | histograms
    assert exposed == known


def test_json_logs_carry_the_request_id(mcluster):
    send(mcluster.target)
    for name in SERVICES:
        svc = mcluster.service(name)

        def parsed(svc=svc, name=name) -> list[dict]:
            lines = [ln for ln in svc.log_path.read_text().splitlines() if ln.strip()]
            out = []
            for ln in lines:
                try:
                    out.append(json.loads(ln))
                except json.JSONDecodeError:
                    raise AssertionError(f"{name}: a log line is not JSON: {ln!r}") from None
            assert any("listening on" in r["message"] for r in out), name
            return out
        records = poll(parsed)
        for r in records:
            assert {"ts", "level", "service", "logger", "message"} <= set(r), r
            assert r["service"] == ("stage" if name.startswith("stage") else name)

    def access_lines():
        records = [json.loads(ln) for ln in mcluster.service("admission").log_path.read_text().splitlines()
                   if ln.strip()]
        ended = [r for r in records if r["message"].startswith("request ") and " ended: " in r["message"]]
        assert len(ended) >= len(CASES)
        for r in ended:
            assert len(r["request_id"]) == 32 and r["request_id"] in r["message"], r
        labelled = [r for r in ended if r.get("label") == "label-5"]
        assert labelled, "the caller's label travels with the request's lines"
    poll(access_lines)
