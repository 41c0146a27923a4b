"""The SDK's side of conversations, without a server: message shapes, the request, the receipt's digest."""

from __future__ import annotations

import pytest

from tether.client.errors import ReceiptMismatch
from tether.client.receipt import check_receipt
from tether.client.wire import StreamAssembler, encode_messages, sent_and_request
from tether.protocol.hashing import messages_digest, prompt_digest
from tether.types import Receipt
from tether.v1 import admission_pb2

FIELDS = dict(max_tokens=8, temperature=0.0, top_k=0, top_p=0.0, seed=0, stop=(), ignore_eos=False, tenant="",
              priority="", request_id="")


def test_dicts_and_tuples_encode_alike():
    as_dicts = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    as_tuples = [("system", "Be brief."), ("user", "你好".encode())]
    assert encode_messages(as_dicts) == encode_messages(as_tuples) == (("system", b"Be brief."),
                                                                       ("user", "你好".encode()))


@pytest.mark.parametrize("bad,error", [
    ("hello", TypeError), ({"role": "user", "content": "x"}, TypeError), ([{"role": "user"}], ValueError),
    ([("user",)], TypeError), ([("user", 3)], TypeError), ([None], TypeError),
])
def test_malformed_shapes_fail_locally(bad, error):
    with pytest.raises(error):
        encode_messages(bad)


def test_roles_are_not_judged_locally():
    # Admission is the one place that decides roles and order (and says why): the SDK sends them as given.
    assert encode_messages([("tool", "x")]) == (("tool", b"x"),)


def test_a_conversation_request_carries_messages_and_no_prompt():
    sent, request = sent_and_request(None, [("user", "hi")], **FIELDS)
    assert sent == (("user", b"hi"),)
    assert request.prompt == b"" and [(m.role, m.content) for m in request.messages] == [("user", b"hi")]
    sent, request = sent_and_request("hi", None, **FIELDS)
    assert sent == b"hi" and request.prompt == b"hi" and not request.messages


def test_receipt_of_a_conversation_is_checked_against_what_was_sent():
    sent = encode_messages([("user", "a"), ("assistant", "b"), ("user", "c")])
    good = Receipt("", messages_digest(sent), 10, 1, 2, "fp")
    check_receipt(good, sent, [5, 6])
    other = encode_messages([("user", "a"), ("assistant", "b"), ("user", "d")])
    with pytest.raises(ReceiptMismatch, match="the digest of the conversation this client sent"):
        check_receipt(good, other, [5, 6])
    with pytest.raises(ReceiptMismatch):   # the raw prompt of the same text is another request
        check_receipt(Receipt("", prompt_digest(b"c"), 10, 1, 2, "fp"), encode_messages([("user", "c")]), [5, 6])


def test_stream_assembler_checks_a_conversation_receipt():
    sent = encode_messages([("user", "hi")])
    a = StreamAssembler(sent, "")
    a.add(admission_pb2.GenerateChunk(index=0, token_id=7, text="x"))
    last = admission_pb2.GenerateChunk(index=1, token_id=8, text="y", finish_reason=2)
    last.receipt.prompt_digest, last.receipt.output_tokens = messages_digest(sent), 2
    a.add(last)
    assert a.finish().text == "xy"
