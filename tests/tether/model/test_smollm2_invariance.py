"""Batch invariance on the real default model, bitwise: the property tests run on `tiny`
(test_batch_invariance.py); this focused set shows the same kernels keep it with SmolLM2's shapes (30 layers,
9 query / 3 KV heads, a 49k vocabulary, tied embeddings): a request's logits do not change by a bit with its
prompt chunking, the pipeline split or its batch neighbours."""

from __future__ import annotations

import pytest
import torch

from tether.model import smollm2
from tether.model.config import even_split
from tether.model.llama import SlotRows
from tether.model.loader import load_model_tokenizer, load_slice, resolve_model
from tests.helpers import run_chunks

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital"
NEIGHBOURS = ["Once upon a time there was", "写一首关于秋天的短诗", "def add(a, b):\n    return a + b\n" * 3]


@pytest.fixture(scope="module")
def folder():
    return resolve_model(smollm2.NAME)


@pytest.fixture(scope="module")
def ids(folder):
    return load_model_tokenizer(folder).encode(PROMPT)


@pytest.fixture(scope="module")
def full(folder):
    return load_slice(folder)


def test_chunking_and_split_do_not_change_a_bit(folder, full, ids):
    alone = run_chunks([full], ids, [len(ids)])
    assert torch.equal(run_chunks([full], ids, [5, 1, len(ids) - 6]), alone)
    for stages in (2, 3):
        slices = [load_slice(folder, a, b) for a, b in even_split(full.cfg.num_hidden_layers, stages)]
        assert torch.equal(run_chunks(slices, ids, [7, len(ids) - 7]), alone)


def test_neighbours_do_not_change_a_bit(folder, full, ids):
    alone = run_chunks([full], ids, [len(ids)])
    tok = load_model_tokenizer(folder)
    others = [tok.encode(p) for p in NEIGHBOURS]
    kvs = [full.new_kv() for _ in range(1 + len(others))]
    rows = [ids, *others]
    for kv, r in zip(kvs, rows):
        kv.ensure(len(r))
    out = full.logits(full(torch.tensor([t for r in rows for t in r]),
                           [SlotRows(kv, 0, len(r)) for kv, r in zip(kvs, rows)]))
    assert torch.equal(out[:len(ids)], alone)


def test_a_decode_step_among_prefills_does_not_change_a_bit(folder, full, ids):
    alone = run_chunks([full], ids, [len(ids)])
    tok = load_model_tokenizer(folder)
    kv = full.new_kv()
    kv.ensure(len(ids))
    full(torch.tensor(ids[:-1]), [SlotRows(kv, 0, len(ids) - 1)])      # the prompt so far, alone
    kv.length = len(ids) - 1
    others = [tok.encode(p) for p in NEIGHBOURS]
    okvs = [full.new_kv() for _ in others]
    for k, r in zip(okvs, others):
        k.ensure(len(r))
    x = torch.tensor([ids[-1], *[t for r in others for t in r]])      # its next token beside their prefills
    out = full.logits(full(x, [SlotRows(kv, len(ids) - 1, 1), *[SlotRows(k, 0, len(r)) for k, r in zip(okvs, others)]]))
    assert torch.equal(out[0], alone[-1])
