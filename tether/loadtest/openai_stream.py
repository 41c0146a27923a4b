"""`tether bench --api openai`: the load generator's client over admission's OpenAI-compatible HTTP API, with
the official `openai` client (the one users' harnesses use), shaped like `AsyncClient.stream` so the same
workloads, timing, audit and report run through either face.

Each request is a streamed `/v1/completions` with tether's `return_token_ids` (every chunk carries its token
id, so the audit replays the very ids served) and `ignore_eos` when the workload asks; the receipt, tags, seed
and tether's own finish reason come from the final chunk's `tether` object. An HTTP error becomes the
TetherError of the gRPC status it stands for, so failures are counted by the same names.
"""

from __future__ import annotations

import os

import grpc

from tether.client import TetherError
from tether.types import GenerateResult, Receipt

# The HTTP status admission answers for each gRPC status (docs/PROTOCOL.md), read back.
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ALREADY_EXISTS,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
         504: grpc.StatusCode.DEADLINE_EXCEEDED}


class AsyncOpenAIClient:
    """What both OpenAI-API load clients share (admission's face here, llama.cpp's server in
    llama_cpp_client.py): the official async client, the served model's name read on entry, and `stream`
    making the subclass's `STREAM` for one request."""

    STREAM: type["StreamBase"]

    def __init__(self, base_url: str, timeout: float, api_key: str = "unused") -> None:
        import openai   # the bench extra; only these modes need it
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
        self.openai = openai
        self.model = ""

    async def __aenter__(self):
        self.model = (await self.client.models.list()).data[0].id
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    def stream(self, prompt: str, **params) -> "StreamBase":
        return self.STREAM(self, prompt, params)


def tether_error(openai, e: Exception) -> TetherError | None:
    """The TetherError an `openai` client error stands for (HTTP status read back as its gRPC status), or None."""
    if isinstance(e, openai.APIStatusError):
        message = (e.body or {}).get("message", str(e)) if isinstance(e.body, dict) else str(e)
        return TetherError(message, CODES.get(e.status_code, grpc.StatusCode.INTERNAL))
    if isinstance(e, openai.APITimeoutError):
        return TetherError(str(e), grpc.StatusCode.DEADLINE_EXCEEDED)
    if isinstance(e, openai.APIConnectionError):
        return TetherError(str(e), grpc.StatusCode.UNAVAILABLE)
    return None


class StreamBase:
    """One streamed request, iterated for its token ids; `result` (and `tags`) once it ends."""

    def __init__(self, owner, prompt: str, params: dict) -> None:
        self.owner, self.prompt, self.params = owner, prompt, params
        self.result: GenerateResult | None = None
        self.tags: dict = {}

    def __aiter__(self):
        return self._run()

    def _run(self):
        raise NotImplementedError


class _Stream(StreamBase):
    async def _run(self):
        p, o = self.params, self.owner
        text: list[str] = []
        ids: list[int] = []
        tether: dict = {}
        try:
            stream = await o.client.completions.create(
                model=o.model, prompt=self.prompt, max_tokens=p["max_tokens"], temperature=p["temperature"],
                top_p=p["top_p"] or None, seed=p["seed"] or None, stream=True,
                extra_body={"top_k": p["top_k"], "ignore_eos": p["ignore_eos"], "return_token_ids": True})
            async for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                extra = choice.model_extra or {}
                for token_id in extra.get("token_ids") or ():
                    ids.append(token_id)
                    text.append(choice.text)
                    yield token_id
                if choice.finish_reason:
                    tether = (chunk.model_extra or {}).get("tether") or {}
        except o.openai.OpenAIError as e:
            error = tether_error(o.openai, e)
            if error is None:
                raise
            raise error from None
        r = tether.get("receipt")
        if r is None:
            raise TetherError("the stream ended without its final chunk (no tether receipt)", grpc.StatusCode.INTERNAL)
        self.tags = tether.get("tags", {})
        receipt = Receipt(r["request_id"], int(r["prompt_digest"], 16), r["prompt_tokens"],
                          int(r["context_hash"], 16), r["output_tokens"], r["model_fingerprint"], r["internal_id"])
        self.result = GenerateResult("".join(text), ids, tether.get("finish_reason", ""), receipt, self.tags,
                                     tether.get("seed", 0))


class OpenAIStreamClient(AsyncOpenAIClient):
    """`async with OpenAIStreamClient(base_url) as c: async for _ in (s := c.stream(prompt, ...))`: s.result."""

    STREAM = _Stream

    def __init__(self, base_url: str, timeout: float, api_key: str | None = None) -> None:
        super().__init__(base_url, timeout, api_key or os.environ.get("TETHER_API_KEY") or "unused")
