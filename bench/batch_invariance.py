"""Cost of batch invariance: decode and prefill throughput of the invariant kernels divided by the plain ones
(tether/model/plain.py, a baseline that exists for this benchmark only).

Both variants run in this process, on the same weights and threads, interleaved repeat by repeat; the figure
is the median over repeats of the per-repeat ratio (the machine is shared and noisy: ratios side by side,
never a bare time).

    .venv/bin/python bench/batch_invariance.py --model tiny --model small
    .venv/bin/python bench/batch_invariance.py --breakdown     # where a batch-1 decode step's time goes

Decode runs B requests at one context length, then at mixed lengths (uniform in 16..4*context: the
invariant kernels never pad a request's keys to its neighbours'); prefill runs B prompts in one micro-batch,
then one long prompt alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tether.model.invariant import padded_rows
from tether.model.llama import ModelSlice, SlotRows
from tether.model import dtypes, numerics
from tether.model.loader import load_slice, resolve_model
from tether.model.plain import PlainSlice

Model = ModelSlice | PlainSlice   # the invariant kernels, or the plain ones over the same weights


def _prefilled(model: Model, contexts: list[int], g: torch.Generator):
    kvs = []
    for context in contexts:
        kv = model.new_kv()
        kv.ensure(context + 64)
        model(torch.randint(0, 256, (context,), generator=g), [SlotRows(kv, 0, context)])
        kv.length = context
        kvs.append(kv)
    return kvs


def decode_tokens_per_s(model: Model, contexts: list[int], steps: int) -> float:
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


def prefill_tokens_per_s(model: Model, batch: int, prompt: int) -> float:
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


def ratio(plain: PlainSlice, inv: ModelSlice, run, repeats: int) -> tuple[float, float]:
    """(median plain throughput, median invariant/plain ratio) over interleaved repeats, after a warm-up."""
    run(plain), run(inv)
    plain_rates, ratios = [], []
    for _ in range(repeats):
        p, i = run(plain), run(inv)
        plain_rates.append(p)
        ratios.append(i / p)
    return statistics.median(plain_rates), statistics.median(ratios)


def _decode_slot(model: Model, context: int) -> list[SlotRows]:
    kv = model.new_kv()
    kv.ensure(context + 1)
    model(torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(2)), [SlotRows(kv, 0, context)])
    kv.length = context
    return [SlotRows(kv, context, 1)]


@torch.inference_mode()
def breakdown(plain: PlainSlice, inv: ModelSlice, context: int, repeats: int) -> dict[str, float]:
    """A batch-1 decode step's pieces, each as a share of the plain step (medians of interleaved repeats): the
    rule's linears as served (padded rows, its kernel) against F.linear at 1 row, its attention (tiles or
    rowattn) against SDPA, and the plan."""
    cfg, rows = inv.cfg, padded_rows(1, inv.rows)
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    si, sp = _decode_slot(inv, context), _decode_slot(plain, context)
    plan = inv.attention_plan(si, rows)
    q, k = torch.randn(rows, heads, d).to(inv.dtype), torch.randn(rows, kv_heads, d).to(inv.dtype)
    linears = [m for m in inv.modules() if isinstance(m, torch.nn.Linear)]   # tether's Linear: the rule's kernel
    xs = [torch.randn(rows, m.in_features).to(inv.dtype) for m in linears]
    per_slot, layers = plain.attention(sp), range(cfg.num_hidden_layers)
    pieces = {
        "step, plain": lambda: plain.logits(plain(torch.tensor([5]), sp)),
        "step, invariant": lambda: inv.logits(inv(torch.tensor([5]), si)),
        f"linears as served ({inv.rows.linear}, {rows} rows)": lambda: [m(x) for x, m in zip(xs, linears)],
        "linears plain (F.linear, 1 row)": lambda: [F.linear(x[:1], m.weight) for x, m in zip(xs, linears)],
        f"attention as served ({inv.rows.attention}), every layer": lambda: [plan.attend(q, k, k, 0) for _ in layers],
        "SDPA per request, every layer": lambda: [per_slot.attend(q[:1], k[:1], k[:1], 0) for _ in layers],
        "attention plan": lambda: inv.attention_plan(si, rows),
    }
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for _ in range(repeats + 1):   # the first round warms up
        for name, f in pieces.items():
            t = time.perf_counter()
            for _ in range(20):
                f()
            times[name].append(time.perf_counter() - t)
    base = times["step, plain"][1:]
    return {name: statistics.median(t / b for t, b in zip(ts[1:], base)) for name, ts in times.items()}


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
    p.add_argument("--dtype", default="float32", choices=dtypes.CHOICES,
                   help="both sides' dtype; auto: the services' choice here (default: %(default)s)")
    p.add_argument("--padded", action="store_true", help="pad the invariant kernels' rows as fp32 does, also where "
                   "the probe lets the dtype run unpadded (bf16 before its floor was found: the cost of padding)")
    p.add_argument("--breakdown", action="store_true", help="only a batch-1 decode step's pieces, as shares of "
                   "the plain step")
    p.add_argument("--plain-linears", choices=("torch", "rule"), default="torch",
                   help="the plain side's linears: torch's own F.linear, or the invariant rule's kernel (oneDNN "
                        "packed for bf16 on a CPU that has it) without its rows floor: the cost of invariance "
                        "alone (default: %(default)s)")
    args = p.parse_args()

    def plain_of(folder) -> PlainSlice:
        model = load_slice(folder, dtype=args.dtype)
        return PlainSlice(model, model.rows.linear if args.plain_linears == "rule" else "mkl")

    def invariant(folder) -> ModelSlice:
        inv = load_slice(folder, dtype=args.dtype)
        if args.padded and not inv.rows.padded:
            padded = numerics.padded_probe(inv.cfg, inv.dtype)
            if padded is None:
                raise SystemExit(f"--padded: no padded {inv.dtype} kernels are invariant here")
            inv.rows = numerics.with_thread_cap(inv.cfg, inv.dtype, padded)
        return inv

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.breakdown:
        for name in args.model or ["tiny", "small"]:
            plain, inv = plain_of(resolve_model(name)), invariant(resolve_model(name))
            for piece, share in breakdown(plain, inv, args.context, args.repeats).items():
                print(f"{name:6s} {piece:32s} {share:.2f}× the plain step")
        return
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, --dtype {args.dtype}, invariant kernels "
          f"{'padded (--padded)' if args.padded else 'as served'}, plain linears {args.plain_linears}; ratio = invariant / plain throughput "
          f"(median of {args.repeats} interleaved repeats)\n")
    print("| model | batch | decode tok/s plain | decode ratio | mixed-context decode ratio "
          "| prefill tok/s plain | prefill ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in args.model or ["tiny", "small"]:
        folder = resolve_model(name)
        plain, inv = plain_of(folder), invariant(folder)
        print(f"<!-- {name}: {inv.dtype}, {inv.rows} -->")
        for b in batches:
            mixed = torch.randint(16, 4 * args.context, (b,), generator=torch.Generator().manual_seed(b)).tolist()
            dec_plain, dec = ratio(plain, inv, lambda m, b=b: decode_tokens_per_s(m, [args.context] * b, args.steps),
                                   args.repeats)
            _, dec_mixed = ratio(plain, inv, lambda m, mixed=mixed: decode_tokens_per_s(m, mixed, args.steps),
                                 args.repeats)
            pre_plain, pre = ratio(plain, inv, lambda m, b=b: prefill_tokens_per_s(m, b, args.prompt), args.repeats)
            print(f"| {name} | {b} | {dec_plain:.0f} | {dec:.2f} | {dec_mixed:.2f} | {pre_plain:.0f} | {pre:.2f} |",
                  flush=True)
        if args.long:
            long_plain, long_ratio = ratio(plain, inv, lambda m: prefill_tokens_per_s(m, 1, args.long), args.repeats)
            print(f"| {name} | 1 × {args.long}-token prompt | | | | {long_plain:.0f} | {long_ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
