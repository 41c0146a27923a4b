"""Blocking client of the Admission service."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from tether.client.errors import from_rpc_error
from tether.client.receipt import Sent
from tether.client.wire import (Messages, StreamAssembler, encode_messages, encode_prompt, result_from_response,
                                sent_and_request, tag_request, tags_dict)
from tether.grpcutil import KEEPALIVE_OPTIONS, message_options
from tether import settings
from tether.types import Delta, GenerateResult
from tether.v1 import admission_pb2, admission_pb2_grpc


class Stream:
    """Tokens of one request as they are generated.

    Iterate it (once) for `Delta`s. When iteration ends, `.result` holds the whole `GenerateResult` with its
    receipt checked; `.tags` (dict) and `.seed` (the sampling seed used) are set from the first chunk on.
    Stopping early (break) or `cancel()` cancels the request on the server.
    Raises TetherError subclasses, ReceiptMismatch included, from the iteration.
    """

    def __init__(self, call: grpc.Call, prompt: Sent, request_id: str) -> None:
        self._call = call
        self._assembler = StreamAssembler(prompt, request_id)
        self.result: GenerateResult | None = None

    @property
    def tags(self) -> dict[str, Any]:
        return self._assembler.tags

    @property
    def seed(self) -> int:
        return self._assembler.seed

    @property
    def internal_id(self) -> str:
        """The id admission minted for this request (set with the first token; "" before)."""
        return self._assembler.internal_id

    def __iter__(self) -> Iterator[Delta]:
        try:
            for chunk in self._call:
                yield self._assembler.add(chunk)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            self._call.cancel()  # a no-op once the call completed
        self.result = self._assembler.finish()

    def cancel(self) -> None:
        self._call.cancel()


class Client:
    """`Client("127.0.0.1:50051")`: generate, stream and tag against an admission service.

    `timeout` (seconds) bounds every call; None waits as long as the server takes. Use as a context manager
    or call `close()`.
    """

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None) -> None:
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=message_options(settings.GRPC_MAX_MESSAGE_BYTES) + KEEPALIVE_OPTIONS)
        self._stub = admission_pb2_grpc.AdmissionStub(self._channel)

    def generate(self, prompt: str | bytes, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
                 tenant: str = "", priority: str = "", request_id: str = "") -> GenerateResult:
        """The whole answer, receipt checked. `prompt` str is sent as UTF-8, bytes as they are."""
        sent, request = sent_and_request(prompt, None, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, tenant=tenant,
                                         priority=priority, request_id=request_id)
        return self._unary(request, sent, request_id)

    def chat(self, messages: Messages, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
             tenant: str = "", priority: str = "", request_id: str = "") -> GenerateResult:
        """The assistant's reply to a conversation, receipt checked; other parameters as `generate`.

        `messages`: [{"role": "user", "content": "Hi"}, ...] or [("user", "Hi"), ...]; roles system (first
        message only), user and assistant, the last one the user's. Admission renders them with the model's
        chat template; a conversation over the model's limits is refused (InvalidArgument), never truncated.
        """
        sent, request = sent_and_request(None, messages, max_tokens=max_tokens, temperature=temperature,
                                         top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos,
                                         tenant=tenant, priority=priority, request_id=request_id)
        return self._unary(request, sent, request_id)

    def stream(self, prompt: str | bytes, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
               tenant: str = "", priority: str = "", request_id: str = "") -> Stream:
        """Start a request and return its `Stream` (see there); same parameters as `generate`."""
        sent, request = sent_and_request(prompt, None, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, tenant=tenant,
                                         priority=priority, request_id=request_id)
        return Stream(self._stub.GenerateStream(request, timeout=self.timeout), sent, request_id)

    def stream_chat(self, messages: Messages, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
                    tenant: str = "", priority: str = "", request_id: str = "") -> Stream:
        """Start the assistant's reply to a conversation (as `chat`) and return its `Stream`."""
        sent, request = sent_and_request(None, messages, max_tokens=max_tokens, temperature=temperature,
                                         top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos,
                                         tenant=tenant, priority=priority, request_id=request_id)
        return Stream(self._stub.GenerateStream(request, timeout=self.timeout), sent, request_id)

    def tag(self, prompt: str | bytes | None = None, max_tokens: int = 64, tenant: str = "", priority: str = "",
            *, messages: Messages | None = None) -> dict[str, Any]:
        """The intent tags admission would give this prompt or conversation, without generating (dry run)."""
        pairs = encode_messages(messages) if messages is not None else ()
        data = encode_prompt(prompt) if prompt is not None else b""
        request = tag_request(data, max_tokens=max_tokens, tenant=tenant, priority=priority, messages=pairs)
        try:
            return tags_dict((self._stub.Tag(request, timeout=self.timeout)).tags)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _unary(self, request: admission_pb2.GenerateRequest, sent: Sent, request_id: str) -> GenerateResult:
        try:
            response = self._stub.Generate(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return result_from_response(response, sent, request_id)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
