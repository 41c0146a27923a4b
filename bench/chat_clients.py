"""The load clients of bench/llama_server_vs_tether.py: one streamed /v1/chat/completions per request, the same on
both sides, shaped like `AsyncClient.stream` so that tether's closed-loop load generator drives them.

- `HttpChatClient` (the default): httpx2 (the official `openai` client's own HTTP library) streaming the
  request, each SSE `data:` line read with `json.loads`. 0.19 ms of the client's CPU a streamed chunk, against
  0.37-0.43 ms through the `openai` client, which builds a pydantic object per chunk (a chat at 8 streams,
  tether's face, 2026-12-07). The load shares the servers' cores: its CPU is taken from whichever server runs,
  and twice as much of it from the one answering twice as fast, so the lighter client measures the servers,
  not itself.
- `OpenAIChatClient` (`--client openai`): the official client, as the figures before 2026-12-07 were measured.

Both send the same JSON body (the `openai` client merges `extra_body` into it) and count what each server's
`usage` says (stream_options.include_usage); an HTTP error or an `error` event is the TetherError of the gRPC
status it stands for (tether/loadtest/openai_stream.py's CODES), so failures are counted by the same names.
"""

from __future__ import annotations

import json

import grpc

from tether.client import TetherError
from tether.loadtest.openai_stream import CODES, AsyncOpenAIClient, StreamBase, tether_error
from tether.types import GenerateResult, Receipt

NO_ID = -1   # token ids are not compared here: only counted (each server's usage)

# Each side's extra request fields: tether forbids fields it does not define (extra="forbid"), and llama.cpp's
# samplers that tether does not have are switched off on llama-server (its defaults: min_p 0.05, repeat
# penalty 1.1; top_k is sent to both).
SIDE_EXTRA = {"tether": {}, "llama-server": {"min_p": 0.0, "repeat_penalty": 1.0}}


def chat_body(params: dict, side: str) -> dict:
    """The request's fields beyond model, messages and stream, for `side`: its own sampling on both.

    top_p 0 is tether's "off": tether is sent none (it refuses 0), llama-server 1.0 (its default is 0.95)."""
    body: dict = dict(max_tokens=params["max_tokens"], temperature=params["temperature"],
                      stream_options={"include_usage": True})
    top_p = params["top_p"] or None
    if side == "llama-server":
        top_p = top_p or 1.0
    if top_p is not None:
        body["top_p"] = top_p
    if params["seed"]:
        body["seed"] = params["seed"]
    extra = {"top_k": params["top_k"], **SIDE_EXTRA[side]}
    if params["ignore_eos"]:
        extra["ignore_eos"] = True
    body["extra_body"] = extra
    return body


def wire_body(model: str, prompt: str, params: dict, side: str) -> dict:
    """The JSON the `openai` client sends for `chat_body`: extra_body's fields at the top level."""
    body = chat_body(params, side)
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            **{k: v for k, v in body.items() if k != "extra_body"}, **body["extra_body"]}


def _result(side: str, text: list[str], finish: str, usage: dict | None) -> GenerateResult:
    if not finish:
        raise TetherError(f"the {side} stream ended without a finish reason", grpc.StatusCode.INTERNAL)
    if usage is None:
        raise TetherError(f"{side} sent no usage (stream_options.include_usage)", grpc.StatusCode.INTERNAL)
    n = usage["completion_tokens"]
    return GenerateResult("".join(text), [NO_ID] * n, finish, Receipt("", 0, usage["prompt_tokens"], 0, n, side))


def _error_of(status: int, body: bytes | dict) -> TetherError:
    """The TetherError of an OpenAI error body ({"error": {"message": ...}}) or event, with the HTTP status; a body
    that is not JSON is quoted as it came."""
    payload: object = body
    if isinstance(body, bytes):
        try:
            payload = json.loads(body)
        except ValueError:
            payload = body.decode(errors="replace")
    error = payload.get("error") if isinstance(payload, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return TetherError(str(message or payload)[:500], CODES.get(status, grpc.StatusCode.INTERNAL))


class _ChatStream(StreamBase):
    """One streamed chat: `_deltas` yields each chunk's (content, finish_reason, usage), any of them empty; here they
    are counted and checked the same way for both clients."""

    async def _run(self):
        text: list[str] = []
        finish = ""
        usage = None
        async for content, finished, used in self._deltas():
            usage = used or usage
            finish = finished or finish
            if content:
                text.append(content)
                yield NO_ID   # one chunk: one token (or a few, for a character split over tokens)
        self.result = _result(self.owner.side, text, finish, usage)

    def _deltas(self):
        raise NotImplementedError


class _HttpChatStream(_ChatStream):
    async def _deltas(self):
        import httpx2
        o = self.owner
        try:
            async with o.http.stream("POST", "/chat/completions",
                                     json=wire_body(o.model, self.prompt, self.params, o.side)) as r:
                if r.status_code != 200:
                    raise _error_of(r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue   # blank lines between events, comments, `event:` names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:   # a failure after the status line: an error event
                        raise _error_of(500, chunk)
                    choice = (chunk.get("choices") or [{}])[0]
                    yield (choice.get("delta") or {}).get("content"), choice.get("finish_reason"), chunk.get("usage")
        except httpx2.TimeoutException as e:
            raise TetherError(f"{o.side}: {e!r}", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except httpx2.TransportError as e:
            raise TetherError(f"{o.side}: {e!r}", grpc.StatusCode.UNAVAILABLE) from None


class HttpChatClient:
    """`async with HttpChatClient(base_url, side) as c: c.stream(prompt, **params)`: httpx2, one connection per
    request (`Connection: close`, as OpenAIChatClient), the served model's name read on entry."""

    STREAM = _HttpChatStream

    def __init__(self, base_url: str, side: str, timeout: float = 600.0) -> None:
        import httpx2
        self.http = httpx2.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout,
                                       headers={"Connection": "close", "Authorization": "Bearer unused"})
        self.side = side
        self.model = ""

    async def __aenter__(self) -> "HttpChatClient":
        import httpx2
        try:
            try:
                r = await self.http.get("/models")
            except httpx2.TransportError as e:
                raise TetherError(f"{self.side}: {e!r}", grpc.StatusCode.UNAVAILABLE) from None
            if r.status_code != 200:
                raise _error_of(r.status_code, r.content)
            self.model = r.json()["data"][0]["id"]
        except BaseException:   # no `async with` body runs, so no __aexit__: the client is closed here
            await self.http.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    def stream(self, prompt: str, **params) -> StreamBase:
        return self.STREAM(self, prompt, params)


class _OpenAIChatStream(_ChatStream):
    async def _deltas(self):
        o = self.owner
        try:
            stream = await o.client.chat.completions.create(
                model=o.model, messages=[{"role": "user", "content": self.prompt}], stream=True,
                **chat_body(self.params, o.side))
            async for chunk in stream:
                usage = chunk.usage.model_dump() if chunk.usage is not None else None
                choice = chunk.choices[0] if chunk.choices else None
                content = choice.delta.content if choice is not None and choice.delta is not None else None
                yield content, choice.finish_reason if choice is not None else None, usage
        except o.openai.OpenAIError as e:
            error = tether_error(o.openai, e)
            if error is None:
                raise
            cause = f" ({e.__cause__!r})" if e.__cause__ is not None else ""   # a connection error's own reason
            raise TetherError(error.message + cause, error.code) from None


class OpenAIChatClient(AsyncOpenAIClient):
    """The same load through the official `openai` client."""

    STREAM = _OpenAIChatStream

    def __init__(self, base_url: str, side: str, timeout: float = 600.0) -> None:
        super().__init__(base_url, timeout)
        # One connection per request on both sides (`Connection: close`): llama-server's HTTP pool closes a
        # kept-alive connection its dynamic threads served, without saying so, and the next request on it then
        # failed ("Server disconnected without sending a response", 1 in ~10 runs of 8 requests). A loopback
        # connect costs both sides the same.
        self.client = self.openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=timeout, max_retries=0,
                                              default_headers={"Connection": "close"})
        self.side = side


CLIENTS = {"httpx": HttpChatClient, "openai": OpenAIChatClient}
