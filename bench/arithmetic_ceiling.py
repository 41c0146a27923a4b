"""The most output tok/s tether's arithmetic allows on this machine at a given concurrency, measured, not derived
from an instruction table: what bench/llama_server_vs_tether.py prints beside each synthetic ratio, so that a
target out of reach shows why (the arithmetic) or that the rest of the serving is what is missing.

At C streams of --input-len / --output-len requests, with one micro-batch in flight (as tether runs up to 32
requests), every round decodes C rows through all the layers and the head, and a new request's prompt is
prefilled once per --output-len tokens it yields: per round C / output_len prefills. The whole model in one
process on the threads the stages have in total, the same numerics (`--dtype auto`, --linear-inputs) and
instruction sets; each time a median. Sampling, the hops and the coordinator are left out: the gap between this
ceiling and the served rate is theirs (and the other processes' share of the cores).

    .venv/bin/python bench/arithmetic_ceiling.py --concurrency 1,8,32 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.layer_rules import decode_ms  # noqa: E402
from tether import settings  # noqa: E402
from tether.model import dtypes  # noqa: E402
from tether.model.llama import SlotRows  # noqa: E402
from tether.model.loader import load_slice, resolve_model  # noqa: E402


@dataclass(frozen=True)
class Round:
    """One concurrency's round, timed: C decode rows through the layers and the head, and a prompt's prefill."""

    concurrency: int
    decode_ms: float     # the C rows through every layer
    head_ms: float       # ... and the head
    prefill_ms: float    # one prompt of input_len tokens through every layer (its head: one row, left out)

    def tok_s(self, output_len: int) -> float:
        """Output tok/s if rounds were only this arithmetic: C tokens a round, C / output_len prefills in it."""
        c = self.concurrency
        ms = self.decode_ms + self.head_ms + c / output_len * self.prefill_ms
        return c / ms * 1000.0


def prefill_ms(model, input_len: int, threads: int, repeats: int = 3) -> float:
    times = []
    g = torch.Generator().manual_seed(1)
    for _ in range(repeats):
        kv = model.new_kv()
        kv.ensure(input_len)
        tokens = torch.randint(0, 256, (input_len,), generator=g)
        t = time.perf_counter()
        model(tokens, [SlotRows(kv, 0, input_len)], threads)
        times.append(time.perf_counter() - t)
        kv.release()
    return statistics.median(times) * 1000


def measure(concurrencies: list[int], threads: int, input_len: int, output_len: int, linear_inputs: str,
            model_name: str = "smollm2", repeats: int = 3) -> list[Round]:
    """Each concurrency's round on this machine (the whole model in this process, `threads` threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = load_slice(resolve_model(model_name), dtype="auto", inputs=linear_inputs)
        context = input_len + output_len // 2   # a decode row's mean position over a request
        pre = prefill_ms(model, input_len, threads)
        rounds = []
        for c in concurrencies:
            runs = [decode_ms(model, c, threads, context, 6, head=True) for _ in range(repeats)]
            rounds.append(Round(c, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), pre))
        return rounds
    finally:
        torch.set_num_threads(before)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="threads, the stages' in total (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--linear-inputs", default=settings.LINEAR_INPUTS, choices=dtypes.LINEAR_INPUTS,
                   help="what the linears multiply, as the stages' --linear-inputs (default: %(default)s)")
    args = p.parse_args()
    for r in measure([int(c) for c in args.concurrency.split(",")], args.threads, args.input_len, args.output_len,
                     args.linear_inputs):
        print(f"{r.concurrency:3d} streams: decode {r.decode_ms:6.2f} ms + head {r.head_ms:5.2f} + "
              f"{r.concurrency}/{args.output_len} x prefill {r.prefill_ms:6.1f} -> at most {r.tok_s(args.output_len):6.1f} tok/s")


if __name__ == "__main__":
    main()
