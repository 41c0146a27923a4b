"""bench/chat_clients.py against tether's real HTTP face (the shared cluster): the lean httpx2 client reads what the
official `openai` client reads, and fails with the same gRPC status names."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.chat_clients import CLIENTS, HttpChatClient, OpenAIChatClient, chat_body, wire_body
from tether.cli.cluster import free_port
from tether.client import TetherError

PARAMS = dict(max_tokens=12, temperature=0.0, top_p=0.0, top_k=0, seed=0, ignore_eos=False)


async def _answers(client_type, base_url: str, requests: list[tuple[str, dict]]) -> list[tuple]:
    out = []
    async with client_type(base_url, "tether") as c:
        for prompt, params in requests:
            s = c.stream(prompt, **params)
            chunks = [x async for x in s]
            r = s.result
            out.append((r.text, r.finish_reason, len(r.token_ids), r.receipt.prompt_tokens, len(chunks) > 0))
    return out


def test_the_lean_client_reads_what_the_official_one_reads(cluster):
    """Greedy and seeded answers, EOS honoured and ignored: the same text, finish reason and usage counts."""
    requests = [("Hello there", PARAMS), ("Count to ten", {**PARAMS, "ignore_eos": True, "max_tokens": 9}),
                ("Say something", {**PARAMS, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 7}),
                ("Another one", {**PARAMS, "temperature": 0.7, "seed": 3, "max_tokens": 1})]
    lean = asyncio.run(_answers(HttpChatClient, cluster.base_url, requests))
    official = asyncio.run(_answers(OpenAIChatClient, cluster.base_url, requests))
    assert lean == official
    assert lean[1][2] == 9 and lean[3][2] == 1   # the counts are the server's usage


def test_the_wire_body_is_what_the_official_client_sends():
    params = {**PARAMS, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 5, "ignore_eos": True}
    body = wire_body("m", "hi", params, "llama-server")
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 5,
                    "stream_options": {"include_usage": True}, "top_k": 40, "min_p": 0.0, "repeat_penalty": 1.0,
                    "ignore_eos": True}
    assert set(body) - {"model", "messages", "stream"} == \
        (set(chat_body(params, "llama-server")) - {"extra_body"}) | set(chat_body(params, "llama-server")["extra_body"])


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_refusal_is_the_tether_error_of_its_status(cluster, client):
    """A request admission refuses (400: a negative temperature) is INVALID_ARGUMENT with the server's message,
    through either client."""
    with pytest.raises(TetherError) as e:
        asyncio.run(_answers(CLIENTS[client], cluster.base_url, [("hi", {**PARAMS, "temperature": -1.0})]))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in str(e.value)


def test_no_server_is_unavailable():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(TetherError) as e:
        asyncio.run(_answers(HttpChatClient, url, [("hi", PARAMS)]))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_refused_models_request_is_its_status_and_leaves_no_client_open(cluster):
    """The base URL without /v1: /models is NOT_FOUND on entry, and the client's connections are closed."""
    c = HttpChatClient(cluster.base_url.removesuffix("/v1"), "tether")
    with pytest.raises(TetherError) as e:
        asyncio.run(c.__aenter__())
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert c.http.is_closed


def test_an_error_body_is_read_as_json_or_quoted_as_it_came():
    from bench.chat_clients import _error_of
    e = _error_of(429, b'{"error": {"message": "slow down", "type": "rate_limit_error"}}')
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "slow down" in str(e)
    e = _error_of(503, b"<html>bad gateway</html>")
    assert e.code == grpc.StatusCode.UNAVAILABLE and "bad gateway" in str(e)
    assert _error_of(500, {"error": {"message": "mid-stream"}}).code == grpc.StatusCode.INTERNAL
