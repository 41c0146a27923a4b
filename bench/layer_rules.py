"""One slice's decode step under the rule the machine chose and under the same rule with its layers run by
torch's modules (`RowRule.layers` "modules": op by op on the same linear and attention kernels), interleaved
repeat by repeat in one process: what running a step's layers in one C call (tether/model/rowlayer.py) buys.

    .venv/bin/python bench/layer_rules.py --model smollm2 --layers 15 --batches 1,8 --threads 1,2

Each figure is the median step time over repeats of `--steps` steps (B requests at `--context` positions, one
new row each); "threads" runs the step as a frame alone in the pipeline does (`wide`). Machines are noisy: read
the ratio of the two rules, measured side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.model.invariant import RowRule  # noqa: E402
from tether.model.llama import ModelSlice, SlotRows  # noqa: E402
from tether.model.loader import load_slice, resolve_model  # noqa: E402


def decode_ms(model: ModelSlice, batch: int, threads: int, context: int, steps: int,
              head: bool = False) -> tuple[float, float]:
    """Median decode step of `batch` requests at `context` positions, one new row each, on `threads` threads (as a
    frame alone in the pipeline runs), and, with `head` (a slice that has it), of the head over those rows: ms."""
    g = torch.Generator().manual_seed(0)
    kvs = []
    for _ in range(batch):
        kv = model.new_kv()
        kv.ensure(context + steps)
        model(torch.randint(0, 256, (context,), generator=g), [SlotRows(kv, 0, context)], threads)
        kv.length = context
        kvs.append(kv)
    layers: list[float] = []
    heads: list[float] = []
    for _ in range(steps):
        t = time.perf_counter()
        h = model(torch.randint(0, 256, (batch,), generator=g), [SlotRows(kv, kv.length, 1) for kv in kvs], threads)
        t1 = time.perf_counter()
        layers.append(t1 - t)
        if head:
            model.logits(h, threads)
            heads.append(time.perf_counter() - t1)
        for kv in kvs:
            kv.length += 1
    for kv in kvs:
        kv.release()
    return statistics.median(layers) * 1000, statistics.median(heads) * 1000 if heads else 0.0


def step_ms(model: ModelSlice, rule: RowRule, batch: int, threads: int, context: int, steps: int) -> float:
    model.rows = rule
    return decode_ms(model, batch, threads, context, steps)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="preset or HF folder (default: %(default)s)")
    p.add_argument("--layers", type=int, default=15, help="layers of the slice, from 0 (default: %(default)s)")
    p.add_argument("--batches", default="1,8", help="requests a step (default: %(default)s)")
    p.add_argument("--threads", default="1,2", help="threads a step runs on (default: %(default)s)")
    p.add_argument("--context", type=int, default=100, help="positions each request holds (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="steps a repeat (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="(default: %(default)s)")
    args = p.parse_args()
    torch.set_num_threads(max(int(t) for t in args.threads.split(",")))
    model = load_slice(resolve_model(args.model), 0, args.layers, dtype="float32")
    chosen = model.rows
    if chosen.layers == "modules":
        raise SystemExit(f"the probe chose {chosen} here: no one-call layers to compare (our kernels run "
                         f"where AVX2, FMA and a C compiler are)")
    modules = dataclasses.replace(chosen, layers="modules")
    print(f"{args.model}, {args.layers} layers, torch {torch.__version__}; rule: {chosen}")
    print("| batch | threads | modules (ms) | one call (ms) | ratio |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for threads in (int(t) for t in args.threads.split(",")):
            got: dict[str, list[float]] = {"modules": [], "rowlayer": []}
            for _ in range(args.repeats):
                got["modules"].append(step_ms(model, modules, batch, threads, args.context, args.steps))
                got["rowlayer"].append(step_ms(model, chosen, batch, threads, args.context, args.steps))
            a, b = statistics.median(got["modules"]), statistics.median(got["rowlayer"])
            print(f"| {batch} | {threads} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
