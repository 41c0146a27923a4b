"""Baselines measured in the same run, on the same requests, weights, batch size and threads:

- engine: the in-process engine (tether/generation/inprocess.py), continuous batching over one whole-model
  ModelSlice with the service's own sequence, sampler and batching limits, and no gRPC, stamps or pipeline:
  the ceiling the service chases.
- hf: Hugging Face transformers `generate` with static batching (left padded, greedy) on the same folder:
  what a Python user would pick instead.
- hf_cb: transformers' own continuous batching (`generate_batch`, paged KV cache) on the same folder: the
  strongest thing a Python user would pick instead on a CPU.

Both report output tokens per second over the whole set of requests, all available at once (offline).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from tether import reference
from tether.generation.inprocess import InProcessEngine
from tether.generation.sequence import Sequence
from tether.mathutil import ceil_div
from tether.v1 import common_pb2


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    params: common_pb2.SamplingParams


@dataclass(frozen=True)
class BaselineRun:
    output_tokens: int
    seconds: float

    @property
    def output_token_throughput(self) -> float:
        return self.output_tokens / self.seconds


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_engine(lm: reference.LoadedModel, jobs: Seq[Job], batch_size: int, max_batch_tokens: int) -> BaselineRun:
    """The in-process engine (tether/generation/inprocess.py) over every job at once: each step decodes every
    running request and admits waiting ones (whole prompts, in arrival order) while the step stays within
    `batch_size` requests and `max_batch_tokens` rows, as the coordinator's scheduler does for one stage."""
    seqs = [Sequence(str(i), list(j.prompt_ids), j.params, lm.tokenizer, 0, lm.config.max_position_embeddings)
            for i, j in enumerate(jobs)]
    engine = InProcessEngine(lm.model, batch_size, max_batch_tokens)
    t0 = time.perf_counter()
    engine.run(seqs)
    return BaselineRun(sum(len(s.output_ids) for s in seqs), time.perf_counter() - t0)


def load_hf(folder: Path, dtype: torch.dtype = torch.float32):
    """The same weights in transformers (our presets are saved in Hugging Face Llama format), in `dtype`: the
    cluster's (the reference's `auto` choice), so the baseline computes in the numerics the cluster does."""
    import transformers   # a bench/test extra, imported only when this baseline runs
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


def run_hf(hf, jobs: Seq[Job], batch_size: int, pad_id: int, eos_ids: frozenset[int]) -> BaselineRun:
    """Static batching: batches of `batch_size` in order, left padded, greedy, each run until its longest
    budget. A request's useful tokens stop at its own budget or EOS; the rest is the static-batching waste."""
    produced = 0
    t0 = time.perf_counter()
    for b in range(0, len(jobs), batch_size):
        batch = jobs[b:b + batch_size]
        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, j in enumerate(batch):
            ids[i, width - len(j.prompt_ids):] = torch.tensor(j.prompt_ids)
            mask[i, width - len(j.prompt_ids):] = 1
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id,
                              max_new_tokens=max(j.params.max_tokens for j in batch))
        for row, j in zip(out[:, width:].tolist(), batch):
            produced += _useful(row, j, eos_ids)
    return BaselineRun(produced, time.perf_counter() - t0)


def _useful(row: list[int], job: Job, eos_ids: frozenset[int]) -> int:
    """Tokens a request keeps: up to its own budget, and (unless it ignores EOS) up to and including EOS."""
    row = row[:job.params.max_tokens]
    if not job.params.ignore_eos:
        end = next((k for k, t in enumerate(row) if t in eos_ids), None)
        row = row if end is None else row[:end + 1]
    return len(row)


def run_hf_continuous(hf, jobs: Seq[Job], batch_size: int, pad_id: int, eos_ids: frozenset[int]) -> BaselineRun:
    """transformers' continuous batching: every request at once through `generate_batch` (greedy), at most
    `batch_size` running together. One generation config serves all, so each runs to the largest budget unless
    it meets EOS, and only its useful tokens count (as for static batching). A warm-up call first, with a
    persistent manager: setting up the paged cache and its manager is paid once per process, not per request
    set.

    The paged cache is sized to hold every job whole at once: left to itself, transformers sizes it from the
    machine's free memory (90% of it on CPU), 14 GB for four tiny requests on a 24 GB machine."""
    from transformers import ContinuousBatchingConfig, GenerationConfig   # a bench/test extra
    budget = max(j.params.max_tokens for j in jobs)
    cfg = GenerationConfig(max_new_tokens=budget, do_sample=False, eos_token_id=sorted(eos_ids), pad_token_id=pad_id)
    page = ContinuousBatchingConfig().page_size
    cache = ContinuousBatchingConfig(num_blocks=sum(ceil_div(len(j.prompt_ids) + budget, page) for j in jobs) + 1)
    with torch.inference_mode():
        hf.generate_batch(inputs=[jobs[0].prompt_ids], generation_config=GenerationConfig(
            max_new_tokens=2, do_sample=False, eos_token_id=sorted(eos_ids), pad_token_id=pad_id),
            continuous_batching_config=cache, progress_bar=False, persistent_manager=True)
        t0 = time.perf_counter()
        out = hf.generate_batch(inputs=[j.prompt_ids for j in jobs], generation_config=cfg, progress_bar=False,
                                continuous_batching_config=cache, persistent_manager=True)
        seconds = time.perf_counter() - t0
    results = list(out.values())
    if len(results) != len(jobs) or any(r.error is not None for r in results):
        raise RuntimeError(f"generate_batch answered {len(results)} of {len(jobs)} requests")
    return BaselineRun(sum(_useful(list(r.generated_tokens), j, eos_ids) for r, j in zip(results, jobs)), seconds)


def pad_token(hf, eos_ids: frozenset[int]) -> int:
    """Padding id for left padding: the model's own, else an EOS id (masked positions never matter)."""
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else hf.generation_config.pad_token_id
    return pad if pad is not None else min(eos_ids, default=0)
