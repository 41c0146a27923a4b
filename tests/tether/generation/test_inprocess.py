"""The in-process engine: batched answers equal one-at-a-time answers, the batch limits hold, KV is freed."""

from __future__ import annotations

import pytest

from tether import reference
from tether.generation.inprocess import InProcessEngine
from tether.generation.sequence import Sequence

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 26)]
PARAMS = [reference.sampling_params(max_tokens=12, ignore_eos=True),
          reference.sampling_params(max_tokens=7, temperature=0.9, top_k=30, top_p=0.9, seed=3, ignore_eos=True),
          reference.sampling_params(max_tokens=16)]


@pytest.fixture(scope="module")
def lm() -> reference.LoadedModel:
    return reference.load("tiny")


def sequences(lm: reference.LoadedModel) -> list[Sequence]:
    return [Sequence(str(i), list(p), PARAMS[i % len(PARAMS)], lm.tokenizer, 0, lm.config.max_position_embeddings)
            for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("max_batch, max_batch_tokens", [(1, None), (3, 48), (8, None)])
def test_batched_answers_are_the_one_at_a_time_answers(lm, max_batch, max_batch_tokens):
    batched = InProcessEngine(lm.model, max_batch, max_batch_tokens).run(sequences(lm))
    for seq in batched:
        alone = InProcessEngine(lm.model).run([sequences(lm)[int(seq.request_id)]])[0]
        assert seq.finished and seq.output_ids == alone.output_ids and seq.text == alone.text


def test_a_step_stays_within_the_batch_limits_and_admits_in_order(lm):
    engine = InProcessEngine(lm.model, max_batch=3, max_batch_tokens=30)
    for seq in sequences(lm):
        engine.add(seq)
    admitted: list[str] = []
    while not engine.idle:
        decoding = {r.seq.request_id for r in engine.running}
        outs = engine.step()
        assert len(outs) <= 3
        new = [s for s, _ in outs if s.request_id not in decoding]
        admitted += [s.request_id for s in new]
        # one decode row per running sequence, whole prompts for the new ones; a lone prompt may exceed it
        rows = len(outs) - len(new) + sum(len(s.prompt_ids) for s in new)
        assert rows <= 30 or len(outs) == 1
    assert admitted == [str(i) for i in range(len(PROMPTS))]


def test_finished_sequences_free_their_kv(lm):
    engine = InProcessEngine(lm.model, max_batch=4)
    engine.run(sequences(lm)[:1])            # the model's arena exists from here on
    if lm.model.arena is None:
        pytest.skip("plain kernels: each request's KV is its own tensors")
    used = lm.model.arena.used_blocks
    engine.run(sequences(lm))
    assert lm.model.arena.used_blocks == used and engine.idle
