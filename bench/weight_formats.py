"""The whole model's decode step (and its head) on the weight formats and instruction sets our kernels have, against bf16,
interleaved repeat by repeat in one process:

- fp32 blocks: rowdot's own fp32 weights (what a folder without the GGUF file's groups serves), AVX2 tiles;
- file's groups, AVX2: the Q4_1 / Q8_0 groups the conversion kept (tether/model/rowquant.py), AVX2 only;
- file's groups, AVX-512: the same where the CPU has AVX-512 (what `--dtype auto` serves there);
- q8 inputs, AVX2 / AVX-512 VNNI: the same groups with each linear's inputs rounded to 8 bits, llama.cpp's
  arithmetic (`--linear-inputs q8`, tether/model/rowq8.py; VNNI where the CPU has it);
- bf16: the bf16 rule's kernels, where the CPU has native bf16 and its probe passes.

The first three give the same bits (tests/tether/model/test_rowquant.py, test_rowdot.py); q8 and bf16 give their own.

    .venv/bin/python bench/weight_formats.py --batches 1,8,32 --threads 2

Each figure is the median over repeats of the median step of `--steps` steps (B requests at `--context` positions,
one new row each; "threads" as a frame alone in the pipeline runs them), then the head over the B rows. Machines
are noisy: read the ratios, measured side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.layer_rules import decode_ms  # noqa: E402
from tether.model import native, numerics  # noqa: E402
from tether.model.config import ModelConfig  # noqa: E402
from tether.model.llama import Linear, ModelSlice  # noqa: E402
from tether.model.loader import load_slice, resolve_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="preset or HF folder (default: %(default)s)")
    p.add_argument("--batches", default="1,8,32", help="requests a step (default: %(default)s)")
    p.add_argument("--threads", default="2", help="threads a step runs on (default: %(default)s)")
    p.add_argument("--context", type=int, default=100, help="positions each request holds (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="steps a repeat (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="(default: %(default)s)")
    args = p.parse_args()
    if native.available() is not None:
        raise SystemExit(f"our kernels do not run here: {native.available()}")
    torch.set_num_threads(max(int(t) for t in args.threads.split(",")))
    folder = resolve_model(args.model)
    end = ModelConfig.from_folder(folder).num_hidden_layers

    def fp32(groups: bool, inputs: str = "float32") -> ModelSlice:
        m = load_slice(folder, 0, end, dtype="float32", inputs=inputs)
        if not groups:
            for lin in m.modules():
                if isinstance(lin, Linear):
                    lin.blocks = None
        return m

    lib = native.library()
    wide = bool(lib.kernels_isa(-1))
    variants: dict[str, tuple[ModelSlice, int]] = {"fp32 blocks": (fp32(False), 0), "file's groups, AVX2": (fp32(True), 0)}
    if wide:
        variants["file's groups, AVX-512"] = (fp32(True), 1)
    variants["q8 inputs, AVX2"] = (fp32(True, "q8"), 0)
    if wide and lib.rowq8_isa():
        variants["q8 inputs, AVX-512 VNNI"] = (fp32(True, "q8"), 1)
    cfg = ModelConfig.from_folder(folder)
    if numerics.servable_rule(cfg, torch.bfloat16) is not None and not numerics.BF16_FLAGS.isdisjoint(numerics.cpu_flags()):
        variants["bf16"] = (load_slice(folder, 0, end, dtype="bfloat16"), int(wide))
    print(f"{args.model}, whole model ({end} layers) and head, torch {torch.__version__}, kernels {native.describe()}")
    print("| batch | threads | " + " | ".join(f"{name}: step / head (ms)" for name in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            for threads in (int(t) for t in args.threads.split(",")):
                got: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
                for _ in range(args.repeats):
                    for name, (model, isa) in variants.items():
                        lib.kernels_isa(isa)
                        got[name].append(decode_ms(model, batch, threads, args.context, args.steps, head=True))
                cells = []
                for name in variants:
                    s = statistics.median(x[0] for x in got[name])
                    h = statistics.median(x[1] for x in got[name])
                    cells.append(f"{s:.1f} / {h:.1f}")
                print(f"| {batch} | {threads} | " + " | ".join(cells) + " |", flush=True)
    finally:
        lib.kernels_isa(1)


if __name__ == "__main__":
    main()
