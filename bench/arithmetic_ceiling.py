"""The most output tok/s tether's arithmetic allows on this machine at a given concurrency, measured, not derived
from an instruction table: what bench/llama_server_vs_tether.py prints beside each synthetic ratio, so that a
target out of reach shows why (the arithmetic) or that the rest of the serving is what is missing.

At C streams of --input-len / --output-len requests, with one micro-batch in flight (as tether runs up to 32
requests), every round decodes C rows through all the layers and the head, and a new request's prompt is
prefilled once per --output-len tokens it yields: per round C / output_len prefills. A prompt is prefilled as
served: --input-len tokens of text sent as one user message, so with the model's chat template around them
(smollm2's system turn adds 30 tokens: 64 become 94), after the start every prompt shares (the template's system
turn and the user turn's header: the prefix cache serves it from a cached block, docs/PROTOCOL.md "Prefix cache"),
and as many prompts to a call as the coordinator puts in a micro-batch (MAX_BATCH_TOKENS computed rows, at most C
prompts). The whole model in one process on the threads the stages
have in total, the same numerics (`--dtype auto`, --linear-inputs) and instruction sets; each time a median.
Sampling, the hops and the coordinator are left out: the gap between this ceiling and the served rate is theirs
(and the other processes' share of the cores).

    .venv/bin/python bench/arithmetic_ceiling.py --concurrency 1,8,32 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.layer_rules import decode_ms  # noqa: E402
from tether import settings  # noqa: E402
from tether.loadtest.workloads import SyntheticSpec, Workload  # noqa: E402
from tether.model import dtypes, native  # noqa: E402
from tether.model.chat_template import load_chat_template, tokenize_conversation  # noqa: E402
from tether.model.config import ModelConfig  # noqa: E402
from tether.model.folder import load_model_tokenizer  # noqa: E402
from tether.model.llama import SlotRows  # noqa: E402
from tether.model.loader import load_slice, resolve_model  # noqa: E402


@dataclass(frozen=True)
class Round:
    """One concurrency's round, timed: C decode rows through the layers and the head, and a prompt's prefill."""

    concurrency: int
    decode_ms: float     # the C rows through every layer
    head_ms: float       # ... and the head
    prefill_ms: float    # one prompt as served, through every layer (its head: one row, left out), batched as served
    prompt_tokens: int = 0   # the prompt's tokens as served (the text's and its chat template's)
    decode_gflop: float = 0.0    # the round's decode rows and head: 2 a multiply-add (linears and attention)
    prefill_gflop: float = 0.0   # one prompt's prefill
    cached_tokens: int = 0       # of the prompt's tokens, those the prefix cache serves (not prefilled)
    prompts_a_call: int = 1      # prompts prefilled together in one call (prefill_ms is one prompt's share)

    def rates(self) -> tuple[float, float]:
        """GFLOP/s of the decode rows with their head, and of a prefill."""
        return (self.decode_gflop / (self.decode_ms + self.head_ms) * 1000.0,
                self.prefill_gflop / self.prefill_ms * 1000.0 if self.prefill_ms else 0.0)

    def tok_s(self, output_len: int) -> float:
        """Output tok/s if rounds were only this arithmetic: C tokens a round, C / output_len prefills in it."""
        c = self.concurrency
        ms = self.decode_ms + self.head_ms + c / output_len * self.prefill_ms
        return c / ms * 1000.0


def model_gflop(cfg: ModelConfig, rows: int, context: int, head_rows: int = 0, causal: bool = False) -> float:
    """The multiply-adds (2 FLOPs each) of `rows` rows through every layer (linears, and attention over `context`
    positions each, or with `causal` over context + 1..rows: a prompt after `context` cached positions) and of
    `head_rows` rows through the head."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    linear = h * q * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size
    positions = rows * context + (rows * (rows + 1) // 2 if causal else 0)
    attention = 2 * q * positions   # q . k and p . v: a head_dim each, every head, every position
    return 2 * (cfg.num_hidden_layers * (rows * linear + attention) + head_rows * h * cfg.vocab_size) / 1e9


def fma_rate(threads: int, wide: bool, repeats: int = 5) -> float | None:
    """The fp32 GFLOP/s `threads` threads sustain in FMAs on registers (bench/fma_rate.c, 512 bits wide where
    the kernels use AVX-512): the median of `repeats` ~0.2 s runs; None where no C compiler builds it."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="fma-rate-") as tmp:
        lib_path = Path(tmp) / "fma_rate.so"
        done = subprocess.run([cc, "-O2", "-fopenmp", "-shared", "-fPIC", "-o", str(lib_path),
                               str(Path(__file__).with_name("fma_rate.c"))], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        lib = ctypes.CDLL(str(lib_path))
        lib.fma_rate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        lib.fma_rate.restype = ctypes.c_double
        lib.fma_rate(threads, int(wide), 1_000_000)   # the clocks up, the threads started
        return statistics.median(lib.fma_rate(threads, int(wide), 4_000_000) for _ in range(repeats))


def kernels_wide() -> bool:
    """Whether the stages' kernels run AVX-512 here (the probe's choice, TETHER_KERNELS_ISA honoured)."""
    return native.available() is None and bool(native.library().kernels_isa(-1))


def prompts_per_call(concurrency: int, prompt_tokens: int) -> int:
    """How many new prompts the coordinator prefills in one micro-batch: as many whole prompts as fit in
    MAX_BATCH_TOKENS rows (a longer one goes in chunks, one prompt a call), at most one per stream."""
    return max(1, min(concurrency, settings.MAX_BATCH_SLOTS, settings.MAX_BATCH_TOKENS // max(1, prompt_tokens)))


def prefill_ms(model, prompt_tokens: int, threads: int, prompts: int = 1, repeats: int = 3, cached: int = 0) -> float:
    """A prompt's share of a call that prefills `prompts` prompts of `prompt_tokens` tokens together, each after
    its first `cached` positions (already in its KV, untimed): ms."""
    times = []
    g = torch.Generator().manual_seed(1)
    rows = prompt_tokens - cached
    for _ in range(repeats):
        kvs = [model.new_kv() for _ in range(prompts)]
        for kv in kvs:
            kv.ensure(prompt_tokens)
        if cached:
            model(torch.randint(0, 256, (prompts * cached,), generator=g),
                  [SlotRows(kv, 0, cached) for kv in kvs], threads)
        tokens = torch.randint(0, 256, (prompts * rows,), generator=g)
        t = time.perf_counter()
        model(tokens, [SlotRows(kv, cached, rows) for kv in kvs], threads)
        times.append(time.perf_counter() - t)
        for kv in kvs:
            kv.release()
    return statistics.median(times) * 1000 / prompts


def chat_prompt_tokens(folder: str | Path, prompts: list[str]) -> tuple[int, int]:
    """The median token count of `prompts`, each sent as one user message, as admission renders and tokenizes
    it (tokenize_conversation: the model's chat template around the text), and how many tokens they all start
    with (what the prefix cache serves every prompt but the first: never the last token)."""
    tok = load_model_tokenizer(folder)
    template = load_chat_template(folder)
    served = [tokenize_conversation(template, tok, [("user", p)])[1] for p in prompts]
    shared = 0
    while all(len(ids) > shared + 1 and ids[shared] == served[0][shared] for ids in served):
        shared += 1
    return round(statistics.median(len(ids) for ids in served)), shared


def synthetic_prompt_tokens(folder: str | Path, input_len: int, samples: int = 8) -> tuple[int, int]:
    """A synthetic --input-len request's prompt as served (the load's own prompts: tether/loadtest/workloads.py):
    its tokens, and those every prompt shares (`chat_prompt_tokens`)."""
    spec = SyntheticSpec(input_len, 1, 0.0)
    prompts = [r.prompt for r in Workload({"synthetic": 1.0}, load_model_tokenizer(folder).encode, spec)
               .take(samples, "arithmetic-ceiling")]
    return chat_prompt_tokens(folder, prompts)


def measure(concurrencies: list[int], threads: int, prompt_tokens: int, output_len: int, linear_inputs: str,
            model_name: str = "smollm2", repeats: int = 3, cached: int = 0, together: bool = True) -> list[Round]:
    """Each concurrency's round on this machine (the whole model in this process, `threads` threads), for
    prompts of `prompt_tokens` tokens as served, the first `cached` from the prefix cache
    (`synthetic_prompt_tokens`). `together`: prompts arrive together (synthetic's waves, `prompts_per_call` of
    them a call); else one at a time (chat's, whose answers end apart), one a call."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        folder = resolve_model(model_name)
        cfg = ModelConfig.from_folder(folder)
        model = load_slice(folder, dtype="auto", inputs=linear_inputs)
        context = prompt_tokens + output_len // 2   # a decode row's mean position over a request
        prefills: dict[int, float] = {}
        rounds = []
        for c in concurrencies:
            k = prompts_per_call(c, prompt_tokens - cached) if together else 1
            if k not in prefills:
                prefills[k] = prefill_ms(model, prompt_tokens, threads, k, cached=cached)
            runs = [decode_ms(model, c, threads, context, 6, head=True) for _ in range(repeats)]
            rounds.append(Round(c, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                                prefills[k], prompt_tokens, model_gflop(cfg, c, context, head_rows=c),
                                model_gflop(cfg, prompt_tokens - cached, cached, causal=True), cached, k))
        return rounds
    finally:
        torch.set_num_threads(before)


def rates_text(r: Round, peak: float | None) -> str:
    """The round's arithmetic rates, and their share of the measured FMA rate where there is one."""
    decode, prefill = r.rates()
    share = (lambda x: f" ({x / peak:.0%})") if peak else (lambda x: "")
    return f"decode + head {decode:.0f} GFLOP/s{share(decode)}, prefill {prefill:.0f}{share(prefill)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="threads, the stages' in total (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=64,
                   help="a prompt's text in tokens, sent as one user message (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--linear-inputs", default=settings.LINEAR_INPUTS, choices=dtypes.LINEAR_INPUTS,
                   help="what the linears multiply, as the stages' --linear-inputs (default: %(default)s)")
    args = p.parse_args()
    peak = fma_rate(args.threads, kernels_wide())
    prompt, cached = synthetic_prompt_tokens(resolve_model("smollm2"), args.input_len)
    print(f"a prompt as served: {prompt} tokens ({args.input_len} of text in the chat template), the first {cached} "
          "from the prefix cache")
    for r in measure([int(c) for c in args.concurrency.split(",")], args.threads, prompt, args.output_len,
                     args.linear_inputs, cached=cached):
        print(f"{r.concurrency:3d} streams: decode {r.decode_ms:6.2f} ms + head {r.head_ms:5.2f} + "
              f"{r.concurrency}/{args.output_len} x prefill {r.prefill_ms:6.1f} "
              f"({r.prompts_a_call} a call) -> at most "
              f"{r.tok_s(args.output_len):6.1f} tok/s; "
              + rates_text(r, peak))


if __name__ == "__main__":
    main()
