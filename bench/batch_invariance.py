"""Cost of batch invariance: decode and prefill throughput of the invariant kernels divided by the plain ones.

Both variants run in this process, on the same weights and threads, interleaved repeat by repeat; the figure
is the median over repeats of the per-repeat ratio (the machine is shared and noisy: ratios side by side,
never a bare time).

    .venv/bin/python bench/batch_invariance.py --model tiny --model small
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tether.model.llama import ModelSlice, SlotRows
from tether.model.loader import load_slice, resolve_model


def _prefilled(model: ModelSlice, batch: int, context: int, g: torch.Generator):
    kvs = []
    for _ in range(batch):
        kv = model.new_kv()
        kv.ensure(context + 64)
        model(torch.randint(0, 256, (context,), generator=g), [SlotRows(kv, 0, context)])
        kv.length = context
        kvs.append(kv)
    return kvs


def decode_tokens_per_s(model: ModelSlice, batch: int, context: int, steps: int) -> float:
    g = torch.Generator().manual_seed(0)
    kvs = _prefilled(model, batch, context, g)
    t = time.perf_counter()
    for _ in range(steps):
        h = model(torch.randint(0, 256, (batch,), generator=g), [SlotRows(kv, kv.length, 1) for kv in kvs])
        model.logits(h)
        for kv in kvs:
            kv.length += 1
    return batch * steps / (time.perf_counter() - t)


def prefill_tokens_per_s(model: ModelSlice, batch: int, prompt: int) -> float:
    g = torch.Generator().manual_seed(1)
    kvs = [model.new_kv() for _ in range(batch)]
    for kv in kvs:
        kv.ensure(prompt)
    ids = torch.randint(0, 256, (batch * prompt,), generator=g)
    t = time.perf_counter()
    h = model(ids, [SlotRows(kv, 0, prompt) for kv in kvs])
    model.logits(h[prompt - 1::prompt])
    return batch * prompt / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="preset or HF folder (repeatable; default tiny and small)")
    p.add_argument("--batches", default="1,8,32,64", help="batch sizes (default: %(default)s)")
    p.add_argument("--context", type=int, default=128, help="decode context length (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=128, help="prefill prompt length (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="decode steps per repeat (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats; the median ratio is reported")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratio = invariant / plain throughput "
          f"(median of {args.repeats} interleaved repeats)\n")
    print("| model | batch | decode tok/s plain | decode ratio | prefill tok/s plain | prefill ratio |")
    print("|---|---|---|---|---|---|")
    for name in args.model or ["tiny", "small"]:
        folder = resolve_model(name)
        plain, inv = load_slice(folder), load_slice(folder)
        plain.batch_invariant, inv.batch_invariant = False, True
        for b in batches:
            dec, pre, dec_plain, pre_plain = [], [], [], []
            decode_tokens_per_s(plain, b, args.context, 2)   # warm-up both paths
            decode_tokens_per_s(inv, b, args.context, 2)
            for _ in range(args.repeats):
                dp = decode_tokens_per_s(plain, b, args.context, args.steps)
                di = decode_tokens_per_s(inv, b, args.context, args.steps)
                pp = prefill_tokens_per_s(plain, b, args.prompt)
                pi = prefill_tokens_per_s(inv, b, args.prompt)
                dec.append(di / dp)
                pre.append(pi / pp)
                dec_plain.append(dp)
                pre_plain.append(pp)
            print(f"| {name} | {b} | {statistics.median(dec_plain):.0f} | {statistics.median(dec):.2f} | "
                  f"{statistics.median(pre_plain):.0f} | {statistics.median(pre):.2f} |", flush=True)


if __name__ == "__main__":
    main()
