"""The soak's clients: closed-loop streaming users that cancel some requests mid-stream, and the class of
every request they send.

Classes: exact (the reference's answer, token for token, same end and context hash), cancelled (by us; the
tokens received before the cancel must be a prefix of the reference), refused (RESOURCE_EXHAUSTED carrying a
RetryInfo detail), error (any other explicit status, by code), WRONG (tokens that are not the reference's,
or a receipt the SDK rejected), HUNG (no status by the client's deadline). WRONG and HUNG must never happen.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from bench.soak_pool import Combo
from tether.client import AsyncClient, ReceiptMismatch, ResourceExhausted, TetherError

EXACT, CANCELLED, REFUSED, ERROR, WRONG, HUNG = "exact", "cancelled", "refused", "error", "WRONG", "HUNG"
CLASSES = (EXACT, CANCELLED, REFUSED, ERROR, WRONG, HUNG)
MAX_EXAMPLES = 20          # described per class in the report; the counts are always complete
HUNG_FRACTION = 0.98       # DEADLINE_EXCEEDED this close to the client's deadline: nothing came back in time
WATCHDOG_S = 15.0          # past the gRPC deadline: the call itself failed to end, also HUNG
MAX_BACKOFF_S = 8.0
ERROR_PAUSE_S = 1.0        # after an unexpected error, so a dead cluster is not hammered in a tight loop


@dataclass
class Outcome:
    cls: str
    combo: int
    tokens: int                 # tokens received (a cancelled or failed request's partial answer included)
    elapsed_s: float
    code: str = ""              # gRPC status name of an error
    detail: str = ""
    retry_after: float | None = None


@dataclass
class Tally:
    """Counts of every class, errors by status, and the first few outcomes of the unusual classes."""

    counts: Counter = field(default_factory=Counter)
    errors_by_code: Counter = field(default_factory=Counter)
    exact_tokens: int = 0
    cancelled_tokens: int = 0
    cancelled_before_first_token: int = 0
    refused_without_retry_info: int = 0
    examples: dict[str, list[dict]] = field(default_factory=dict)

    def add(self, out: Outcome) -> None:
        self.counts[out.cls] += 1
        if out.cls == EXACT:
            self.exact_tokens += out.tokens
        elif out.cls == CANCELLED:
            self.cancelled_tokens += out.tokens
            self.cancelled_before_first_token += out.tokens == 0
        elif out.cls == ERROR:
            self.errors_by_code[out.code] += 1
            if out.code == "RESOURCE_EXHAUSTED":
                self.refused_without_retry_info += 1
        if out.cls in (ERROR, WRONG, HUNG) and len(self.examples.setdefault(out.cls, [])) < MAX_EXAMPLES:
            self.examples[out.cls].append(dict(combo=out.combo, tokens=out.tokens, elapsed_s=round(out.elapsed_s, 3),
                                               code=out.code, detail=out.detail))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _first_difference(got: list[int], want: tuple[int, ...]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def _prefix_problem(got: list[int], combo: Combo) -> str:
    """Why `got` is not a prefix of the reference's answer; "" when it is."""
    if len(got) <= len(combo.token_ids) and tuple(got) == combo.token_ids[:len(got)]:
        return ""
    i = _first_difference(got, combo.token_ids)
    return (f"{len(got)} tokens received, not a prefix of the reference's {len(combo.token_ids)}: first difference at "
            f"index {i} (served {got[i] if i < len(got) else None}, reference "
            f"{combo.token_ids[i] if i < len(combo.token_ids) else None})")


def classify_completed(got: list[int], finish_reason: str, text: str, context_hash: int, budget: int,
                       combo: Combo) -> tuple[str, str]:
    """(class, detail) of a request that completed without our cancel."""
    if tuple(got) != combo.token_ids:
        return WRONG, _prefix_problem(got, combo) or (f"{len(got)} tokens, a proper prefix of the reference's "
                                                      f"{len(combo.token_ids)}: the answer ended early")
    if budget != combo.budget:
        return WRONG, f"admission's output budget was {budget}, its Tag dry run said {combo.budget}"
    if finish_reason != combo.finish_reason:
        return WRONG, f"finish reason {finish_reason!r}, the reference's is {combo.finish_reason!r}"
    if context_hash != combo.context_hash:
        return WRONG, f"receipt context hash {context_hash:016x}, the reference's is {combo.context_hash:016x}"
    if text != combo.text:
        return WRONG, "same tokens but different text"
    return EXACT, ""


async def _stream(client: AsyncClient, combo: Combo, cancel_at: int | None, rng: random.Random,
                  timeout_s: float) -> Outcome:
    start = last = time.monotonic()
    got: list[int] = []
    stream = client.stream(combo.request.prompt, **combo.request.params())

    def outcome(cls: str, **kw) -> Outcome:
        return Outcome(cls, combo.index, len(got), time.monotonic() - start, **kw)

    try:
        # aclosing: leaving the loop early must cancel the call now, not when the generator is collected.
        async with aclosing(stream.__aiter__()) as deltas:
            if cancel_at == 0:
                # Cancel before the first token: while queued, admitted or prefilling.
                await asyncio.sleep(rng.uniform(0.0, 0.5))
                stream.cancel()
                return outcome(CANCELLED)
            async for delta in deltas:
                got.append(delta.token_id)
                last = time.monotonic()
                if cancel_at is not None and len(got) >= cancel_at:
                    stream.cancel()
                    problem = _prefix_problem(got, combo)
                    return outcome(WRONG, detail=f"cancelled: {problem}") if problem else outcome(CANCELLED)
    except ResourceExhausted as e:
        if got:
            return outcome(WRONG, code=e.code.name, detail=f"refused after {len(got)} tokens: {e.message}")
        if e.retry_after is None:
            return outcome(ERROR, code=e.code.name, detail=f"refused without a RetryInfo detail: {e.message}")
        return outcome(REFUSED, code=e.code.name, retry_after=e.retry_after)
    except ReceiptMismatch as e:
        # The SDK refused the answer: the server vouched for tokens other than the ones it streamed.
        return outcome(WRONG, code=e.code.name, detail=f"receipt rejected: {e.message}")
    except TetherError as e:
        elapsed = time.monotonic() - start
        if e.code == grpc.StatusCode.DEADLINE_EXCEEDED and elapsed >= HUNG_FRACTION * timeout_s:
            # The gap since the last token tells a stalled request from one still streaming, just slowly.
            return outcome(HUNG, code=e.code.name, detail=f"no status within the {timeout_s:g} s deadline "
                           f"({len(got)} tokens, the last {time.monotonic() - last:.1f} s before it): {e.message}")
        problem = _prefix_problem(got, combo)
        if problem:
            return outcome(WRONG, code=e.code.name, detail=f"failed with {e.code.name} after wrong tokens: {problem}")
        return outcome(ERROR, code=e.code.name, detail=e.message[:300])
    result = stream.result
    cls, detail = classify_completed(got, result.finish_reason, result.text, result.receipt.context_hash,
                                     int(result.tags.get("output_budget", -1)), combo)
    if cls == EXACT and cancel_at is not None:
        cls = CANCELLED     # our cancel lost the race with the final token; the answer is still checked above
    return outcome(cls, detail=detail)


async def one_request(client: AsyncClient, combo: Combo, cancel_at: int | None, rng: random.Random,
                      timeout_s: float) -> Outcome:
    """Send one streaming request and classify it; a watchdog bounds it even if the call ignores its deadline."""
    start = time.monotonic()
    try:
        return await asyncio.wait_for(_stream(client, combo, cancel_at, rng, timeout_s), timeout_s + WATCHDOG_S)
    except TimeoutError:
        return Outcome(HUNG, combo.index, 0, time.monotonic() - start,
                       detail=f"the call did not end within its {timeout_s:g} s deadline + {WATCHDOG_S:g} s")
    except Exception as e:    # noqa: BLE001 - a client-side failure is reported, never allowed to stop the soak
        return Outcome(ERROR, combo.index, 0, time.monotonic() - start, code=f"CLIENT_{type(e).__name__}",
                       detail=str(e)[:300])


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int
    duration_s: float
    cancel_fraction: float
    timeout_s: float
    seed: int


async def user(index: int, client: AsyncClient, pool: list[Combo], spec: LoadSpec, deadline: float,
               tally: Tally) -> None:
    """One closed-loop user until the deadline: a random request from the pool, sometimes cancelled at a random
    token; after a refusal it waits out the RetryInfo delay, doubling it while refusals repeat (jittered)."""
    rng = random.Random(f"soak-user:{spec.seed}:{index}")
    await asyncio.sleep(rng.uniform(0.0, 1.0))    # spread the first wave over a second
    refusals = 0
    while time.monotonic() < deadline:
        combo = rng.choice(pool)
        cancel_at = rng.randrange(len(combo.token_ids)) if rng.random() < spec.cancel_fraction else None
        out = await one_request(client, combo, cancel_at, rng, spec.timeout_s)
        tally.add(out)
        pause = 0.0
        if out.cls == REFUSED:
            refusals += 1
            pause = min(MAX_BACKOFF_S, (out.retry_after or 1.0) * 2 ** min(refusals - 1, 3)) * rng.uniform(0.5, 1.0)
        else:
            refusals = 0
            if out.cls in (ERROR, HUNG):
                pause = ERROR_PAUSE_S
        await asyncio.sleep(max(0.0, min(pause, deadline - time.monotonic())))


async def run_load(target: str, pool: list[Combo], spec: LoadSpec, tally: Tally) -> float:
    """Every user until `spec.duration_s` has passed, then until the requests in flight end (each bounded by
    its deadline). Returns the monotonic time at which sending stopped."""
    deadline = time.monotonic() + spec.duration_s
    async with AsyncClient(target, timeout=spec.timeout_s, retry=None) as client:
        await asyncio.gather(*(user(i, client, pool, spec, deadline, tally) for i in range(spec.concurrency)))
    return deadline
