"""Identity: the caller's request_id is a label; admission mints the id every piece of state is keyed by.

Reused labels never hand one request another's tokens, never hang and never end in INTERNAL; requests that
differ only in their sampling seed are told apart by the stamps."""

from __future__ import annotations

import asyncio
import threading

import grpc

from tether import reference
from tether.client import AsyncClient, Client, TetherError

PROMPTS = ["Explain in under 30 words why the sky is blue.", "写一首关于秋天的短诗"]


def _want(prompt: str, max_tokens: int, **params) -> list[int]:
    return reference.generate(prompt, "tiny", max_tokens=max_tokens, **params).token_ids


def test_a_label_in_flight_is_refused_for_its_tenant_only(cluster):
    holding = threading.Event()
    done = threading.Event()
    held: list = []

    def hold() -> None:
        with Client(cluster.target, timeout=120) as client:
            stream = client.stream("hold this label", max_tokens=400, ignore_eos=True, request_id="same")
            for k, _ in enumerate(stream):
                if k == 0:
                    holding.set()
                    if done.wait(60):
                        break
            held.append(stream.internal_id)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert holding.wait(120)
        with Client(cluster.target, timeout=120) as client:
            try:
                client.generate(PROMPTS[0], max_tokens=4, request_id="same")
                raise AssertionError("a label already in flight was accepted")
            except TetherError as e:
                assert e.code == grpc.StatusCode.ALREADY_EXISTS and "'same'" in e.message
            other = client.generate(PROMPTS[0], max_tokens=4, request_id="same", tenant="other-tenant")
            assert other.token_ids == _want(PROMPTS[0], 4) and other.receipt.request_id == "same"
    finally:
        done.set()
        t.join(60)
    with Client(cluster.target, timeout=120) as client:   # released with its request: usable again
        again = client.generate(PROMPTS[1], max_tokens=4, request_id="same")
    assert again.token_ids == _want(PROMPTS[1], 4)
    assert again.receipt.internal_id not in ("", "same", held[0])


def test_concurrent_reuse_of_one_label_gives_own_answer_or_already_exists(cluster):
    """The reproduced bug: 48 concurrent calls, two prompts, one caller id, max_tokens 1 and 16."""
    cases = [(PROMPTS[i % 2], 1 if (i // 2) % 2 else 16) for i in range(48)]

    async def go():
        async with AsyncClient(cluster.target, timeout=120) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=n, request_id="dup") for p, n in cases),
                                        return_exceptions=True)

    results = asyncio.run(go())
    want = {(p, n): _want(p, n) for p, n in set(cases)}
    exact = refused = 0
    for case, got in zip(cases, results):
        if isinstance(got, TetherError):
            assert got.code == grpc.StatusCode.ALREADY_EXISTS, (got.code, got.message)
            refused += 1
        else:
            assert not isinstance(got, BaseException), got
            assert got.token_ids == want[case], case          # its own prompt's answer, never the other's
            assert got.receipt.request_id == "dup"
            exact += 1
    assert exact >= 1 and exact + refused == len(cases)
    ids = [g.receipt.internal_id for g in results if not isinstance(g, BaseException)]
    assert len(set(ids)) == len(ids)                          # every request its own internal id


def test_samples_of_one_prompt_differing_only_in_seed_are_each_their_own(cluster):
    seeds = list(range(1, 13))

    async def go():
        async with AsyncClient(cluster.target, timeout=120) as client:
            return await asyncio.gather(*(client.generate(PROMPTS[0], max_tokens=12, temperature=1.0, seed=s)
                                          for s in seeds))

    results = asyncio.run(go())
    for s, got in zip(seeds, results):
        assert got.seed == s and got.token_ids == _want(PROMPTS[0], 12, temperature=1.0, seed=s), s
    assert len({tuple(r.token_ids) for r in results}) > 1    # the seeds do change the answer
