"""The llama.cpp baseline's request set alone, no cluster up: `tether bench --baselines`' llama.cpp side
(the same server, client, GGUF and synthetic requests) at one concurrency and thread count, each repeat's
output tok/s, TTFT p50 and every request's TPOT; to tell llama.cpp's own speed from a shared machine's.

    .venv/bin/python bench/llama_cpp_alone.py --python /work/lcp-venv/bin/python --concurrency 8 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.loadtest import loadgen, stats  # noqa: E402
from tether.loadtest.llama_cpp_client import LlamaCppStreamClient  # noqa: E402
from tether.loadtest.llama_cpp_server import LlamaCppServer, gguf_of  # noqa: E402
from tether.loadtest.workloads import SyntheticSpec, Workload  # noqa: E402
from tether.model import smollm2  # noqa: E402
from tether.model.folder import load_model_tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=sys.executable, help="interpreter with llama-cpp-python[server]")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    tok = load_model_tokenizer(smollm2.ensure())
    # `tether bench --workload synthetic --input-len 64 --output-len 64`'s baseline set (seed 0)
    requests = Workload({"synthetic": 1.0}, tok.encode, SyntheticSpec(64, 64, 0.5)).take(args.requests, "0:baseline")

    async def run(url: str) -> loadgen.LevelRun:
        async with LlamaCppStreamClient(url, 600, tok.encode, tok.eos_ids) as c:
            one = loadgen.Level("closed", concurrency=1)
            await loadgen.closed_loop(c, iter(requests[:1]), one, loadgen.Budget(num_requests=1), lambda r: None)
            return await loadgen.closed_loop(c, iter(requests), loadgen.Level("closed", concurrency=args.concurrency),
                                             loadgen.Budget(num_requests=len(requests)), lambda r: None)

    gguf = gguf_of(smollm2.NAME)
    assert gguf is not None
    with tempfile.TemporaryDirectory() as tmp, \
            LlamaCppServer(args.python, gguf, args.threads, 8192, Path(tmp) / "llama.log") as server:
        for _ in range(args.repeats):
            load = os.getloadavg()[0]
            r = asyncio.run(run(server.base_url))
            s = stats.level_summary(r.records, r.wall_s, None)
            print(f"concurrency {args.concurrency}, {args.threads} thread(s), load {load:.1f}: "
                  f"{s['output_token_throughput']:.1f} tok/s, TTFT p50 {s['latency_ms']['ttft']['p50']:.0f} ms, "
                  f"TPOT per request {[round((x.tpot or 0) * 1000) for x in r.records]} ms", flush=True)


if __name__ == "__main__":
    main()
