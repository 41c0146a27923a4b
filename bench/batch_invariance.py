"""Cost of batch invariance: decode and prefill throughput of the invariant kernels divided by the plain ones.

Both variants run in this process, on the same weights and threads, interleaved repeat by repeat; the figure
is the median over repeats of the per-repeat ratio (the machine is shared and noisy: ratios side by side,
never a bare time).

    .venv/bin/python bench/batch_invariance.py --model tiny --model small

Decode runs B requests at one context length, then at mixed lengths (uniform in 16..4*context: the
invariant kernels never pad a request's keys to its neighbours'); prefill runs B prompts in one micro-batch,
then one long prompt alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tether.model.llama import ModelSlice, SlotRows
from tether.model.loader import load_slice, resolve_model


def _prefilled(model: ModelSlice, contexts: list[int], g: torch.Generator):
    kvs = []
    for context in contexts:
        kv = model.new_kv()
        kv.ensure(context + 64)
        model(torch.randint(0, 256, (context,), generator=g), [SlotRows(kv, 0, context)])
        kv.length = context
        kvs.append(kv)
    return kvs


def decode_tokens_per_s(model: ModelSlice, contexts: list[int], steps: int) -> float:
    """B = len(contexts) requests decoding together, each from its own context length."""
    g = torch.Generator().manual_seed(0)
    kvs = _prefilled(model, contexts, g)
    t = time.perf_counter()
    for _ in range(steps):
        h = model(torch.randint(0, 256, (len(kvs),), generator=g), [SlotRows(kv, kv.length, 1) for kv in kvs])
        model.logits(h)
        for kv in kvs:
            kv.length += 1
    elapsed = time.perf_counter() - t
    for kv in kvs:
        kv.release()
    return len(kvs) * steps / elapsed


def prefill_tokens_per_s(model: ModelSlice, batch: int, prompt: int) -> float:
    g = torch.Generator().manual_seed(1)
    kvs = [model.new_kv() for _ in range(batch)]
    for kv in kvs:
        kv.ensure(prompt)
    ids = torch.randint(0, 256, (batch * prompt,), generator=g)
    t = time.perf_counter()
    h = model(ids, [SlotRows(kv, 0, prompt) for kv in kvs])
    model.logits(h[prompt - 1::prompt])
    elapsed = time.perf_counter() - t
    for kv in kvs:
        kv.release()
    return batch * prompt / elapsed


def ratio(plain: ModelSlice, inv: ModelSlice, run, repeats: int) -> tuple[float, float]:
    """(median plain throughput, median invariant/plain ratio) over interleaved repeats, after a warm-up."""
    run(plain), run(inv)
    plain_rates, ratios = [], []
    for _ in range(repeats):
        p, i = run(plain), run(inv)
        plain_rates.append(p)
        ratios.append(i / p)
    return statistics.median(plain_rates), statistics.median(ratios)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="preset or HF folder (repeatable; default tiny and small)")
    p.add_argument("--batches", default="1,8,32,64", help="batch sizes (default: %(default)s)")
    p.add_argument("--context", type=int, default=128, help="decode context length (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=128, help="prefill prompt length (default: %(default)s)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per repeat (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats; the median ratio is reported")
    p.add_argument("--long", type=int, default=1500, help="one long prompt's length (0 skips; default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratio = invariant / plain throughput "
          f"(median of {args.repeats} interleaved repeats)\n")
    print("| model | batch | decode tok/s plain | decode ratio | mixed-context decode ratio "
          "| prefill tok/s plain | prefill ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in args.model or ["tiny", "small"]:
        folder = resolve_model(name)
        plain, inv = load_slice(folder), load_slice(folder)
        plain.batch_invariant, inv.batch_invariant = False, True
        for b in batches:
            mixed = torch.randint(16, 4 * args.context, (b,), generator=torch.Generator().manual_seed(b)).tolist()
            dec_plain, dec = ratio(plain, inv, lambda m: decode_tokens_per_s(m, [args.context] * b, args.steps),
                                   args.repeats)
            _, dec_mixed = ratio(plain, inv, lambda m: decode_tokens_per_s(m, mixed, args.steps), args.repeats)
            pre_plain, pre = ratio(plain, inv, lambda m: prefill_tokens_per_s(m, b, args.prompt), args.repeats)
            print(f"| {name} | {b} | {dec_plain:.0f} | {dec:.2f} | {dec_mixed:.2f} | {pre_plain:.0f} | {pre:.2f} |",
                  flush=True)
        if args.long:
            long_plain, long_ratio = ratio(plain, inv, lambda m: prefill_tokens_per_s(m, 1, args.long), args.repeats)
            print(f"| {name} | 1 × {args.long}-token prompt | | | | {long_plain:.0f} | {long_ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
