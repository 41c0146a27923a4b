"""Resume: a Sequence started after output tokens already produced continues exactly as the uninterrupted run
(tokens, text deltas, finish reason, context hash), whatever the seam splits: a stop string, a multi-byte
character, the budget."""

from __future__ import annotations

import pytest

from tether import reference
from tether.generation.sequence import FinishReason, Sequence
from tether.protocol.hashing import hash_seed

PROMPT_EN = "Once upon a time"
PROMPT_ZH = "从前有一座山，山上有"


@pytest.fixture(scope="module")
def lm() -> reference.LoadedModel:
    return reference.load("tiny")


def full_and_deltas(lm, prompt_ids, params) -> tuple[Sequence, list[str]]:
    """The uninterrupted run, and the text delta each of its tokens emitted (replayed through a Sequence)."""
    full = reference.generate_ids(lm, prompt_ids, params, request_id="r")
    seq = Sequence("r", list(prompt_ids), params, lm.tokenizer, hash_seed(lm.fingerprint, ""),
                   lm.config.max_position_embeddings)
    return full, [seq.append(t).text for t in full.output_ids]


def assert_resumes_exactly(lm, prompt_ids, params, at: int) -> None:
    full, deltas = full_and_deltas(lm, prompt_ids, params)
    assert at < len(full.output_ids)
    resumed = reference.generate_ids(lm, prompt_ids, params, request_id="r", resume_ids=full.output_ids[:at])
    assert resumed.output_ids == full.output_ids
    assert resumed.finish_reason == full.finish_reason
    assert resumed.hasher.value == full.hasher.value           # the receipt's hash: prompt + all output
    assert resumed.text == full.text
    # what the caller saw before the seam plus what the resumed run emits after it is the uninterrupted text
    seq = Sequence("r", list(prompt_ids), params, lm.tokenizer, hash_seed(lm.fingerprint, ""),
                   lm.config.max_position_embeddings)
    seq.resume(full.output_ids[:at])
    after = [seq.append(t) for t in full.output_ids[at:]]
    assert [o.text for o in after] == deltas[at:]
    assert [o.index for o in after] == list(range(at, len(full.output_ids)))
    assert "".join(deltas[:at]) + "".join(o.text for o in after) == full.text


@pytest.mark.parametrize("params", [
    reference.sampling_params(max_tokens=10, ignore_eos=True),
    reference.sampling_params(max_tokens=10, temperature=0.9, top_k=40, top_p=0.9, seed=1234, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_resume_at_every_kind_of_position_equals_the_uninterrupted_run(lm, params):
    prompt_ids = lm.tokenizer.encode(PROMPT_EN)
    for at in (0, 1, 5, 9):   # nothing yet, one token, mid, all but the last
        assert_resumes_exactly(lm, prompt_ids, params, at)


def test_a_multibyte_character_split_by_the_seam(lm):
    """The tiny model's tokens are bytes: a Chinese character is three tokens. Resume inside one."""
    prompt_ids = lm.tokenizer.encode(PROMPT_ZH)
    params = reference.sampling_params(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    full, deltas = full_and_deltas(lm, prompt_ids, params)
    held = [i for i in range(1, len(deltas)) if deltas[i - 1] == ""]   # seams inside a held-back character
    # a forced check that a character really straddles a seam: feed three bytes of one through the rules
    seq = Sequence("r", list(prompt_ids), params, lm.tokenizer, 0, lm.config.max_position_embeddings)
    seq.resume(list("山".encode())[:2])
    assert seq.text == ""                                       # both bytes held: the character is incomplete
    assert seq.append("山".encode()[2]).text == "山"            # the third byte after the seam completes it
    for at in held or [1]:
        assert_resumes_exactly(lm, prompt_ids, params, at)


def test_a_stop_sequence_split_by_the_seam(lm):
    prompt_ids = lm.tokenizer.encode(PROMPT_EN)
    base = reference.sampling_params(max_tokens=16, ignore_eos=True)
    full, deltas = full_and_deltas(lm, prompt_ids, base)
    # a stop string made of the last character before the seam and the first after it
    at = next(i for i in range(4, len(deltas)) if deltas[i - 1] and deltas[i])
    stop = deltas[at - 1][-1] + deltas[at][0]
    params = reference.sampling_params(max_tokens=16, ignore_eos=True, stop=[stop])
    stopped = reference.generate_ids(lm, prompt_ids, params)
    assert stopped.finish_reason == FinishReason.FINISH_REASON_STOP
    at = len(stopped.output_ids) - 1                           # the seam right before the token completing it
    resumed = reference.generate_ids(lm, prompt_ids, params, resume_ids=stopped.output_ids[:at])
    assert resumed.output_ids == stopped.output_ids and resumed.text == stopped.text
    assert resumed.finish_reason == FinishReason.FINISH_REASON_STOP
    assert stop not in resumed.text


def test_the_budget_counts_resumed_tokens(lm):
    prompt_ids = lm.tokenizer.encode(PROMPT_EN)
    params = reference.sampling_params(max_tokens=6, ignore_eos=True)
    full = reference.generate_ids(lm, prompt_ids, params)
    resumed = reference.generate_ids(lm, prompt_ids, params, resume_ids=full.output_ids[:4])
    assert len(resumed.output_ids) == 6 and resumed.finish_reason == FinishReason.FINISH_REASON_LENGTH
    with pytest.raises(ValueError, match="end the generation"):   # nothing left to generate: refused
        reference.generate_ids(lm, prompt_ids, params, resume_ids=full.output_ids)
