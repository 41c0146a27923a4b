"""Prefix caching and KV pressure end to end (real processes on loopback, tiny model, 2 stages).

- Requests sharing a long prefix are answered exactly while the stages serve that prefix from their cache
  (counted by the coordinator and by every stage); a cached prefix of one tenant never serves another.
- Requests sharing a prefix shorter than a block are answered exactly from a copy of its positions.
- A workload whose total context is ~3x every stage's KV pool completes exactly, through preemptions, with
  zero NO_CAPACITY rejections and zero client errors; cached blocks are evicted to make room.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tether.client import AsyncClient
from tests.helpers import coordinator_stats, exact_ids, stage_stats, started

# ~300 tokens of shared "system prompt" (byte-level tiny tokenizer: several 64-position blocks)
SYSTEM = ("You are a careful assistant for a city library. Answer briefly, cite the shelf, never invent a title. "
          * 3)
QUESTIONS = ["Where are the atlases?", "Do you lend telescopes?", "Opening hours on Sunday?",
             "Is there a quiet room?", "Can I renew online?", "Where is the children's corner?"]


async def _generate(target: str, prompts: list[str], max_tokens: int, tenant: str = "",
                    concurrent: bool = True) -> list[list[int]]:
    async with AsyncClient(target, timeout=300, retry=None) as client:
        if concurrent:
            results = await asyncio.gather(*(client.generate(p, max_tokens=max_tokens, ignore_eos=True,
                                                             tenant=tenant) for p in prompts))
        else:
            results = [await client.generate(p, max_tokens=max_tokens, ignore_eos=True, tenant=tenant)
                       for p in prompts]
    return [r.token_ids for r in results]


def test_shared_prefixes_are_served_from_the_cache_exactly_and_never_across_tenants(cluster):
    prompts = [SYSTEM + q for q in QUESTIONS]
    first = asyncio.run(_generate(cluster.target, prompts[:1], 6, tenant="acme"))
    before = coordinator_stats(cluster)
    stages_before = stage_stats(cluster)
    got = asyncio.run(_generate(cluster.target, prompts[1:], 6, tenant="acme"))
    assert first + got == [exact_ids(p, 6) for p in prompts]
    after = coordinator_stats(cluster)
    hits = after.prefix_hits - before.prefix_hits
    assert hits >= 1 and after.prefix_hit_tokens - before.prefix_hit_tokens >= 64 * hits
    assert after.prefix_misses == before.prefix_misses
    assert after.computed_tokens - before.computed_tokens < after.prompt_tokens - before.prompt_tokens
    for b, a in zip(stages_before, stage_stats(cluster)):     # every stage confirmed what the coordinator sent
        assert a.prefix_hits - b.prefix_hits == hits and a.rejections.get("PREFIX_MISS", 0) == 0

    # the same prompts as another tenant: cached blocks exist, but none of them is theirs
    before, stages_before = coordinator_stats(cluster), stage_stats(cluster)
    got = asyncio.run(_generate(cluster.target, prompts[:1], 6, tenant="globex"))
    assert got == [exact_ids(prompts[0], 6)]
    after = coordinator_stats(cluster)
    assert after.prefix_hits == before.prefix_hits and after.prefix_queries == before.prefix_queries + 1
    assert [s.prefix_hits for s in stage_stats(cluster)] == [s.prefix_hits for s in stages_before]


def test_a_prefix_shorter_than_a_block_is_copied_from_the_cache_exactly(cluster):
    short = "Answer in one line. "                               # ~20 positions: part of one block
    prompts = [short + q * 3 for q in QUESTIONS[:4]]              # each past a block: its first block is cached
    before, stages_before = coordinator_stats(cluster), stage_stats(cluster)
    got = asyncio.run(_generate(cluster.target, prompts, 4, tenant="initech", concurrent=False))
    assert got == [exact_ids(p, 4) for p in prompts]
    after = coordinator_stats(cluster)
    hits, hit_tokens = after.prefix_hits - before.prefix_hits, after.prefix_hit_tokens - before.prefix_hit_tokens
    assert hits == 3 and len(short) * hits <= hit_tokens < 64 * hits   # parts of blocks only
    assert after.prefix_misses == before.prefix_misses
    for b, a in zip(stages_before, stage_stats(cluster)):
        assert a.prefix_hits - b.prefix_hits == hits and a.prefix_hit_tokens - b.prefix_hit_tokens == hit_tokens
        assert a.rejections.get("PREFIX_MISS", 0) == 0


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory):
    """Stages with 640 positions of KV (10 blocks) each."""
    with started(tmp_path_factory, extra={"stage": ["--kv-capacity", "640"]}) as c:
        yield c


def test_three_times_the_pool_completes_exactly_through_preemption(small_pool):
    # 8 requests of ~130 prompt + 100 output tokens: ~1,850 positions at the end against 640 per stage
    prompts = [f"Request {i}: " + "describe the river delta and its birds in detail. " * 2 for i in range(8)]
    got = asyncio.run(_generate(small_pool.target, prompts, 100))
    assert got == [exact_ids(p, 100) for p in prompts]
    stats = coordinator_stats(small_pool)
    assert stats.preemptions > 0 and stats.rejections.get("NO_CAPACITY", 0) == 0
    assert stats.requests_failed == 0 and stats.kv_blocks_total == 10
    for s in stage_stats(small_pool):
        assert s.rejections.get("NO_CAPACITY", 0) == 0 and s.kv_blocks_total == 10
        assert s.prefix_evictions > 0                                  # cached blocks made room
        assert s.kv_blocks_used == 0 and s.kv_blocks_cached <= 10 and s.requests_held == 0
    # after all that eviction, a prompt seen earlier is still answered exactly (from what is left, or cold)
    again = asyncio.run(_generate(small_pool.target, prompts[:2], 20))
    assert again == [exact_ids(p, 20) for p in prompts[:2]]


def test_a_request_that_can_never_fit_is_refused_with_resource_exhausted(small_pool):
    async def run() -> grpc.StatusCode:
        async with AsyncClient(small_pool.target, timeout=60, retry=None) as client:
            try:
                await client.generate("x " * 400, max_tokens=400, ignore_eos=True)
            except Exception as e:   # noqa: BLE001 - the status is what is asserted
                return e.code
        return grpc.StatusCode.OK
    assert asyncio.run(run()) == grpc.StatusCode.RESOURCE_EXHAUSTED
