"""Conversations end to end (tiny, 2 stages): served replies equal tether.reference.chat token for token,
multi-turn included; bad conversations get INVALID_ARGUMENT; `tether chat` and `tether generate --user`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import grpc
import pytest

from tether import reference, settings
from tether.client import AsyncClient, Client, InvalidArgument
from tether.protocol.hashing import messages_digest
from tether.v1 import admission_pb2, admission_pb2_grpc

SYSTEM = "You are a careful assistant. Answer in under 20 words."
CONVERSATIONS = [
    [("user", "Hello")],
    [("system", SYSTEM), ("user", "请用不超过50字向老人解释血糖仪读数")],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And times 3?"}],
]


def _messages(conv) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) if isinstance(m, dict) else m for m in conv]


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_chat_equals_the_reference_exactly(cluster, i):
    conv = CONVERSATIONS[i]
    with Client(cluster.target, timeout=120) as c:
        for params in (dict(max_tokens=16), dict(max_tokens=12, temperature=0.8, seed=11 + i, top_p=0.9)):
            got = c.chat(conv, **params)
            want = reference.chat(conv, "tiny", **params)
            assert got.token_ids == want.token_ids and got.text == want.text, params
            assert got.receipt.context_hash == want.receipt.context_hash
            assert got.receipt.prompt_digest == want.receipt.prompt_digest == messages_digest(
                [(r, t.encode()) for r, t in _messages(conv)])
            assert got.receipt.prompt_tokens == want.receipt.prompt_tokens


def test_multi_turn_with_served_answers_stays_exact(cluster):
    """Each turn sends the history with the served replies; every reply equals the reference's for that history."""
    history: list[tuple[str, str]] = [("system", SYSTEM)]
    with Client(cluster.target, timeout=120) as c:
        for turn, question in enumerate(["Hi there", "Tell me more", "写一首短诗", "Thanks!"]):
            history.append(("user", question))
            stream = c.stream_chat(history, max_tokens=10)
            streamed = "".join(d.text for d in stream)
            want = reference.chat(history, "tiny", max_tokens=10)
            assert stream.result.token_ids == want.token_ids and streamed == want.text, turn
            assert stream.tags["turns"] == turn + 1
            assert stream.tags["task"] == ("chat" if turn else stream.tags["task"])
            history.append(("assistant", stream.result.text))


def test_async_chat_and_stream_chat_equal_the_reference(cluster):
    conv = CONVERSATIONS[2]

    async def run():
        async with AsyncClient(cluster.target, timeout=120) as c:
            whole = await c.chat(conv, max_tokens=8)
            stream = c.stream_chat(conv, max_tokens=8)
            text = "".join([d.text async for d in stream])
            return whole, stream.result, text

    whole, streamed, text = asyncio.run(run())
    want = reference.chat(conv, "tiny", max_tokens=8)
    assert whole.token_ids == streamed.token_ids == want.token_ids and text == want.text


def test_conversation_tags_come_from_its_structure(cluster):
    with Client(cluster.target, timeout=60) as c:
        one = c.tag(messages=[("system", SYSTEM), ("user", "Hi")])
        three = c.tag(messages=[("system", SYSTEM), ("user", "a"), ("assistant", "b"), ("user", "c"),
                                ("assistant", "d"), ("user", "e")])
        bare = c.tag(messages=[("user", "Hi")])
    assert (one["turns"], three["turns"], bare["turns"]) == (1, 3, 1)
    assert one["prefix_key"] == three["prefix_key"] != 0 and bare["prefix_key"] == 0
    assert three["task"] == "chat" and one["length_limit"] == 20


@pytest.mark.parametrize("conv,fragment", [
    ([], None),   # the SDK sends no messages and no prompt: an empty prompt
    ([("tool", "x")], "messages[0].role must be one of system, user, assistant; got 'tool'"),
    ([("user", "a"), ("system", "late"), ("user", "b")], "only the first message may be one"),
    ([("user", "   ")], "messages[0] (user) has empty content"),
    ([("user", "q"), ("assistant", "a")], "the last message must be the user's"),
    ([("user", b"bad \xff utf-8")], "messages[0].content is not valid UTF-8"),
    ([("user", "x" * 3000), ("assistant", "y"), ("user", "z" * 1100)], "drop or shorten messages"),
    ([("user", "a"), ("assistant", "b")] * 200 + [("user", "c")], f"at most {settings.MAX_MESSAGES} are allowed"),
])
def test_bad_conversations_are_invalid_argument(cluster, conv, fragment):
    with Client(cluster.target, timeout=60) as c:
        with pytest.raises(InvalidArgument) as e:
            c.chat(conv, max_tokens=4)
        with pytest.raises(InvalidArgument):
            list(c.stream_chat(conv, max_tokens=4))
    assert fragment is None or fragment in e.value.message, e.value.message


def test_prompt_and_messages_together_are_refused(cluster):
    with grpc.insecure_channel(cluster.target) as ch:
        stub = admission_pb2_grpc.AdmissionStub(ch)
        both = admission_pb2.GenerateRequest(prompt=b"hi", messages=[admission_pb2.Message(role="user",
                                                                                           content=b"hi")])
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(both, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "send either prompt or messages, not both"


def _tether(cluster, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "tether.cli.main", *args, "--target", cluster.target],
                          input=stdin.encode(), capture_output=True, timeout=180, env=env)


def test_tether_chat_repl_keeps_history_streams_and_resets(cluster):
    """Driven through stdin like a person typing: two turns, /reset, one turn, /exit (the rest is ignored)."""
    done = _tether(cluster, "chat", "--system", SYSTEM, "--max-tokens", "8",
                   stdin="Hello\n\nSecond question\n/reset\nThird\n/exit\nnever sent\n")
    assert done.returncode == 0, done.stderr.decode()
    first = reference.chat([("system", SYSTEM), ("user", "Hello")], "tiny", max_tokens=8)
    second = reference.chat([("system", SYSTEM), ("user", "Hello"), ("assistant", first.text),
                             ("user", "Second question")], "tiny", max_tokens=8)
    third = reference.chat([("system", SYSTEM), ("user", "Third")], "tiny", max_tokens=8)
    assert done.stdout.decode() == f"{first.text}\n{second.text}\n{third.text}\n"
    assert "(conversation reset)" in done.stderr.decode()


def test_tether_chat_reports_a_refused_turn_and_carries_on(cluster):
    done = _tether(cluster, "chat", "--max-tokens", "4", stdin="x" * 5000 + "\nHi\n")
    assert done.returncode == 0
    assert "INVALID_ARGUMENT" in done.stderr.decode() and "not added to the conversation" in done.stderr.decode()
    assert done.stdout.decode() == reference.chat([("user", "Hi")], "tiny", max_tokens=4).text + "\n"


def test_tether_generate_with_system_and_user(cluster):
    done = _tether(cluster, "generate", "--system", SYSTEM, "--user", "What is 2+2?", "--max-tokens", "8", "--json")
    assert done.returncode == 0, done.stderr.decode()
    got = json.loads(done.stdout)
    want = reference.chat([("system", SYSTEM), ("user", "What is 2+2?")], "tiny", max_tokens=8)
    assert got["token_ids"] == want.token_ids and got["tags"]["prefix_key"] != 0
    tagged = _tether(cluster, "tag", "--user", "Hi")
    assert tagged.returncode == 0 and json.loads(tagged.stdout)["turns"] == 1
