"""The OpenAI-compatible HTTP API end to end, through the official `openai` client (real processes on loopback,
tiny model, 2 stages, one cluster for the module): answers equal `tether.reference` token for token (decoded
text, usage counts and the receipt's context hash, which covers every token id), streamed and not, greedy and
seeded, 64 at once; every error row arrives as the client's own exception class; a dropped stream releases
its state on every stage; the README's curl examples run as shown."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from services.admission.auth import key_digest
from tests.helpers import coordinator_running, stage_state, started, tenants_file
from tether import reference
from tether.cli.cluster import LocalCluster, free_port
from tether.client.wire import encode_messages
from tether.protocol.hashing import messages_digest, prompt_digest

KEY = "tk_test-acme-" + "a" * 32
KEY_LIMITED = "tk_test-limited-" + "l" * 32
ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["Say hello.", "写一首关于春天的短诗。", "What is the capital of France?", "用一句话解释重力。",
           "List three colours.", "今天天气怎么样？", "Count to five.", "请把这句话翻译成英文：我喜欢读书。"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tenants = tenants_file(tmp_path_factory, f"""
[tenants.acme]
api_keys_sha256 = ["{key_digest(KEY)}"]
[tenants.limited]
api_keys_sha256 = ["{key_digest(KEY_LIMITED)}"]
requests_per_s = 0.25
burst_s = 4
""")
    with started(tmp_path_factory, extra={"admission": ["--tenants", str(tenants)]}) as c:
        yield c


def client(cluster: LocalCluster, key: str = KEY, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key=key, **kw)


def chat_reference(messages: list[dict], max_tokens: int, temperature: float = 0.0, seed: int = 0):
    return reference.chat(messages, "tiny", max_tokens=max_tokens, temperature=temperature, seed=seed,
                          namespace="acme")


def check(ref, text: str, usage, tether: dict, digest: int) -> None:
    assert text == ref.text
    assert (usage.prompt_tokens, usage.completion_tokens) == (ref.receipt.prompt_tokens, len(ref.token_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    r = tether["receipt"]
    assert int(r["context_hash"], 16) == ref.receipt.context_hash   # covers every token id, in order
    assert int(r["prompt_digest"], 16) == digest
    assert (r["prompt_tokens"], r["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert r["model_fingerprint"] == ref.receipt.model_fingerprint


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 1234)], ids=["greedy", "seeded"])
def test_chat_and_completions_equal_the_reference(cluster, temperature, seed):
    c = client(cluster)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好，介绍一下你自己。"}]
    ref = chat_reference(messages, 12, temperature, seed)
    digest = messages_digest(encode_messages(messages))
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=temperature,
                                  seed=seed or None, extra_body={"request_id": f"chat-{seed}"})
    assert r.object == "chat.completion" and r.model == "tiny" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    check(ref, r.choices[0].message.content, r.usage, r.tether, digest)
    assert r.tether["receipt"]["request_id"] == f"chat-{seed}"
    assert r.tether["tags"]["language"] == "zh" and r.tether["seed"] == seed

    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=temperature,
                                            seed=seed or None, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and chunks[-1].choices == [] and chunks[-1].usage is not None
    check(ref, text, chunks[-1].usage, finish[0].tether, digest)

    prompt = "The capital of France is"
    pref = reference.generate(prompt, "tiny", max_tokens=10, temperature=temperature, seed=seed, namespace="acme")
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=temperature, seed=seed or None)
    assert r.object == "text_completion"
    check(pref, r.choices[0].text, r.usage, r.tether, prompt_digest(prompt.encode()))
    chunks = list(c.completions.create(model="tiny", prompt=[prompt], max_tokens=10, temperature=temperature,
                                       seed=seed or None, stream=True, stream_options={"include_usage": True}))
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    check(pref, "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage, finish[0].tether,
          prompt_digest(prompt.encode()))


def test_return_token_ids_and_ignore_eos_give_the_served_ids(cluster):
    """tether's extras (as vLLM's): the ids `tether bench --api openai` audits, streamed and not."""
    prompt = "Once upon a time"
    want = reference.generate(prompt, "tiny", max_tokens=12, ignore_eos=True, namespace="acme")
    c = client(cluster)
    extra = {"return_token_ids": True, "ignore_eos": True}
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
    assert r.choices[0].model_extra["token_ids"] == want.token_ids and r.tether["finish_reason"] == "length"
    ids = [i for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            extra_body=extra) for i in ch.choices[0].model_extra.get("token_ids") or []]
    assert ids == want.token_ids


def test_64_concurrent_streamed_chats_each_exact(cluster):
    jobs = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(64)]   # each prompt 8 times
    refs = {p: chat_reference([{"role": "user", "content": p}], 16) for p in PROMPTS}

    async def one(c: openai.AsyncOpenAI, messages: list[dict]) -> tuple[str, object, dict]:
        stream = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, usage, tether = [], None, None
        async for ch in stream:
            if ch.choices:
                text.append(ch.choices[0].delta.content or "")
                if ch.choices[0].finish_reason:
                    tether = ch.tether
            if ch.usage is not None:
                usage = ch.usage
        return "".join(text), usage, tether

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, m) for m in jobs))

    for messages, (text, usage, tether) in zip(jobs, asyncio.run(run())):
        p = messages[0]["content"]
        check(refs[p], text, usage, tether, messages_digest(encode_messages(messages)))


def test_sse_wire_format_is_openai_s(cluster):
    """Raw bytes: `data: {json}` events separated by a blank line, role delta first, finish chunk with the
    receipt, usage chunk, `data: [DONE]`; the x-request-id header echoed."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "用一句话解释重力。"}], "max_tokens": 8,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", f"{cluster.base_url}/chat/completions", json=body,
                      headers={"authorization": f"Bearer {KEY}", "x-request-id": "wire-1"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-request-id"] == "wire-1"
            raw = b"".join(r.iter_bytes())
    events = [e for e in raw.decode("utf-8").split("\n\n") if e and not e.startswith(":")]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events[:3]
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(o["object"] == "chat.completion.chunk" and o["id"] == objs[0]["id"] for o in objs)
    assert objs[-2]["choices"][0]["finish_reason"] in ("stop", "length") and "receipt" in objs[-2]["tether"]
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == objs[-2]["tether"]["receipt"]["output_tokens"]
    assert all(o["usage"] is None for o in objs[:-1])
    assert objs[-2]["tether"]["receipt"]["request_id"] == "wire-1"


def test_models_and_health(cluster):
    models = client(cluster).models.list().data
    assert [(m.id, m.owned_by) for m in models] == [("tiny", "tether")] and models[0].max_model_len > 0
    with httpx.Client(timeout=10) as h:
        assert h.get(cluster.base_url.removesuffix("/v1") + "/health").status_code == 200
        r = h.get(f"{cluster.base_url}/nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_error_rows_reach_the_client_as_its_exceptions(cluster):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        client(cluster, key="tk_wrong-" + "x" * 30, max_retries=0).chat.completions.create(model="tiny", messages=msgs)
    r = httpx.post(f"{cluster.base_url}/chat/completions", json={"model": "tiny", "messages": msgs}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"   # no key at all
    c = client(cluster, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="tenant"):
        c.chat.completions.create(model="tiny", messages=msgs, extra_body={"tenant": "limited"})
    with pytest.raises(openai.PermissionDeniedError, match="critical"):
        c.chat.completions.create(model="tiny", messages=msgs, extra_body={"priority": "critical"})
    for kwargs, param in [({"n": 2}, "n"), ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                          ({"response_format": {"type": "json_object"}}, "response_format.type"),
                          ({"extra_body": {"guided_json": {}}}, "guided_json"),
                          ({"max_tokens": 10**9}, None)]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=msgs, **kwargs)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
        if param:
            assert e.value.body["param"] == param and param.split(".")[0] in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="image_url|content"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=msgs)
    # 504: a deadline (x-request-timeout) long enough to start, far too short for 2000 tokens
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2000, temperature=0,
                                  extra_headers={"x-request-timeout": "1.5"})
    assert e.value.status_code == 504 and time.monotonic() - started < 10


def test_label_in_flight_is_409(cluster):
    c = client(cluster, max_retries=0)
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count to fifty."}],
                                       max_tokens=200, stream=True, extra_body={"request_id": "busy-label"})
    try:
        next(iter(stream))   # the first request holds the label now
        with pytest.raises(openai.ConflictError):
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                      extra_headers={"x-request-id": "busy-label"})
    finally:
        stream.close()


def test_rate_limit_is_429_with_retry_after_that_the_client_honours(cluster):
    """The limited tenant's bucket holds one request and refills in 4 s (far longer than two calls take): the second call is a 429 whose
    Retry-After the official client waits out before its retry succeeds."""
    c = client(cluster, key=KEY_LIMITED, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)   # takes the bucket's one request
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    headers = e.value.response.headers
    assert 0 < int(headers["retry-after-ms"]) <= 4000 and 1 <= int(headers["retry-after"]) <= 4
    seen: list[tuple[int, float, str | None]] = []   # every attempt's status, when, and its retry-after-ms
    hook = {"response": [lambda r: seen.append((r.status_code, time.monotonic(), r.headers.get("retry-after-ms")))]}
    retrying = openai.OpenAI(base_url=cluster.base_url, api_key=KEY_LIMITED, max_retries=3,
                             http_client=httpx.Client(event_hooks=hook, timeout=60))
    r = retrying.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert r.usage.completion_tokens == 1
    assert [s for s, _, _ in seen] == [429, 200], seen          # refused once (the bucket is still empty), then served
    waited, asked = seen[1][1] - seen[0][1], int(seen[0][2]) / 1000
    assert waited >= 0.9 * asked, f"the client retried after {waited:.2f} s; Retry-After asked {asked:.2f} s"
def test_a_dropped_stream_is_cancelled_and_released_everywhere(cluster):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", f"{cluster.base_url}/chat/completions", json=body,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]   # a few tokens in: the request is running on every stage
            assert any(line.startswith("data: ") for line in got)
            assert coordinator_running(cluster)[0] == 1
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while (stage_state(cluster), coordinator_running(cluster)) != ([(0, 0), (0, 0)], (0, 0)):
        assert time.monotonic() < deadline, (stage_state(cluster), coordinator_running(cluster))
        time.sleep(0.1)


def test_not_ready_is_503_on_requests_and_health(tmp_path):
    """An admission with no coordinator behind it: /health and every request answer 503."""
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.admission", "--model", "tiny", "--port", str(port),
                             "--http-port", str(http_port), "--coordinator", f"127.0.0.1:{free_port()}",
                             "--tag-workers", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"{base}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        assert health.status_code == 503 and "not ready" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError) as e:
            openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_readme_curl_examples_run_as_shown(cluster):
    """Every ```sh block of README.md's OpenAI section that calls curl, with the base URL and key of this cluster."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The OpenAI-compatible API"):]
    section = section[:section.index("\n## ", 5)]
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", section, re.S) if b.lstrip().startswith("curl")]
    assert len(blocks) >= 2
    for block in blocks:
        cmd = block.replace("http://localhost:8000/v1", cluster.base_url).replace("$TETHER_API_KEY", KEY)
        out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (block, out.stderr)
        if '"stream": true' in block:
            assert out.stdout.rstrip().endswith("data: [DONE]"), out.stdout[-300:]
        else:
            assert "choices" in json.loads(out.stdout), out.stdout
