"""`tether generate` and `tether tag`: talk to a running cluster through the SDK."""

from __future__ import annotations

import argparse
import dataclasses
import json

from tether import settings
from tether.priority import PRIORITIES

DEFAULT_TARGET = f"127.0.0.1:{settings.ADMISSION_PORT}"
DEFAULT_RETRIES = 2    # the SDK's default policy: 3 attempts in all

RETRIES_HELP = ("retries after a refused (RESOURCE_EXHAUSTED with a RetryInfo delay), unavailable or aborted "
                "attempt, waiting at least the delay the server asks for plus a random backoff, never past "
                "--timeout; a stream that broke resumes after the tokens already printed; 0 disables "
                "(default: %(default)s)")


def retries(text: str) -> int:
    """argparse type of --retries: a count of retries, 0 or more."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--retries takes a whole number of retries (0 disables); got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"--retries cannot be negative (0 disables retries); got {n}")
    return n


def retry_policy(n: int):
    """The SDK's `retry=` for --retries N: N retries after the first attempt, None (one attempt) for 0."""
    from tether.client import RetryPolicy
    return RetryPolicy(max_attempts=n + 1) if n > 0 else None


def error_text(e: Exception, retrying: bool) -> str:
    """An SDK error for a person: the status, and when retries were on the table, how many attempts were made
    and why no more (the deadline, the retry budget, a token already printed)."""
    from tether.client.retry import RETRYABLE_CODES
    attempts, gave_up = getattr(e, "attempts", 1), getattr(e, "gave_up", "")
    if gave_up and (attempts > 1 or (retrying and getattr(e, "code", None) in RETRYABLE_CODES)):
        return f"{e} ({gave_up})"
    return str(e)


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """--target, the API key and TLS: how every client command reaches admission."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="admission HOST:PORT (default: %(default)s)")
    g = p.add_argument_group("credentials", "What admission may ask of a caller: an API key (it decides your "
                             "tenant and the priorities you may use) and TLS. Prefer the environment variables: "
                             "a key on the command line shows in the process list and shell history.")
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help="API key, sent as 'authorization: Bearer KEY' (default: $TETHER_API_KEY)")
    g.add_argument("--tls-ca", metavar="PEM", default=None,
                   help="CA certificate that verifies admission; any --tls-* turns TLS on (default: $TETHER_TLS_CA)")
    g.add_argument("--tls-cert", metavar="PEM", default=None,
                   help="client certificate, when admission requires one (default: $TETHER_TLS_CERT)")
    g.add_argument("--tls-key", metavar="PEM", default=None,
                   help="the private key of --tls-cert (default: $TETHER_TLS_KEY)")


def add_sampling_flags(p: argparse.ArgumentParser, max_tokens_help: str, seed_help: str) -> None:
    """--max-tokens, --temperature, --top-k, --top-p and --seed: one reply's budget and sampling, in generate
    and chat alike."""
    p.add_argument("--max-tokens", type=int, default=settings.DEFAULT_MAX_TOKENS, help=max_tokens_help)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold; 0 = off")
    p.add_argument("--seed", type=int, default=0, help=seed_help)


def connection(args: argparse.Namespace) -> dict:
    """The Client keyword arguments of add_connection_flags' flags (None: the SDK reads the environment)."""
    return dict(api_key=args.api_key, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether generate",
                                description="Send one prompt, or a one-turn conversation (--user, optionally "
                                            "--system, rendered with the model's chat template), to tether's "
                                            "admission service and print the answer.")
    p.add_argument("prompt", nargs="?", help="the prompt (UTF-8 text), sent as is; or use --user")
    p.add_argument("--user", help="a user message, sent as a conversation (instead of a raw prompt)")
    p.add_argument("--system", help="a system message before --user")
    add_connection_flags(p)
    add_sampling_flags(p, "output budget in tokens (default: %(default)s)", "sampling seed; 0 = admission picks one")
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument("--tenant", default="", help="tenant (cache namespace); with an API key leave it out: the key's "
                                                "tenant is used, and naming another is refused")
    p.add_argument("--priority", default="", choices=["", *PRIORITIES],
                   help="priority class (default: standard); an API key's tenant may be limited to some")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print the whole result (text, tokens, receipt, tags) as JSON")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds before giving up, retries included (default: %(default)s)")
    p.add_argument("--retries", type=retries, default=DEFAULT_RETRIES, metavar="N", help=RETRIES_HELP)
    return p


def conversation_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, str]] | None:
    """The one-turn conversation of --system/--user, None for a raw prompt; exits with usage on a bad mix."""
    if (args.prompt is None) == (args.user is None):
        parser.error("give a prompt, or --user (optionally with --system), but not both")
    if args.user is None:
        if args.system is not None:
            parser.error("--system needs --user: the model answers a user message")
        return None
    return ([("system", args.system)] if args.system is not None else []) + [("user", args.user)]


def main(argv: list[str] | None = None) -> None:
    from tether.client import Client, TetherError
    parser = build_parser()
    args = parser.parse_args(argv)
    messages = conversation_args(parser, args)
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, stop=tuple(args.stop), tenant=args.tenant, priority=args.priority)
    try:
        with Client(args.target, timeout=args.timeout, retry=retry_policy(args.retries), **connection(args)) as client:
            if args.stream and not args.json:
                stream = client.stream_chat(messages, **params) if messages else client.stream(args.prompt, **params)
                for delta in stream:
                    print(delta.text, end="", flush=True)
                print()
                return
            result = client.chat(messages, **params) if messages else client.generate(args.prompt, **params)
    except TetherError as e:
        raise SystemExit(f"tether generate: {error_text(e, args.retries > 0)}") from None
    except ValueError as e:   # credentials the SDK cannot use (half a TLS pair, an unreadable file)
        raise SystemExit(f"tether generate: {e}") from None
    if args.json:
        print(json.dumps(dataclasses.asdict(result), ensure_ascii=False, indent=2))
    else:
        print(result.text)


def build_tag_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether tag", description="Show the intent tags admission extracts from a prompt "
                                                             "(language, length constraint, task, domain, ...).")
    p.add_argument("prompt", nargs="?", help="the prompt (UTF-8 text); or use --user")
    p.add_argument("--user", help="a user message: tag it as a conversation (with an optional --system)")
    p.add_argument("--system", help="a system message before --user")
    add_connection_flags(p)
    p.add_argument("--max-tokens", type=int, default=settings.DEFAULT_MAX_TOKENS, help="requested output budget")
    return p


def tag_main(argv: list[str] | None = None) -> None:
    from tether.client import Client, TetherError
    parser = build_tag_parser()
    args = parser.parse_args(argv)
    messages = conversation_args(parser, args)
    try:
        with Client(args.target, **connection(args)) as client:
            tags = client.tag(args.prompt, max_tokens=args.max_tokens, messages=messages)
    except (TetherError, ValueError) as e:
        raise SystemExit(f"tether tag: {e}") from None
    print(json.dumps(tags, ensure_ascii=False, indent=2))
