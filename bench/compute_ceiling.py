"""What this CPU's cores can compute, against what a served load needs: issue 25's 3x-llama.cpp question.

One thread, the default model's gate/up linear (hidden -> intermediate: 576 -> 1536), weights hot in cache,
medians of 30 calls:
- rowdot's fp32 chains (what the stages run) at 1, 8 and 64 rows;
- llama.cpp's Q4_1 x Q8_1 integer dot (bench/q4q8_dot.c, built here with cc) at 8 rows, in GFLOP-equivalents;
- with --llama-python, llama.cpp itself on the model's GGUF: prefill of 64 tokens and one-row decode, 2 threads.
Then the floating-point work a synthetic request (--input-len, --output-len) needs on SmolLM2-135M (every token
but the last through the layers and their attention, a head per output token), and the sustained rate a target
of R output tok/s asks for.

    .venv/bin/python bench/compute_ceiling.py --llama-python /work/lcp-venv/bin/python --target 102
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tether.model import rowdot, smollm2  # noqa: E402
from tether.model.config import ModelConfig, layer_weights  # noqa: E402
from tether.model.loader import resolve_model  # noqa: E402


def median_seconds(call, repeats: int = 30) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return sorted(times)[repeats // 2]


def request_flop(cfg: ModelConfig, prompt: int, output: int) -> float:
    """Multiply-adds x 2 of one request: tokens 0 .. prompt+output-2 through every layer (the last output token is
    never fed back), each attending to its own position and those before it, and the head once per output token."""
    per_token = 2 * layer_weights(cfg) * cfg.num_hidden_layers
    attention = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers   # QK and PV, per key
    tokens = prompt + output - 1
    return tokens * per_token + attention * tokens * (tokens + 1) / 2 + output * 2 * cfg.vocab_size * cfg.hidden_size


def integer_gflops(k: int, n: int, rows: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = Path(tmp) / "q4q8.so"
        subprocess.run(["cc", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-o", str(lib_path),
                        str(Path(__file__).with_name("q4q8_dot.c"))], check=True)
        lib = ctypes.CDLL(str(lib_path))
        blocks = k // 32
        wq = torch.randint(0, 256, (n * blocks * 16,), dtype=torch.uint8)
        wd = torch.rand(n * blocks) * 1e-2
        aq = torch.randint(-127, 128, (rows * k,), dtype=torch.int8)
        ad = torch.rand(rows * blocks) * 1e-2
        y = torch.empty(n * rows)
        ptr = ctypes.c_void_p
        lib.q4q8_dot.restype = ctypes.c_int
        seconds = median_seconds(lambda: lib.q4q8_dot(ptr(wq.data_ptr()), ptr(wd.data_ptr()), ptr(aq.data_ptr()),
                                                      ptr(ad.data_ptr()), ctypes.c_int64(blocks), ctypes.c_int64(n),
                                                      ctypes.c_int64(rows), ptr(y.data_ptr())) == 0 or sys.exit(
            f"q4q8_dot takes 1 to 16 rows, not {rows}"))
    return 2 * rows * k * n / seconds / 1e9


LLAMA = """
import random, sys, time, llama_cpp
m = llama_cpp.Llama(sys.argv[1], n_threads=2, n_threads_batch=2, n_ctx=512, n_batch=512, verbose=False)
random.seed(0)
toks = [random.randrange(100, 40000) for _ in range(96)]
best = 1e9
for _ in range(3):
    m.reset(); t = time.perf_counter(); m.eval(toks[:64]); best = min(best, time.perf_counter() - t)
t = time.perf_counter()
for tok in toks[64:]:
    m.eval([tok])
print(best, (time.perf_counter() - t) / 32)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-python", help="an interpreter with llama-cpp-python, to time llama.cpp itself")
    p.add_argument("--target", type=float, default=102.0, help="output tok/s to size (default 102: 3x llama.cpp's "
                   "~34 at 8 streams on an AVX2 AMD EPYC)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens of a request (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens of a request (default 64)")
    args = p.parse_args()
    cfg = ModelConfig.from_folder(resolve_model(smollm2.NAME))
    k, n = cfg.hidden_size, cfg.intermediate_size
    torch.set_num_threads(1)
    w = rowdot.pack(torch.randn(n, k))
    for rows in (1, 8, 64):
        x = torch.randn(rows, k)
        gflops = 2 * rows * k * n / median_seconds(lambda x=x: rowdot.linear(x, w)) / 1e9
        print(f"rowdot fp32, {rows:2d} rows, 1 thread: {gflops:5.1f} GFLOP/s")
    print(f"Q4_1 x Q8_1 integer,  8 rows, 1 thread: {integer_gflops(k, n, 8):5.1f} GFLOP-equivalent/s")
    layer_flop = 2 * layer_weights(cfg) * cfg.num_hidden_layers
    if args.llama_python:
        out = subprocess.run([args.llama_python, "-c", LLAMA, str(smollm2.gguf_file())], capture_output=True,
                             text=True, check=True).stdout.split()
        prefill, decode = float(out[0]), float(out[1])
        print(f"llama.cpp, 2 threads: prefill of 64 tokens {prefill * 1e3:.0f} ms "
              f"({64 * layer_flop / prefill / 1e9:.1f} GFLOP/s), decode {decode * 1e3:.1f} ms a token")
    request = request_flop(cfg, args.input_len, args.output_len)
    print(f"a {args.input_len}-in/{args.output_len}-out request: {request / 1e9:.1f} GFLOP; {args.target:.0f} output "
          f"tok/s needs {args.target / args.output_len * request / 1e9:.1f} GFLOP/s sustained on the whole machine")


if __name__ == "__main__":
    main()
