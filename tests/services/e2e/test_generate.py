"""End to end through admission → coordinator → 2 stage processes, checked against tether.reference."""

from __future__ import annotations

import asyncio
import random

import pytest

from tether import reference
from tether.client import AsyncClient, Client
from tether.model import dtypes, numerics

PROMPTS = [
    "请用不超过50字向老人解释血糖仪读数",
    "Explain in under 30 words why the sky is blue.",
    "写一首关于秋天的短诗",
    "Summarize: the quick brown fox jumps over the lazy dog.",
    "把这句话翻译成英文：今天天气很好。",
    "def fib(n):",
    "你好",
    "A" * 300,
    "请总结下面这段话：" + "今天天气很好，我们去公园散步。" * 30,     # ~1300 tokens: prefilled in chunks
    "混合 mixed 语言 prompt with 中文 and English, a bit longer than the others to vary prefill lengths.",
]


def _cases(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        params = dict(max_tokens=rng.randint(1, 40))
        if i % 2:
            params.update(temperature=rng.choice([0.5, 0.8, 1.0]), seed=rng.randint(1, 2**31),
                          top_p=rng.choice([0.0, 0.9]), top_k=rng.choice([0, 20]))
        cases.append(dict(prompt=PROMPTS[i % len(PROMPTS)] + (f" #{i}" if i >= len(PROMPTS) else ""), **params))
    return cases


def _generate_all(target: str, cases: list[dict]):
    async def run():
        async with AsyncClient(target, timeout=300) as client:
            return await asyncio.gather(*(client.generate(**c) for c in cases))
    return asyncio.run(run())


@pytest.mark.parametrize("n", [32, 64])
def test_concurrent_mixed_requests_equal_reference_exactly(cluster, n):
    """Batch invariance: every response is token for token its solo reference, whatever it was batched with."""
    cases = _cases(n, seed=n)
    for case, got in zip(cases, _generate_all(cluster.target, cases)):
        params = {k: v for k, v in case.items() if k != "prompt"}
        want = reference.generate(case["prompt"], "tiny", **params)
        assert got.token_ids == want.token_ids, case
        assert got.text == want.text and got.finish_reason == want.finish_reason
        assert got.receipt.context_hash == want.receipt.context_hash


def test_200_identical_requests_give_one_completion(cluster):
    greedy = _generate_all(cluster.target, [dict(prompt="请用不超过50字向老人解释血糖仪读数", max_tokens=24)] * 200)
    assert len({tuple(r.token_ids) for r in greedy}) == 1
    assert greedy[0].token_ids == reference.generate("请用不超过50字向老人解释血糖仪读数", max_tokens=24).token_ids
    sampled = _generate_all(cluster.target, [dict(prompt="Tell me a story", max_tokens=24, temperature=1.0,
                                                  seed=42)] * 64)
    assert len({tuple(r.token_ids) for r in sampled}) == 1
    assert sampled[0].token_ids == reference.generate("Tell me a story", max_tokens=24, temperature=1.0,
                                                      seed=42).token_ids


def test_receipt_and_tags(cluster):
    prompt = "请用不超过50字向老人解释血糖仪读数"
    with Client(cluster.target) as client:
        r = client.generate(prompt, max_tokens=400)
    assert r.receipt.prompt_tokens == len(prompt.encode())        # byte-level tokenizer
    assert r.receipt.output_tokens == len(r.token_ids)
    # the model and the numerics the stages chose (--dtype auto), as the reference names them on this machine
    lm = reference.load("tiny")
    assert r.receipt.model_fingerprint == lm.served_fingerprint == reference.generate(prompt).receipt.model_fingerprint
    model, dtype, kernels = r.receipt.model_fingerprint.split("-")
    assert (model, dtype) == (lm.fingerprint, numerics.name_of(lm.model.dtype))
    assert r.receipt.model_fingerprint == dtypes.served_fingerprint(lm.fingerprint, dtype, lm.model.rows.kernels)
    assert r.tags["language"] == "zh"
    assert r.tags["length_limit"] == 50 and r.tags["length_unit"] == "chars"
    assert r.tags["domain"] == "medical" and r.tags["audience"] == "elderly"
    assert len(r.token_ids) <= r.tags["output_budget"] < 400     # the constraint became the budget


def test_stream_deltas_are_whole_characters_and_add_up(cluster):
    """The byte tokenizer splits every multi-byte character across tokens. A delta that cut one would carry
    U+FFFD where the final text has the real character: every cumulative text must be a prefix of the final
    one (random weights also emit invalid bytes, whose U+FFFD is part of the reference text itself)."""
    def multi_byte(text: str) -> int:
        return sum(len(ch.encode()) > 1 and ch != "\ufffd" for ch in text)

    with Client(cluster.target) as client:
        for prompt in ("写一首关于秋天的短诗", "naïve café résumé", "日本語のテキスト"):
            # the first seed whose reply has multi-byte characters (which seed does depends on the dtype)
            params = next(p for p in (dict(max_tokens=120, temperature=1.0, seed=seed) for seed in range(1, 40))
                          if multi_byte(reference.generate(prompt, **p).text) >= 2)
            want = reference.generate(prompt, **params)
            deltas = list(client.stream(prompt, **params))
            assert [d.index for d in deltas] == list(range(len(deltas)))
            assert [d.token_id for d in deltas] == want.token_ids
            text = ""
            for d in deltas:
                text += d.text
                assert want.text.startswith(text), (text[-8:], want.text[len(text) - 8:len(text) + 4])
            assert text == want.text and deltas[-1].finish_reason == want.finish_reason
