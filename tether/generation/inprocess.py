"""The in-process engine: the whole generation loop in one file, over one whole-model ModelSlice and no network.

The reference (tether/reference.py) runs it one request at a time, the answer the service owes; the load
tool's `engine` baseline (tether/loadtest/baselines.py) runs it batched, the ceiling the service chases. The
served path splits the same loop across processes (the coordinator schedules and samples, the stages run
the layers), with the same Sequence, sampler and batching limits.

One step:
1. schedule: every running sequence decodes one token; waiting ones join in arrival order, whole prompts
   (with a resumed sequence's output so far),
   while the step stays within `max_batch` sequences and `max_batch_tokens` rows (as the coordinator's
   scheduler does for one stage);
2. run the model over the batch: each sequence's new tokens (its prompt on its first step, its last token
   after) in one forward pass, each attending to its own KV only;
3. sample one token per sequence from the logits after its last row (tether/generation/sampler.py);
4. append it: the Sequence's stop rules (EOS, length, context, stop strings) say whether it ended;
5. stop: a finished sequence leaves the batch and its KV is freed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tether.generation import sampler
from tether.generation.sequence import Sequence, TokenOut
from tether.kv.paged import PagedKV
from tether.model.llama import ModelSlice, SlotRows


def forward_last(model: ModelSlice, feeds: list[tuple[PagedKV, list[int]]]) -> torch.Tensor:
    """Feed each request's new tokens to its KV in one forward pass: the logits after each one's last token,
    one row per feed [len(feeds), vocab]."""
    slots = []
    for kv, ids in feeds:
        kv.ensure(kv.length + len(ids))
        slots.append(SlotRows(kv, kv.length, len(ids)))
    h = model(torch.tensor([t for _, ids in feeds for t in ids], dtype=torch.long), slots)
    ends = torch.tensor([len(ids) for _, ids in feeds]).cumsum(0) - 1
    logits = model.logits(h[ends])
    for kv, ids in feeds:
        kv.length += len(ids)
    return logits


@dataclass
class Running:
    """A scheduled sequence and its KV; the tokens it still has to feed are those past `kv.length`."""

    seq: Sequence
    kv: PagedKV

    @property
    def new_ids(self) -> list[int]:
        return self.seq.all_ids[self.kv.length:]


class InProcessEngine:
    """Continuous batching of Sequences over one whole-model slice (see the module docstring for a step).
    `max_batch_tokens` None: no row limit."""

    def __init__(self, model: ModelSlice, max_batch: int = 1, max_batch_tokens: int | None = None) -> None:
        self.model = model
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Running] = []

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _admits(self, rows: int) -> bool:
        """Whether the next waiting sequence joins a step that already has `rows` rows."""
        if not self.waiting or len(self.running) >= self.max_batch:
            return False
        return (not self.running or self.max_batch_tokens is None
                or rows + len(self.waiting[0].all_ids) <= self.max_batch_tokens)

    def schedule(self) -> list[Running]:
        """Step 1: the running sequences (one decode row each), then waiting ones while the limits allow."""
        rows = len(self.running)
        while self._admits(rows):
            seq = self.waiting.popleft()
            self.running.append(Running(seq, self.model.new_kv()))
            rows += len(seq.all_ids)   # a resumed sequence prefills its output so far too
        return self.running

    def step(self) -> list[tuple[Sequence, TokenOut]]:
        """One step over the batch: each scheduled sequence's appended token, in batch order."""
        batch = self.schedule()
        logits = forward_last(self.model, [(r.kv, r.new_ids) for r in batch])
        out = []
        for k, r in enumerate(batch):
            out.append((r.seq, r.seq.append(sampler.sample(logits[k], r.seq.sampling, len(r.seq.all_ids)))))
            if r.seq.finished:
                r.kv.release()
        self.running = [r for r in batch if not r.seq.finished]
        return out

    def run(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        """Generate every sequence to its end; returns them in the order given."""
        seqs = list(seqs)
        for seq in seqs:
            self.add(seq)
        while not self.idle:
            self.step()
        return seqs
