"""The soak's fixed pool of distinct requests and the reference answer of each, computed once.

Soak clients draw from a small pool so every served answer can be checked by a list comparison instead of a
model replay: with batch invariance the served tokens equal `tether.reference` exactly, whatever the load.
Prompts come from the bench workloads (short Chinese and English prompts, chat prefixes, synthetic word lists
up to a few hundred tokens); max_tokens is redrawn from a wide spread; half greedy, half seeded sampling.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from tether import reference
from tether.loadtest.baselines import torch_threads
from tether.loadtest.workloads import BenchRequest, SyntheticSpec, Workload
from tether.client import AsyncClient

MIX = {"single": 2.0, "multiturn": 1.0, "synthetic": 2.0}
# Synthetic prompts of 16..304 tokens: with the short single-turn prompts, "short to a few hundred tokens".
SYNTHETIC = SyntheticSpec(input_len=160, output_len=64, range_ratio=0.9)
MAX_TOKENS_CHOICES = (1, 8, 16, 32, 48, 64, 96, 128, 160, 200)   # 1: an answer that is its prefill's token alone


@dataclass(frozen=True)
class Combo:
    """One (prompt, sampling) combination and what the service owes for it."""

    index: int
    request: BenchRequest
    prompt_tokens: int
    budget: int                    # admission's output budget (a length limit in the prompt can lower it)
    token_ids: tuple[int, ...]     # the reference's answer
    finish_reason: str
    text: str
    context_hash: int

    def describe(self) -> dict:
        r = self.request
        return dict(index=self.index, workload=r.workload, prompt_tokens=self.prompt_tokens, max_tokens=r.max_tokens,
                    budget=self.budget, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=r.seed,
                    ignore_eos=r.ignore_eos, reference_tokens=len(self.token_ids), finish_reason=self.finish_reason)


def draw_requests(lm: reference.LoadedModel, size: int, seed: int, max_prompt_tokens: int) -> list[BenchRequest]:
    """`size` distinct (prompt, sampling) requests, seeded, each prompt at most `max_prompt_tokens` long."""
    rng = random.Random(f"soak-pool:{seed}")
    stream = Workload(MIX, lm.tokenizer.encode, synthetic=SYNTHETIC).stream(f"soak:{seed}")
    seen: set[tuple] = set()
    out: list[BenchRequest] = []
    for _ in range(size * 50):    # bounded: the workloads repeat prompts, so a few draws are duplicates
        if len(out) == size:
            break
        req = dataclasses.replace(next(stream), index=len(out), max_tokens=rng.choice(MAX_TOKENS_CHOICES))
        key = (req.prompt, tuple(sorted(req.params().items())))
        if key in seen or len(lm.tokenizer.encode(req.prompt)) > max_prompt_tokens:
            continue
        seen.add(key)
        out.append(req)
    return out


async def build_pool(client: AsyncClient, model: str, size: int, seed: int, max_prompt_tokens: int) -> list[Combo]:
    """The pool with its references. Admission's Tag dry run gives each request's output budget, so the
    reference is computed with exactly the max_tokens the service will use."""
    lm = reference.load(model)
    pool = []
    for req in draw_requests(lm, size, seed, max_prompt_tokens):
        budget = int((await client.tag(req.prompt, max_tokens=req.max_tokens))["output_budget"])
        params = dict(req.params(), max_tokens=budget)
        with torch_threads(1):   # the cluster shares these cores; one thread never collapses under contention
            ref = reference.generate(req.prompt, model, **params)
        pool.append(Combo(req.index, req, ref.receipt.prompt_tokens, budget, tuple(ref.token_ids), ref.finish_reason,
                          ref.text, ref.receipt.context_hash))
    return pool

