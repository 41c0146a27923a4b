"""What this CPU's cores can compute, against what a served load needs: issue 25's 3x-llama.cpp question.

One thread, the default model's widest linear (576 -> 1536), weights hot in cache, medians of 30 calls:
- rowdot's fp32 chains (what the stages run) at 1, 8 and 64 rows;
- llama.cpp's Q4_1 x Q8_1 integer dot (bench/q4q8_dot.c, built here with cc) at 8 rows, in GFLOP-equivalents;
- with --llama-python, llama.cpp itself on the model's GGUF: prefill of 64 tokens and one-row decode, 2 threads.
Then the floating-point work a synthetic 64-in/64-out request needs on SmolLM2-135M, and the sustained rate a
target of R tok/s at 8 streams asks for.

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

K, N = 576, 1536
LAYER_PARAMS = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3   # q, o, k, v, gate, up, down
LAYERS, HEAD = 30, 576 * 49152


def median_seconds(call, repeats: int = 30) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return sorted(times)[repeats // 2]


def integer_gflops(rows: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = Path(tmp) / "q4q8.so"
        subprocess.run(["cc", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-o", str(lib_path),
                        str(Path(__file__).with_name("q4q8_dot.c"))], check=True)
        lib = ctypes.CDLL(str(lib_path))
        blocks = K // 32
        wq = torch.randint(0, 256, (N * blocks * 16,), dtype=torch.uint8)
        wd = torch.rand(N * blocks) * 1e-2
        aq = torch.randint(-127, 128, (rows * K,), dtype=torch.int8)
        ad = torch.rand(rows * blocks) * 1e-2
        y = torch.empty(N * rows)
        ptr = ctypes.c_void_p
        seconds = median_seconds(lambda: lib.q4q8_dot(ptr(wq.data_ptr()), ptr(wd.data_ptr()), ptr(aq.data_ptr()),
                                                      ptr(ad.data_ptr()), ctypes.c_int64(blocks), ctypes.c_int64(N),
                                                      ctypes.c_int64(rows), ptr(y.data_ptr())))
    return 2 * rows * K * N / seconds / 1e9


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
    p.add_argument("--target", type=float, default=102.0, help="output tok/s at 8 streams to size (default 102)")
    args = p.parse_args()
    torch.set_num_threads(1)
    w = rowdot.pack(torch.randn(N, K))
    for rows in (1, 8, 64):
        x = torch.randn(rows, K)
        gflops = 2 * rows * K * N / median_seconds(lambda x=x: rowdot.linear(x, w)) / 1e9
        print(f"rowdot fp32, {rows:2d} rows, 1 thread: {gflops:5.1f} GFLOP/s")
    print(f"Q4_1 x Q8_1 integer,  8 rows, 1 thread: {integer_gflops(8):5.1f} GFLOP-equivalent/s")
    layer_flop = 2 * LAYER_PARAMS * LAYERS
    if args.llama_python:
        out = subprocess.run([args.llama_python, "-c", LLAMA, str(smollm2.gguf_file())], capture_output=True,
                             text=True, check=True).stdout.split()
        prefill, decode = float(out[0]), float(out[1])
        print(f"llama.cpp, 2 threads: prefill of 64 tokens {prefill * 1e3:.0f} ms "
              f"({64 * layer_flop / prefill / 1e9:.1f} GFLOP/s), decode {decode * 1e3:.1f} ms a token")
    request = 128 * layer_flop + 65 * 2 * HEAD      # 64 prompt + 64 generated tokens through the layers; 65 heads
    print(f"a 64-in/64-out request: {request / 1e9:.1f} GFLOP; {args.target:.0f} tok/s at 8 streams needs "
          f"{args.target / 64 * request / 1e9:.1f} GFLOP/s sustained on the whole machine")


if __name__ == "__main__":
    main()
