"""Who may call what: a policy per service, and the server interceptor that enforces it.

A policy maps each method of a service to a rule over the caller's identity (tether/security/identity.py),
the request (unary calls) and the server's state (e.g. who sent a stage its current handshake, the position
its own certificate names): decisions rest on verified identities, never on what a request claims. `decide` is
the pure decision; `AuthzInterceptor` applies it to every call before the handler runs, and refuses with
PERMISSION_DENIED. Health and reflection are open to every authenticated peer. Only installed with mutual
TLS: in plaintext mode no identity exists and the network is trusted (the service says so at start-up).
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from tether.security import identity
from tether.security.identity import Identity, of_peer

log = logging.getLogger(__name__)

# A rule: (caller, request or None for a streamed request, server state) -> None when allowed, else why not.
Rule = Callable[[Identity, Any, Any], str | None]
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")


def only(*roles: str) -> Rule:
    def rule(who: Identity, request: Any, state: Any) -> str | None:
        return None if who.role in roles else f"only {' or '.join(roles)} may call it"
    return rule


def stage_handshake(who: Identity, request: Any, state: Any) -> str | None:
    """Stage 0 is handshaken by its coordinator; stage i > 0 by stage i-1 alone, relaying. The stage's position
    is the one its own certificate names (`state.position`, from spiffe://tether.local/stage/<i>), never the
    index the caller claims: a stage-1 certificate claiming index 1 to stage 0 is not the coordinator. (The
    handler then refuses a handshake whose index is not that position.)"""
    position = getattr(state, "position", None)
    if position is None:
        return "this stage does not know its position (its certificate names no spiffe://tether.local/stage/<i>)"
    if position == 0:
        return None if who == identity.COORDINATOR else "only the coordinator may handshake stage 0"
    upstream = identity.stage(position - 1)
    return None if who == upstream else f"only {upstream.uri} may relay a handshake to stage {position}"


def stage_forward(who: Identity, request: Any, state: Any) -> str | None:
    """Frames only from the peer whose handshake this stage accepted last (its coordinator or upstream stage).
    Before any handshake the servicer itself refuses (FAILED_PRECONDITION); only pipeline roles get that far."""
    peer = getattr(state, "handshake_peer", None)
    if peer is None:
        return None if who.role in ("coordinator", "stage") else "only a coordinator or a stage may send frames"
    return None if who == peer else f"only {peer.uri}, which sent this stage its current handshake, may send frames"


STAGE = {"Handshake": stage_handshake, "Forward": stage_forward, "SyncState": only("coordinator"),
         "Release": only("coordinator"), "Stats": only("coordinator", "operator")}
COORDINATOR = {"Submit": only("admission"), "Session": only("admission"), "Cancel": only("admission"),
               "Watch": only("admission"), "Stats": only("operator", "admission"),
               # taking a pipeline out of service: an operator (`tether drain`) or admission, never a client or a
               # pipeline's own pods (a stage, or a coordinator draining another)
               "Drain": only("operator", "admission")}
POLICIES = {"tether.v1.Stage": STAGE, "tether.v1.Coordinator": COORDINATOR}


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""


def decide(method: str, who: Identity | None, request: Any = None, state: Any = None,
           policies: dict[str, dict[str, Rule]] = POLICIES) -> Decision:
    """May `who` call `method` ("/tether.v1.Stage/Handshake")? Unknown services and methods are refused."""
    service, _, name = method.lstrip("/").rpartition("/")
    if who is None:
        return Decision(False, "the caller presented no tether client certificate (no spiffe://tether.local "
                               "identity)")
    if service in OPEN_SERVICES:
        return Decision(True)
    rule = policies.get(service, {}).get(name)
    if rule is None:
        return Decision(False, f"{method} is not in the authorization policy")
    why = rule(who, request, state)
    return Decision(True) if why is None else Decision(False, f"{who.uri} may not call {name}: {why}")


@dataclass
class AuthzInterceptor(grpc.aio.ServerInterceptor):
    """Checks each call against `decide` before its handler runs. `state` is read by the rules (set it once the
    servicer exists); `on_refusal(method, reason)` counts a refusal (the handler's logging is done here)."""

    state: Any = None
    on_refusal: Callable[[str, str], None] | None = None
    policies: dict[str, dict[str, Rule]] = field(default_factory=lambda: POLICIES)
    refused: Counter = field(default_factory=Counter)   # method -> calls refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        async def check(request, context) -> None:
            who = of_peer(context)
            d = decide(method, who, request, self.state, self.policies)
            if not d.allowed:
                log.warning("PERMISSION_DENIED %s from %s (%s): %s", method, who or "anonymous", context.peer(),
                            d.reason)
                self.refused[method] += 1
                if self.on_refusal is not None:
                    self.on_refusal(method, d.reason)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, d.reason)
        return _wrap(handler, check)


def _wrap(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """The same handler, with `check` run first (it aborts the call when refused)."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_answering(handler.unary_unary, check, unary=True), **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream, check, unary=True), **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_answering(handler.stream_unary, check, unary=False), **kw)
    return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream, check, unary=False), **kw)


def _answering(inner, check, unary: bool):
    """A handler with one reply (its result, awaited if it is a coroutine), after `check` (given the request
    when there is one request, None for a request stream, which is not read before the check)."""
    async def handler(request_or_iterator, context):
        await check(request_or_iterator if unary else None, context)
        return await _result(inner(request_or_iterator, context))
    return handler


def _streaming(inner, check, unary: bool):
    """A replies-streaming handler either yields its replies (an async generator) or writes them with
    context.write and returns (a coroutine): the wrapper keeps the same shape, for gRPC treats them apart."""
    if inspect.isasyncgenfunction(inner):
        async def generator(request, context):
            await check(request if unary else None, context)
            async for item in inner(request, context):
                yield item
        return generator

    async def coroutine(request, context):
        await check(request if unary else None, context)
        return await inner(request, context)
    return coroutine


async def _result(value):
    return await value if inspect.isawaitable(value) else value
