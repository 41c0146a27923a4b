"""The OpenAI request bodies admission accepts, typed (pydantic), and nothing else.

Every field OpenAI defines that tether does not implement is declared here only to refuse a value other than
its neutral one (`n` other than 1, any tools, a response_format other than text, ...): a client that asks for
something gets a 400 naming the field, never an answer that silently ignored it. A field OpenAI does not
define at all is refused the same way (`extra="forbid"`), except tether's own: `priority`, `request_id`,
`tenant`, `top_k`, `ignore_eos` and `return_token_ids`, which the official clients send through `extra_body`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Stop = str | list[str] | None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]   # image_url, input_audio, file: a 400 that names the part's type
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # "developer" is OpenAI's newer name for "system" (o1 onwards): the same instruction, rendered as system.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None   # accepted as the clients send it; the chat templates tether renders have no use for it


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]   # json_object, json_schema: not implemented, refused by name


class _Sampling(BaseModel):
    """The fields chat and completions share: sampling, streaming and tether's own."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)   # OpenAI's end-user label: logged nowhere, accepted
    n: Literal[1] = 1
    presence_penalty: Literal[0, 0.0] | None = None   # type: ignore[valid-type]  # pydantic checks a float literal; typing's take no floats
    frequency_penalty: Literal[0, 0.0] | None = None  # type: ignore[valid-type]  # (the same)
    logprobs: Literal[False] | None = None
    # tether's own (extra_body)
    priority: str | None = None
    request_id: str | None = None
    tenant: str | None = None
    top_k: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False          # as vLLM's: keep generating past end-of-sequence (benchmarks' fixed lengths)
    return_token_ids: bool = False    # as vLLM's: each choice / delta also carries its token ids (`tether bench`'s audit)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = Field(default=None, max_length=0)
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None
