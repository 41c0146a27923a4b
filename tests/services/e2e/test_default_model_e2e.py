"""The real default model end to end: a 2-stage cluster on SmolLM2-135M-Instruct, checked token for token.

The heavy e2e tests run on `tiny`; this focused set shows batch invariance, the stamps and the chat path hold
unchanged on real weights (30 layers, GQA 9/3, tied embeddings, a 49k BPE vocabulary): concurrent greedy and
seeded requests equal their solo `tether.reference` answers, and the model really answers a question; and the
same with the stages' --linear-inputs q8 (llama.cpp's arithmetic on the file's groups), against a q8 reference.
"""

from __future__ import annotations

import asyncio

import pytest

from tether import reference
from tether.client import AsyncClient, Client
from tether.model import native
from tests.helpers import started

MODEL = "smollm2"
CASES = [   # short answers: the in-process reference runs each alone, and the whole file stays under a minute
    dict(prompt="The capital of Italy is", max_tokens=8),
    dict(prompt="def add(a, b):", max_tokens=10),
    dict(prompt="List three colours:", max_tokens=8, temperature=0.8, seed=11),
    dict(prompt="Once upon a time", max_tokens=10, temperature=1.0, top_p=0.9, seed=5),
    dict(prompt="写一句话介绍北京。", max_tokens=6, temperature=0.7, top_k=20, seed=3),
]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    with started(tmp_path_factory, model=MODEL) as c:
        yield c


def test_concurrent_requests_equal_the_reference(smol):
    async def run():
        async with AsyncClient(smol.target, timeout=120) as client:
            return await asyncio.gather(*(client.generate(**c) for c in CASES))

    for case, got in zip(CASES, asyncio.run(run())):
        params = {k: v for k, v in case.items() if k != "prompt"}
        want = reference.generate(case["prompt"], MODEL, **params)
        assert got.token_ids == want.token_ids, case
        assert got.text == want.text and got.finish_reason == want.finish_reason
        assert got.receipt.context_hash == want.receipt.context_hash
        assert got.receipt.model_fingerprint == want.receipt.model_fingerprint


def test_the_model_knows_the_capital_of_france(smol):
    with Client(smol.target, timeout=120) as client:
        got = client.chat(FRANCE, max_tokens=12)
    assert "Paris" in got.text, got.text
    want = reference.chat(FRANCE, MODEL, max_tokens=12)
    assert got.token_ids == want.token_ids and got.receipt.context_hash == want.receipt.context_hash


@pytest.mark.skipif(native.available() is not None, reason=f"q8 needs our kernels: {native.available()}")
def test_q8_linear_inputs_served_equal_the_q8_reference(tmp_path_factory):
    """A cluster whose stages multiply 8-bit inputs: concurrent requests equal the q8 reference token for token,
    and the receipts name numerics other than float32's."""
    with started(tmp_path_factory, model=MODEL, extra={"stage": ["--linear-inputs", "q8"]}) as cluster:
        async def run():
            async with AsyncClient(cluster.target, timeout=120) as client:
                return await asyncio.gather(*(client.generate(**c) for c in CASES))

        answers = asyncio.run(run())
    for case, got in zip(CASES, answers):
        params = {k: v for k, v in case.items() if k != "prompt"}
        want = reference.generate(case["prompt"], MODEL, inputs="q8", **params)
        assert got.token_ids == want.token_ids, case
        assert got.receipt.context_hash == want.receipt.context_hash
        assert got.receipt.model_fingerprint == want.receipt.model_fingerprint
        assert got.receipt.model_fingerprint != reference.load(MODEL).served_fingerprint
