"""tether's OpenAI HTTP face against llama.cpp's own C++ llama-server (bench/llama_server.py builds it from the
llama.cpp vendored in the pinned llama-cpp-python sdist), on the same GGUF, the same threads in total, the
same requests and one load client, paired and alternating; medians of output tok/s and their ratio.

- tether: a local cluster (as `tether bench --spawn` starts one: LocalCluster) of --stages stages with
  --stage-threads threads each, served on its OpenAI-compatible HTTP API.
- llama-server: the same GGUF (smollm2's, tether/model/smollm2.py) with stages x stage threads threads for
  prompts and decode (-t, -tb), one slot per concurrent request (-np = the concurrency), continuous batching
  (-cb), restarted per concurrency.
- the load: tether's closed-loop load generator (tether/loadtest/loadgen.py) over one client for both
  sides (bench/chat_clients.py: httpx2 streaming /v1/chat/completions, or the official `openai` client with
  --client openai, whose own CPU per chunk is twice httpx2's on the servers' cores), the request's own
  sampling on both (temperature, top_p, top_k, seed as drawn by the workload; llama.cpp's own defaults that
  tether lacks switched off: top_k 0, min_p 0, repeat_penalty 1, top_p 1 where the request has none), and
  output tokens counted by each server's own `usage` (stream_options.include_usage).
- workloads: chat (tether bench's `single` prompts as one user message, EOS honoured, each request's own
  max_tokens: answers end where each model's numerics take them, so the output token counts are printed), and
  synthetic (--input-len/--output-len random words, `ignore_eos` on both, so every answer is exactly its
  length).

For each workload and concurrency: warm-up requests on both sides (not counted), then --repeats runs per
side, alternating which goes first, on the same requests; the medians and tether ÷ llama-server. Beside each
row, the most tok/s tether's arithmetic allows at that concurrency (bench/arithmetic_ceiling.py, timed in this
process while nothing else runs: before the cluster starts for synthetic, after both servers stop for chat, whose
answers' length is known only then: the mean of tether's own answers), and each row's verdict against its target
(TARGETS): met, or short, and then whether the arithmetic itself falls short (its ceiling under the target) or the
rest of the serving (the share of the ceiling the target needs against the share served).

    .venv/bin/python bench/llama_server_vs_tether.py --concurrency 1,8,32 --requests 8,16,32 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench import arithmetic_ceiling, chat_clients, llama_server  # noqa: E402
from tether import settings  # noqa: E402
from tether.loadtest import cluster_stats, loadgen, stats  # noqa: E402
from tether.loadtest.workloads import BenchRequest, SyntheticSpec, Workload  # noqa: E402
from tether.model import dtypes  # noqa: E402

async def run_level(base_url: str, side: str, requests: list[BenchRequest], concurrency: int,
                    client: str = "httpx") -> loadgen.LevelRun:
    async with chat_clients.CLIENTS[client](base_url, side) as c:
        return await loadgen.closed_loop(c, iter(requests), loadgen.Level("closed", concurrency=concurrency),
                                         loadgen.Budget(num_requests=len(requests)), lambda r: None)


def summary(run: loadgen.LevelRun) -> dict:
    s = stats.level_summary(run.records, run.wall_s, None)
    failed = [f"{r.error_code}: {r.error[:200]}" for r in run.records if not r.ok]
    return dict(tok_s=s["output_token_throughput"], wall_s=run.wall_s, output_tokens=s["output_tokens"],
                prompt_tokens=sum(r.prompt_tokens for r in run.records if r.ok),
                completed=s["completed"], failed=len(failed), errors=failed[:3],
                ttft_p50_ms=s["latency_ms"]["ttft"]["p50"], tpot_p50_ms=s["latency_ms"]["tpot"]["p50"],
                load=os.getloadavg()[0])


def tether_kernels(stage_threads: int) -> str:
    """tether's stage dtype and kernels (RowRule) as a stage with `stage_threads` threads chooses them: the same
    probe, read from the probe cache the stages just wrote (tether/model/probe_cache.py)."""
    code = ("import sys, torch\n"
            "torch.set_num_threads(int(sys.argv[1]))\n"
            "from tether import settings\n"
            "from tether.model import native, numerics\n"
            "from tether.model.config import ModelConfig\n"
            "from tether.model.folder import resolve_model\n"
            "cfg = ModelConfig.from_folder(resolve_model('smollm2'))\n"
            "d = numerics.resolve(settings.DTYPE, cfg)\n"
            "rule = numerics.servable_rule(cfg, numerics.DTYPES[d])\n"
            "print(f'{d}, {rule}; C kernels: {native.describe()}')\n")
    done = subprocess.run([sys.executable, "-c", code, str(stage_threads)], capture_output=True, text=True,
                          timeout=600)
    return done.stdout.strip() or f"(unknown: {done.stderr.strip()[-300:]})"


def median_step(steps: list[dict | None]) -> dict | None:
    """Each figure of `cluster_stats.served_step` the median over the runs that read one (None if none did)."""
    read = [s for s in steps if s]
    if not read:
        return None
    return dict(step_ms=statistics.median(s["step_ms"] for s in read),
                busy_ms=[statistics.median(s["busy_ms"][i] for s in read) for i in range(len(read[0]["busy_ms"]))],
                sampling_ms=statistics.median(s["sampling_ms"] for s in read),
                rest_ms=statistics.median(s["rest_ms"] for s in read))


def served_output_len(runs: list[dict]) -> int | None:
    """A row's output tokens per answer as served (each run's output tokens over its completed requests; the
    median over the runs, rounded): the output length of a chat row's arithmetic ceiling, whose answers end at
    their own EOS. None where no run completed a request."""
    means = [r["output_tokens"] / r["completed"] for r in runs if r.get("completed")]
    return max(1, round(statistics.median(means))) if means else None


def ceiling_text(workload: str, r: arithmetic_ceiling.Round, output_len: int) -> str:
    """One ceiling's round: its decode rows, head and share of a prompt's prefill, and the prompt as served."""
    c = r.concurrency
    return (f"{workload} at {c} streams: decode {r.decode_ms:.1f} ms + head {r.head_ms:.1f} + {c}/{output_len} x "
            f"prefill {r.prefill_ms:.1f} ({r.prompts_a_call} a call; a prompt of {r.prompt_tokens} tokens as served, "
            f"the first {r.cached_tokens} from the prefix cache)")


# The targets tether ÷ llama-server must reach on the default model, 2 stages, the same cores: by concurrency.
TARGETS = {1: 1.0, 8: 2.0, 32: 2.0}


def verdict(ratio: float | None, ceiling_ratio: float | None, target: float | None) -> str:
    """A row against its target, and where it falls short, what does, from the measurements: the arithmetic (its
    ceiling ÷ llama-server under the target: no serving reaches it) or the serving (the share of the ceiling the
    target needs against the share served)."""
    if target is None or ratio is None:
        return "–"
    if ratio >= target:
        return f"met ({target:g}×)"
    if not ceiling_ratio:
        return f"short of {target:g}× (no ceiling timed)"
    if ceiling_ratio < target:
        return f"short of {target:g}×: the arithmetic alone allows {ceiling_ratio:.2f}×"
    return (f"short of {target:g}×: needs {target / ceiling_ratio:.0%} of the ceiling served, "
            f"{ratio / ceiling_ratio:.0%} was")


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies (default: %(default)s)")
    p.add_argument("--requests", default="8,16,32",
                   help="requests per run: one count, or one per concurrency (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side and concurrency (default: %(default)s)")
    p.add_argument("--workloads", default="chat,synthetic", help="chat and/or synthetic (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="synthetic lengths' spread (default: exact)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--stage-threads", type=int, default=None,
                   help="threads per stage (default: cores divided among the stages, as `tether up`)")
    p.add_argument("--linear-inputs", default=settings.LINEAR_INPUTS, choices=dtypes.LINEAR_INPUTS,
                   help="tether's stages' --linear-inputs: q8 computes the GGUF's Q4_1 / Q8_0 groups as llama.cpp "
                        "does (8-bit inputs, integer dot products) (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per side and concurrency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--jobs", type=int, default=2, help="build jobs, if llama-server must be built")
    p.add_argument("--no-ceiling", action="store_true",
                   help="skip timing the arithmetic ceiling (~20-60 s, and ~15 s a chat row)")
    p.add_argument("--client", choices=sorted(chat_clients.CLIENTS), default="httpx",
                   help="the load client of both sides: httpx (httpx2, ~0.2 ms of CPU a streamed chunk) or openai "
                        "(the official client, ~0.4 ms: as measured before 2026-12-07) (default: %(default)s)")
    p.add_argument("--isa", choices=llama_server.ISAS, default="native",
                   help="native: each side uses what the CPU has; avx2: both keep to AVX2 (llama-server built "
                        "without AVX-512, tether's kernels with %s=avx2): an AVX2-only CPU's code on this one "
                        "(its memory and clocks stay this machine's) (default: %%(default)s)" % settings.KERNELS_ISA_ENV)
    args = p.parse_args()
    # `kill PID` unwinds like Ctrl-C (a background job ignores SIGINT): the cluster and llama-server are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    counts = [int(n) for n in args.requests.split(",") if n.strip()]
    if len(counts) == 1:
        counts *= len(concurrencies)
    if len(counts) != len(concurrencies):
        p.error("--requests: one count, or one per concurrency")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not set(workloads) <= {"chat", "synthetic"}:
        p.error("--workloads: chat and/or synthetic")
    stage_threads = args.stage_threads or max(1, (os.cpu_count() or 1) // args.stages)
    threads = args.stages * stage_threads

    try:
        binary = llama_server.build(args.jobs, isa=args.isa)
    except llama_server.Unavailable as e:
        print(f"llama_server_vs_tether: skipped: {e}", file=sys.stderr)
        sys.exit(llama_server.SKIP)
    os.environ[settings.KERNELS_ISA_ENV] = args.isa   # the stages and the kernels report below inherit it, either way

    from tether.cli.cluster import LocalCluster, linear_inputs_flags
    from tether.model import smollm2
    from tether.model.folder import load_model_tokenizer
    gguf = smollm2.gguf_file()
    tok = load_model_tokenizer(smollm2.ensure())
    spec = SyntheticSpec(args.input_len, args.output_len, args.range_ratio)
    mix = {"chat": {"single": 1.0}, "synthetic": {"synthetic": 1.0}}

    flags = llama_server.relevant_flags(llama_server.cpu_flags())
    meta = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                command=" ".join([sys.executable, *sys.argv]), cores=os.cpu_count(), platform=platform.platform(),
                cpu_flags=flags, llama_server=str(binary), llama_cpp_python=llama_server.VERSION,
                cmake_options=list(llama_server.cmake_options(args.isa)), gguf=str(gguf), stages=args.stages,
                stage_threads=stage_threads, llama_threads=threads, isa=args.isa, client=args.client)
    print(f"{meta['date']}: tether {args.stages} stage(s) x {stage_threads} thread(s) vs llama-server -t {threads}; "
          f"CPU flags: {' '.join(flags)}; instruction sets: {args.isa}; load client: {args.client}", flush=True)
    # (workload, concurrency) -> the arithmetic's round there and the output length it was timed for
    ceilings: dict[tuple[str, int], tuple[arithmetic_ceiling.Round, int]] = {}
    if "synthetic" in workloads and not args.no_ceiling:
        print("timing the arithmetic ceiling (the whole model in this process) ...", file=sys.stderr, flush=True)
        # the synthetic requests' prompts as tether's admission renders them (the chat template's tokens too)
        prompt, cached = arithmetic_ceiling.chat_prompt_tokens(smollm2.ensure(), [
            r.prompt for r in Workload(mix["synthetic"], tok.encode, spec).take(8, "ceiling")])
        ceilings = {("synthetic", r.concurrency): (r, args.output_len) for r in arithmetic_ceiling.measure(
            concurrencies, threads, prompt, args.output_len, args.linear_inputs, cached=cached)}
    results: list[dict] = []
    prompts: dict[tuple[str, int], list[str]] = {}   # every prompt a row sent: a chat ceiling's prompt length
    with tempfile.TemporaryDirectory(prefix="llama-vs-tether-") as tmp:
        logs = Path(tmp)
        inputs = linear_inputs_flags(args.linear_inputs)
        cluster = LocalCluster(model=smollm2.NAME, stages=args.stages, threads=stage_threads, log_dir=logs / "tether",
                               extra={"stage": inputs} if inputs else {})
        print(f"starting tether: {args.stages} stages x {stage_threads} thread(s) (logs {logs / 'tether'}) ...",
              file=sys.stderr, flush=True)
        try:
            cluster.start(timeout=600)
            tether_url = cluster.base_url
            assert tether_url, "the cluster serves no HTTP API"
            # the stages' Stats around each tether run: where its served step's time went (busy, sampling, between)
            probe = cluster_stats.EngineProbe(cluster.service("coordinator").address,
                                              [cluster.service(f"stage{i}").address for i in range(args.stages)])
            meta["tether_kernels"] = tether_kernels(stage_threads) + \
                (f"; linear inputs {args.linear_inputs}" if inputs else "")
            print(f"tether kernels: {meta['tether_kernels']}", flush=True)
            meta["system_info"] = llama_server.probe_system_info(binary, gguf, threads, logs / "llama-probe.log")
            print(f"llama-server system_info: {meta['system_info']}", flush=True)
            for workload in workloads:
                wl = Workload(mix[workload], tok.encode, spec)
                for conc, n in zip(concurrencies, counts):
                    warm = wl.take(args.warmup, f"{args.seed}:{workload}:warmup")
                    log = logs / f"llama-server-{workload}-np{conc}.log"
                    with llama_server.LlamaServer(binary, gguf, threads, conc, log) as ls:
                        urls = {"tether": tether_url, "llama-server": ls.base_url}
                        for side, url in urls.items():
                            asyncio.run(run_level(url, side, warm, min(conc, len(warm)), args.client))
                        runs: dict[str, list[dict]] = {"tether": [], "llama-server": []}
                        for r in range(args.repeats):
                            # each repeat its own requests, the same on both sides: no repeat finds its exact
                            # prompts in a server's prompt/prefix cache from the one before
                            requests = wl.take(n, f"{args.seed}:{workload}:{r}")
                            prompts.setdefault((workload, conc), []).extend(q.prompt for q in requests)
                            order = ["tether", "llama-server"] if r % 2 == 0 else ["llama-server", "tether"]
                            for side in order:
                                if side == "tether":
                                    probe.before()
                                s = summary(asyncio.run(run_level(urls[side], side, requests, conc, args.client)))
                                if side == "tether":
                                    s["step"] = (probe.after()["engine"] or {}).get("step")
                                runs[side].append(s)
                                print(f"  {workload} c={conc} #{r + 1} {side:12s} {s['tok_s']:7.1f} tok/s "
                                      f"({s['output_tokens']} out / {s['prompt_tokens']} prompt tokens, {s['completed']}/{n} done, "
                                      f"{s['wall_s']:.1f} s, TTFT p50 {fmt(s['ttft_p50_ms'], 0)} ms, "
                                      f"TPOT p50 {fmt(s['tpot_p50_ms'], 0)} ms, load {s['load']:.1f})"
                                      + (f" ERRORS {s['errors']}" if s["failed"] else ""), flush=True)
                    med = {side: statistics.median(x["tok_s"] for x in v) for side, v in runs.items()}
                    row = dict(workload=workload, concurrency=conc, requests=n, repeats=args.repeats,
                               tether_tok_s=med["tether"], llama_server_tok_s=med["llama-server"],
                               ratio=med["tether"] / med["llama-server"] if med["llama-server"] else None,
                               step=median_step([x.get("step") for x in runs["tether"]]), runs=runs)
                    results.append(row)
                    print(f"{workload} c={conc}: median tether {med['tether']:.1f} tok/s, llama-server "
                          f"{med['llama-server']:.1f} tok/s, tether/llama-server {fmt(row['ratio'], 3)}",
                          flush=True)
        finally:
            cluster.stop()
    if "chat" in workloads and not args.no_ceiling:
        print("timing the chat rows' arithmetic ceiling (the whole model in this process) ...", file=sys.stderr,
              flush=True)
        for row in results:
            out = served_output_len(row["runs"]["tether"]) if row["workload"] == "chat" else None
            if out is not None:
                prompt, cached = arithmetic_ceiling.chat_prompt_tokens(
                    smollm2.ensure(), prompts[("chat", row["concurrency"])])
                ceilings[("chat", row["concurrency"])] = (arithmetic_ceiling.measure(
                    [row["concurrency"]], threads, prompt, out, args.linear_inputs, cached=cached,
                    together=False)[0], out)
    peak = arithmetic_ceiling.fma_rate(threads, arithmetic_ceiling.kernels_wide()) if ceilings else None
    meta["fma_rate_gflops"] = peak
    meta["ceiling"] = [dict(workload=w, concurrency=c, output_len=out, decode_ms=r.decode_ms, head_ms=r.head_ms,
                            prefill_ms=r.prefill_ms, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                            prompts_per_call=r.prompts_a_call,
                            decode_gflops=r.rates()[0], prefill_gflops=r.rates()[1], tok_s=r.tok_s(out))
                       for (w, c), (r, out) in ceilings.items()]
    print()
    print("| workload | concurrency | requests | tether tok/s | llama-server tok/s | tether ÷ llama-server | "
          "arithmetic ceiling tok/s (÷ llama-server) | target |")
    print("|---|---|---|---|---|---|---|---|")
    for row in results:
        ceiling = ceilings.get((row["workload"], row["concurrency"]))
        top = ceiling[0].tok_s(ceiling[1]) if ceiling else None
        top_ratio = top / row["llama_server_tok_s"] if top and row["llama_server_tok_s"] else None
        row["ceiling_tok_s"] = top
        row["verdict"] = verdict(row["ratio"], top_ratio, TARGETS.get(row["concurrency"]))
        print(f"| {row['workload']} | {row['concurrency']} | {row['requests']} | {row['tether_tok_s']:.1f} | "
              f"{row['llama_server_tok_s']:.1f} | {fmt(row['ratio'], 3)} | "
              + (f"{top:.1f} ({top_ratio:.2f}×)" if top_ratio else "–") + f" | {row['verdict']} |")
    print("tether's served step (the stages' Stats over each run, medians): " + "; ".join(
        f"{row['workload']} at {row['concurrency']} streams: {cluster_stats.served_step_text(row['step'])}"
        for row in results) + " (the rest: the hops between the processes and the coordinator's turn)")
    if ceilings:
        print("arithmetic ceiling: " + "; ".join(ceiling_text(w, r, out) for (w, _), (r, out) in ceilings.items())
              + " (bench/arithmetic_ceiling.py: sampling, hops and the coordinator left out)")
        print("the arithmetic's rate: " + "; ".join(
            f"{w} at {c} streams: {arithmetic_ceiling.rates_text(r, peak)}" for (w, c), (r, _) in ceilings.items())
            + (f" (of the {peak:.0f} GFLOP/s {threads} threads sustain in FMAs alone: bench/fma_rate.c)" if peak
               else " (no C compiler for bench/fma_rate.c)"))
    print(f"\nmedians of {args.repeats} paired, alternating runs, load client {args.client}; "
          f"tether: {meta.get('tether_kernels')}; "
          f"llama-server: {meta.get('system_info')}")
    if args.out:
        args.out.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
        print(f"results: {args.out}")


if __name__ == "__main__":
    main()
