"""The HTTP face's pure translation (services/admission/openai_api/translate.py, schema.py): bodies to
GenerateRequests, refusals to OpenAI's statuses and Retry-After, and the fields it refuses by name."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from services.admission.openai_api.schema import ChatCompletionRequest, CompletionRequest
from services.admission.openai_api.translate import (BadRequest, Shape, generate_request, rejected_response,
                                                     validation_message)
from services.admission.status import Rejected
from tether.v1 import common_pb2

MSG = [{"role": "user", "content": "hi"}]


def test_a_chat_body_becomes_the_generate_request_it_means():
    body = ChatCompletionRequest.model_validate({
        "model": "tiny", "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "x",
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "你"}, {"type": "text", "text": "好"}]}]})
    r = generate_request(body, "label-1", "sheddable")
    assert (r.sampling.max_tokens, r.sampling.seed, list(r.sampling.stop)) == (7, 3, ["x"])
    assert r.sampling.temperature == pytest.approx(0.5) and r.sampling.top_p == pytest.approx(0.9)
    assert [(m.role, m.content.decode()) for m in r.messages] == [("system", "be brief"), ("user", "你好")]
    assert (r.request_id, r.priority) == ("label-1", "sheddable")
    # OpenAI's default temperature is 1: unset means sampling, not greedy
    assert generate_request(ChatCompletionRequest.model_validate({"messages": MSG}), "", "").sampling.temperature == 1


def test_a_completion_takes_one_prompt_only():
    assert generate_request(CompletionRequest.model_validate({"prompt": ["a"], "max_tokens": 2}), "", "").prompt == b"a"
    with pytest.raises(BadRequest) as e:
        generate_request(CompletionRequest.model_validate({"prompt": ["a", "b"]}), "", "")
    assert e.value.param == "prompt"


@pytest.mark.parametrize("extra,param", [
    ({"n": 3}, "n"), ({"tools": [{"type": "function"}]}, "tools"), ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.type"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"guided_regex": "a+"}, "guided_regex"), ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
])
def test_what_tether_does_not_implement_is_refused_by_name(extra, param):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": MSG, **extra})
    bad = validation_message(e.value)
    assert bad.param == param and param.split(".")[0].split("[")[0] in bad.message


def test_neutral_values_of_unimplemented_fields_are_accepted():
    ChatCompletionRequest.model_validate({"messages": MSG, "n": 1, "tools": [], "presence_penalty": 0,
                                          "response_format": {"type": "text"}, "logprobs": False})


@pytest.mark.parametrize("code,status", [(grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.UNAUTHENTICATED, 401),
                                         (grpc.StatusCode.PERMISSION_DENIED, 403), (grpc.StatusCode.ALREADY_EXISTS, 409),
                                         (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
                                         (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500)])
def test_statuses_map_to_what_the_sdks_act_on(code, status):
    got, body, headers = rejected_response(Rejected(code, "why"))
    assert got == status and body["error"]["message"] == "why" and headers == {}


def test_retry_info_becomes_retry_after_rounded_up_and_exact_in_ms():
    _, _, headers = rejected_response(Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 0.25))
    assert headers == {"retry-after": "1", "retry-after-ms": "250"}


def test_stream_chunks_have_openai_s_shape():
    s = Shape(True, "chatcmpl-x", 1, "tiny", "fp")
    assert s.chunk(role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    done = s.chunk(finish=common_pb2.FINISH_REASON_EOS, with_usage=True, tether={"k": 1})
    assert done["choices"][0]["finish_reason"] == "stop" and done["usage"] is None and done["tether"] == {"k": 1}
    assert s.chunk(finish=common_pb2.FINISH_REASON_CONTEXT)["choices"][0]["finish_reason"] == "length"
    assert Shape(False, "cmpl-x", 1, "tiny", "fp").chunk("a")["object"] == "text_completion"
