"""`tether chat`'s loop without a server: what it sends each turn, /reset, /exit, and a refused turn."""

from __future__ import annotations

import io
from types import SimpleNamespace

import grpc

from tether.cli.chat import Conversation, repl
from tether.client import InvalidArgument
from tether.types import Delta


class FakeStream:
    def __init__(self, reply: str | None) -> None:
        self.reply, self.result = reply, None

    def __iter__(self):
        if self.reply is None:
            raise InvalidArgument("conversation is too long", grpc.StatusCode.INVALID_ARGUMENT)
        for i, ch in enumerate(self.reply):
            yield Delta(i, 0, ch, "")
        self.result = SimpleNamespace(text=self.reply)

    def cancel(self) -> None:
        pass


class FakeClient:
    def __init__(self, replies: list[str | None]) -> None:
        self.replies, self.sent = list(replies), []

    def stream_chat(self, messages, **params):
        self.sent.append(list(messages))
        return FakeStream(self.replies.pop(0))


def run(lines: str, replies: list[str | None], system: str = "S") -> tuple[FakeClient, str, str, int]:
    client, out, err = FakeClient(replies), io.StringIO(), io.StringIO()
    turns = repl(client, Conversation(system), {}, io.StringIO(lines), out, err, interactive=False)
    return client, out.getvalue(), err.getvalue(), turns


def test_history_grows_with_each_reply_and_reset_keeps_the_system_prompt():
    client, out, err, turns = run("a\n\nb\n/reset\nc\n/exit\nnever\n", ["A", "B", "C"])
    assert client.sent == [[("system", "S"), ("user", "a")],
                           [("system", "S"), ("user", "a"), ("assistant", "A"), ("user", "b")],
                           [("system", "S"), ("user", "c")]]
    assert out == "A\nB\nC\n" and "(conversation reset)" in err and turns == 1


def test_a_refused_turn_is_reported_and_left_out_of_the_history():
    client, out, err, _ = run("a\ntoo long\nb\n", ["A", None, "B"], system="")
    assert client.sent[2] == [("user", "a"), ("assistant", "A"), ("user", "b")]
    assert "INVALID_ARGUMENT: conversation is too long" in err and "/reset" in err
    assert out == "A\nB\n"


def test_unknown_commands_are_not_sent():
    client, _, err, _ = run("/help\n", [])
    assert client.sent == [] and "unknown command /help" in err
