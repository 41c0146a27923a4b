"""`tether chat`: an interactive conversation with a running cluster.

Each line you type is a user message; the reply streams as it is generated and joins the history, which is
sent whole with every turn (admission renders it with the model's chat template). `/reset` starts over
(keeping --system), `/exit` or end of input leaves. A turn the server refuses (e.g. a history grown past the
model's context) is dropped from the history and the error printed: nothing is truncated behind your back.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import TextIO

from tether.cli.generate import (DEFAULT_RETRIES, RETRIES_HELP, add_connection_flags, add_sampling_flags, connection,
                                 error_text, retries, retry_policy)

HELP = "commands: /reset (forget the conversation, keep the system prompt), /exit (or end of input)"


@dataclass
class Conversation:
    """The history the REPL sends: pure, so its rules are testable without a server."""

    system: str = ""
    messages: list[tuple[str, str]] = field(default_factory=list)

    def reset(self) -> None:
        self.messages.clear()

    def with_user(self, text: str) -> list[tuple[str, str]]:
        """The messages to send for a new user turn (the history is only extended once the reply is complete)."""
        head = [("system", self.system)] if self.system else []
        return head + self.messages + [("user", text)]

    def add_turn(self, user: str, assistant: str) -> None:
        self.messages += [("user", user), ("assistant", assistant)]

    @property
    def turns(self) -> int:
        return len(self.messages) // 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether chat", description="Talk to a running cluster: an interactive "
                                "conversation, history kept, replies streamed. " + HELP + ".")
    add_connection_flags(p)
    p.add_argument("--system", default="", help="system prompt, sent first with every turn")
    add_sampling_flags(p, "output budget per reply (default: %(default)s)",
                       "sampling seed; 0 = admission picks one per reply")
    p.add_argument("--tenant", default="", help="tenant (cache namespace); with an API key leave it out: the key's "
                                                "tenant is used")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per reply before giving up, retries "
                                                                "included (default: %(default)s)")
    p.add_argument("--retries", type=retries, default=DEFAULT_RETRIES, metavar="N", help=RETRIES_HELP)
    return p


def repl(client, conversation: Conversation, params: dict, stdin: TextIO, stdout: TextIO, stderr: TextIO,
         interactive: bool) -> int:
    """Read user lines until /exit or end of input; return the number of completed turns."""
    from tether.client import TetherError
    if interactive:
        print(f"tether chat: {HELP}", file=stderr)
    while True:
        if interactive:
            print("you> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:          # end of input
            break
        text = line.rstrip("\r\n")
        command = text.strip()
        if not command:
            continue
        if command == "/exit":
            break
        if command == "/reset":
            conversation.reset()
            print("(conversation reset)", file=stderr, flush=True)
            continue
        if command.startswith("/") and " " not in command:
            print(f"unknown command {command}; {HELP}", file=stderr, flush=True)
            continue
        stream = client.stream_chat(conversation.with_user(text), **params)
        printed = False
        try:
            for delta in stream:
                print(delta.text, end="", file=stdout, flush=True)
                printed = True
        except TetherError as e:
            # The turn is dropped: the history stays what the server last accepted.
            if printed:   # end the partial reply's line
                print(file=stdout, flush=True)
            # hasattr: a stand-in client (tests) may have no retrier
            retrying = client.retrier.policy.max_attempts > 1 if hasattr(client, "retrier") else False
            print(f"[error: {error_text(e, retrying)}; this message was not added to the conversation"
                  + ("; /reset to start over" if conversation.messages else "") + "]", file=stderr, flush=True)
            continue
        except KeyboardInterrupt:
            stream.cancel()
            if printed:
                print(file=stdout, flush=True)
            print("[interrupted; this message was not added to the conversation]", file=stderr, flush=True)
            continue
        print(file=stdout, flush=True)
        conversation.add_turn(text, stream.result.text)
    return conversation.turns


def main(argv: list[str] | None = None) -> None:
    from tether.client import Client
    args = build_parser().parse_args(argv)
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, tenant=args.tenant)
    try:
        client = Client(args.target, timeout=args.timeout, retry=retry_policy(args.retries), **connection(args))
    except ValueError as e:   # credentials the SDK cannot use (half a TLS pair, an unreadable file)
        raise SystemExit(f"tether chat: {e}") from None
    with client:
        try:
            repl(client, Conversation(args.system), params, sys.stdin, sys.stdout, sys.stderr, sys.stdin.isatty())
        except KeyboardInterrupt:   # at the prompt: leave quietly
            print(file=sys.stderr)
