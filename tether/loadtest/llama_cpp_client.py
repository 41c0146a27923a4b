"""The llama.cpp baseline's load client: the official `openai` client streaming `/v1/completions` from
llama-cpp-python's server (llama_cpp_server.py), shaped like `AsyncClient.stream` so the load generator times
it exactly as it times tether (TTFT at the first token, TPOT, ITL).

The sampling is the request's own, mapped to llama.cpp's meaning: greedy at temperature 0; llama.cpp's own
defaults that tether does not have (top_k 40, min_p 0.05, repeat_penalty 1.1) are switched off; top_p 0 (off in
tether) is 1; `ignore_eos` is a logit bias of -100 on every EOS id (llama.cpp has no such flag).

llama.cpp's stream names no token ids and sends a character split over several tokens as one chunk, so the
count of output tokens is the budget when it finished on length (exact: it stopped at max_tokens) and the
answer re-encoded with the model's tokenizer (the GGUF's vocabulary) when it stopped on EOS; the ids recorded
are placeholders (-1) of that count: this side is timed, never audited.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc

from tether.client import TetherError
from tether.loadtest.openai_stream import AsyncOpenAIClient, StreamBase, tether_error
from tether.types import GenerateResult, Receipt

NO_ID = -1          # the placeholder id of a token llama.cpp streamed
EOS_BIAS = -100.0   # a logit bias that keeps a token from ever being sampled


def request_body(params: dict, eos_ids: Iterable[int]) -> dict:
    """The completion request's sampling fields (beyond prompt, max_tokens and stream) for llama.cpp."""
    body = dict(temperature=params["temperature"], top_p=params["top_p"] or 1.0, top_k=params["top_k"], min_p=0.0,
                repeat_penalty=1.0)
    if params["seed"]:
        body["seed"] = params["seed"]
    if params["ignore_eos"]:
        body["logit_bias"] = {str(t): EOS_BIAS for t in sorted(eos_ids)}
    return body


def output_tokens(text: str, finish_reason: str, max_tokens: int, encode: Callable[[str], list[int]]) -> int:
    """How many tokens an answer had: its budget when it ran to it, else its text re-encoded."""
    return max_tokens if finish_reason == "length" else len(encode(text))


class _Stream(StreamBase):
    async def _run(self):
        p, o = self.params, self.owner
        text: list[str] = []
        finish = ""
        chunks = 0
        try:
            stream = await o.client.completions.create(
                model=o.model, prompt=self.prompt, max_tokens=p["max_tokens"], stream=True,
                extra_body=request_body(p, o.eos_ids))
            async for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.finish_reason:
                    finish = choice.finish_reason
                    continue
                chunks += 1
                text.append(choice.text)
                yield NO_ID   # one chunk: one token or more (a split character); the loadgen times chunks
        except o.openai.OpenAIError as e:
            error = tether_error(o.openai, e)
            if error is None:
                raise
            raise error from None
        if not finish:
            raise TetherError("the llama.cpp stream ended without a finish reason", grpc.StatusCode.INTERNAL)
        answer = "".join(text)
        # Every chunk holds at least one token: the count is never below the chunks'.
        n = max(chunks, output_tokens(answer, finish, p["max_tokens"], o.encode))
        prompt_tokens = len(o.encode(self.prompt))
        self.result = GenerateResult(answer, [NO_ID] * n, finish, Receipt("", 0, prompt_tokens, 0, n, "llama.cpp"))


class LlamaCppStreamClient(AsyncOpenAIClient):
    """`async with LlamaCppStreamClient(base_url, ...) as c: async for _ in (s := c.stream(prompt, ...))`."""

    STREAM = _Stream

    def __init__(self, base_url: str, timeout: float, encode: Callable[[str], list[int]],
                 eos_ids: Iterable[int]) -> None:
        super().__init__(base_url, timeout)
        self.encode, self.eos_ids = encode, frozenset(eos_ids)
