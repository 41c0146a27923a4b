"""The SDK's receipt checks, without a server: pure functions and the stream assembler."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from tether.client.errors import (Aborted, InvalidArgument, ReceiptMismatch, ResourceExhausted, TetherError,
                                  Unavailable, from_rpc_error)
from tether.client.receipt import check_index, check_receipt
from tether.client.wire import StreamAssembler, result_from_response
from tether.protocol.hashing import prompt_digest
from tether.types import Receipt
from tether.v1 import admission_pb2, common_pb2

PROMPT = "你好, tether".encode()


def receipt(**overrides) -> Receipt:
    fields = dict(request_id="r-1", prompt_digest=prompt_digest(PROMPT), prompt_tokens=len(PROMPT),
                  context_hash=0x1234, output_tokens=3, model_fingerprint="abc")
    fields.update(overrides)
    return Receipt(**fields)


# ---- check_receipt / check_index ------------------------------------------------------------------------------

def test_matching_receipt_passes():
    check_receipt(receipt(), PROMPT, [1, 2, 3], request_id="r-1")
    check_receipt(receipt(request_id=""), PROMPT, [1, 2, 3])   # no label sent: the receipt echoes none


def test_prompt_digest_mismatch():
    with pytest.raises(ReceiptMismatch, match="prompt digest"):
        check_receipt(receipt(), PROMPT + b" ", [1, 2, 3], request_id="r-1")


def test_output_token_count_mismatch():
    with pytest.raises(ReceiptMismatch, match="3 output tokens, but 2 were received"):
        check_receipt(receipt(), PROMPT, [1, 2], request_id="r-1")


def test_a_label_this_client_did_not_send_is_a_mismatch():
    """The receipt echoes the caller's label as sent: an answer labelled for someone else is not ours."""
    with pytest.raises(ReceiptMismatch, match="'r-1'"):
        check_receipt(receipt(), PROMPT, [1, 2, 3])


def test_request_id_mismatch():
    with pytest.raises(ReceiptMismatch, match="'r-2'"):
        check_receipt(receipt(), PROMPT, [1, 2, 3], request_id="r-2")


@pytest.mark.parametrize("expected,index", [(0, 1), (2, 1), (2, 3)])
def test_index_gap_or_repeat(expected, index):
    with pytest.raises(ReceiptMismatch, match=f"index {index} arrived where {expected}"):
        check_index(expected, index)


def test_receipt_mismatch_is_a_tether_error_with_a_code():
    e = ReceiptMismatch("x")
    assert isinstance(e, TetherError) and e.code == grpc.StatusCode.DATA_LOSS and e.message == "x"


# ---- unary responses ------------------------------------------------------------------------------------------

def response(token_ids=(7, 8, 9), **receipt_overrides) -> admission_pb2.GenerateResponse:
    r = receipt(**receipt_overrides)
    return admission_pb2.GenerateResponse(
        text="abc", token_ids=list(token_ids), finish_reason=common_pb2.FINISH_REASON_LENGTH,
        receipt=common_pb2.Receipt(**vars(r)), tags=common_pb2.IntentTags(language="zh", output_budget=3))


def test_result_from_response():
    result = result_from_response(response(), PROMPT, "r-1")
    assert (result.text, result.token_ids, result.finish_reason) == ("abc", [7, 8, 9], "length")
    assert result.receipt == receipt()
    assert result.tags["language"] == "zh" and result.tags["output_budget"] == 3
    assert result.tags["prefix_key"] == 0   # every IntentTags field is present, defaults included


def test_response_without_receipt():
    r = response()
    r.ClearField("receipt")
    with pytest.raises(ReceiptMismatch, match="no receipt"):
        result_from_response(r, PROMPT, "r-1")


def test_response_with_foreign_prompt_digest():
    with pytest.raises(ReceiptMismatch, match="another prompt"):
        result_from_response(response(prompt_digest=prompt_digest(b"someone else's prompt")), PROMPT, "r-1")


# ---- streams --------------------------------------------------------------------------------------------------

def chunks(n: int = 3, **receipt_overrides) -> list[admission_pb2.GenerateChunk]:
    out = [admission_pb2.GenerateChunk(index=i, token_id=10 + i, text=f"t{i}") for i in range(n)]
    out[0].tags.CopyFrom(common_pb2.IntentTags(task="qa"))
    out[0].seed = 99
    out[-1].finish_reason = common_pb2.FINISH_REASON_EOS
    out[-1].receipt.CopyFrom(common_pb2.Receipt(**vars(receipt(**{"output_tokens": n, **receipt_overrides}))))
    return out


def test_stream_assembles_a_checked_result():
    a = StreamAssembler(PROMPT, "r-1")
    deltas = [a.add(c) for c in chunks()]
    assert [(d.index, d.token_id, d.text, d.finish_reason) for d in deltas] == [
        (0, 10, "t0", ""), (1, 11, "t1", ""), (2, 12, "t2", "eos")]
    result = a.finish()
    assert (result.text, result.token_ids, result.finish_reason) == ("t0t1t2", [10, 11, 12], "eos")
    assert a.tags["task"] == "qa" and result.tags == a.tags and a.seed == 99


def test_stream_with_skipped_index_fails_before_handing_out_the_token():
    a = StreamAssembler(PROMPT, "r-1")
    c = chunks()
    a.add(c[0])
    with pytest.raises(ReceiptMismatch, match="index 2 arrived where 1"):
        a.add(c[2])


def test_stream_whose_final_receipt_fails_raises_on_the_final_chunk():
    a = StreamAssembler(PROMPT, "r-1")
    c = chunks(output_tokens=5)
    a.add(c[0])
    a.add(c[1])
    with pytest.raises(ReceiptMismatch, match="5 output tokens, but 3"):
        a.add(c[2])


def test_stream_cut_short_has_no_result():
    a = StreamAssembler(PROMPT, "r-1")
    a.add(chunks()[0])
    with pytest.raises(ReceiptMismatch, match="ended after 1 tokens without a final chunk"):
        a.finish()


def test_chunk_after_the_final_one():
    a = StreamAssembler(PROMPT, "r-1")
    c = chunks(1)
    a.add(c[0])
    with pytest.raises(ReceiptMismatch, match="after the final one"):
        a.add(admission_pb2.GenerateChunk(index=1))


# ---- gRPC errors ----------------------------------------------------------------------------------------------

class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def retry_details(seconds: float) -> bytes:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=d))
    return status_pb2.Status(code=8, message="busy", details=[detail]).SerializeToString()


def test_rpc_errors_map_to_small_classes():
    e = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "top_p must be between 0 and 1"))
    assert isinstance(e, InvalidArgument) and e.message == "top_p must be between 0 and 1"
    assert isinstance(from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down")), Unavailable)
    other = from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "boom"))
    assert type(other) is TetherError and other.code == grpc.StatusCode.INTERNAL


def test_resource_exhausted_carries_retry_after():
    e = from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                                    (("grpc-status-details-bin", retry_details(1.5)),)))
    assert isinstance(e, ResourceExhausted) and e.retry_after == 1.5
    bare = from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy"))
    assert isinstance(bare, ResourceExhausted) and bare.retry_after is None


def test_any_code_may_carry_retry_after():
    """An open circuit breaker answers UNAVAILABLE with RetryInfo; the SDK's retries read it from any code."""
    details = (("grpc-status-details-bin", retry_details(4.0)),)
    e = from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "breaker open", details))
    assert isinstance(e, Unavailable) and e.retry_after == 4.0 and e.attempts == 1 and e.gave_up == ""
    aborted = from_rpc_error(FakeRpcError(grpc.StatusCode.ABORTED, "rebuilds spent"))
    assert isinstance(aborted, Aborted) and aborted.retry_after is None


def test_a_garbled_status_detail_does_not_hide_the_status():
    e = from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy",
                                    (("grpc-status-details-bin", b"\xff\xff not a status"),)))
    assert isinstance(e, ResourceExhausted) and e.message == "busy" and e.retry_after is None
