"""`tether bench`: drive a running tether cluster (or one it starts) and write a report."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tether import reference, settings
from tether.bench import audit, baselines, loadgen, report, stats
from tether.bench.progress import Progress
from tether.bench.records import BREAKDOWN_TAGS, RequestRecord
from tether.bench.workloads import WORKLOADS, LongSpec, SyntheticSpec, Workload, parse_mix
from tether.cli.cluster import LocalCluster
from tether.client import AsyncClient

DEFAULT_NUM_REQUESTS = 32
DEFAULT_CONCURRENCY = 8
# The audit needs no parallelism, and on a shared 2-core machine two OpenMP threads collapse as soon as
# another process takes a core (measured: 1.2 s instead of 15 ms per token on `small`).
AUDIT_THREADS = 1

EPILOG = """examples:
  tether bench --spawn --sweep 1,2,4 --num-requests 32 --audit --out bench-out
  tether bench --target 127.0.0.1:50051 --concurrency 8 --duration 60 --slo ttft:1000,tpot:100
  tether bench --spawn --model small --workload synthetic --input-len 512 --output-len 128 --rate 2
  tether bench --spawn --concurrency 32 --baselines --repeats 3

The report (report.json, report.md, requests.jsonl and PNG plots) goes to --out; docs/PERFORMANCE.md
explains every figure. Timings on shared machines are noisy: compare ratios measured in one run."""


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive; got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {text}")
    return value


def _rates(text: str) -> list[float]:
    try:
        return [_positive_float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates like 1,2,4; got {text!r}") from None


def _slo(text: str) -> dict[str, float]:
    try:
        return stats.parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mix(text: str) -> dict[str, float]:
    try:
        return parse_mix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether bench", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Load-test a tether cluster: send a seeded workload in open loop (Poisson arrivals) or closed\n"
                    "loop (fixed concurrency), measure throughput, goodput and TTFT / TPOT / ITL / end-to-end latency\n"
                    "per load level, optionally audit every answer against the in-process reference (--audit) and\n"
                    "measure baselines in the same run (--baselines), then write a JSON + Markdown report with plots.")
    g = p.add_argument_group("cluster")
    g.add_argument("--target", default=f"127.0.0.1:{settings.ADMISSION_PORT}", metavar="HOST:PORT",
                   help="admission address of a running cluster, e.g. one started by `tether up` "
                        "(default: %(default)s; ignored with --spawn)")
    g.add_argument("--spawn", action="store_true",
                   help="start a local cluster (--model, --stages, --threads) for the run and stop it after")
    g.add_argument("--model", default=settings.DEFAULT_MODEL,
                   help="the model the cluster serves: preset (tiny, small, base) or Hugging Face folder. The "
                        "bench tokenizes with it, audits and runs baselines on it, and checks it against the "
                        "fingerprint in the answers' receipts (default: %(default)s)")
    g.add_argument("--stages", type=_positive_int, default=2,
                   help="stage workers: with --spawn, how many to start (layers split evenly); against --target, "
                        "how many the running cluster has (recorded in the report) (default: %(default)s)")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads per stage: with --spawn, what each stage gets; against --target, what the "
                        "running stages have (default: cores divided among the stages, as `tether up` does)")
    g = p.add_argument_group("load (one of; default: --concurrency %d)" % DEFAULT_CONCURRENCY)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=_positive_float, metavar="QPS",
                      help="open loop: Poisson arrivals at this many requests per second, whatever the latency")
    mode.add_argument("--concurrency", type=_positive_int, metavar="N",
                      help="closed loop: N users, each sending its next request when its previous one ends")
    mode.add_argument("--sweep", type=_rates, metavar="QPS,QPS,...",
                      help="open loop at each rate in turn (one load level each), e.g. 1,2,4,8")
    g = p.add_argument_group("length of each load level (one of; default: --num-requests %d)" % DEFAULT_NUM_REQUESTS)
    size = g.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=_positive_int, metavar="N", help="send N requests per level")
    size.add_argument("--duration", type=_positive_float, metavar="SECONDS",
                      help="send for this long per level, then wait for the requests in flight")
    g.add_argument("--warmup", type=_positive_int, default=4, metavar="N",
                   help="requests sent before the first level and left out of every figure; their receipts "
                        "also tell which model the cluster serves (default: %(default)s)")
    g.add_argument("--timeout", type=_positive_float, default=120.0, metavar="SECONDS",
                   help="per-request deadline; a request past it counts as DEADLINE_EXCEEDED (default: %(default)s)")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", type=_mix, default=parse_mix("mix"), metavar="MIX",
                   help=f"weighted mix of {', '.join(WORKLOADS)}, e.g. single:6,multiturn:3,long:1 (that is "
                        "'mix', the default) or just synthetic")
    g.add_argument("--seed", type=int, default=0, help="workload seed: the same seed sends the same requests "
                                                       "(default: %(default)s)")
    g.add_argument("--input-len", type=_positive_int, default=SyntheticSpec.input_len, metavar="TOKENS",
                   help="synthetic: mean prompt length (default: %(default)s)")
    g.add_argument("--output-len", type=_positive_int, default=SyntheticSpec.output_len, metavar="TOKENS",
                   help="synthetic: mean output length; EOS is ignored so it is exact (default: %(default)s)")
    g.add_argument("--range-ratio", type=float, default=SyntheticSpec.range_ratio, metavar="R",
                   help="synthetic: lengths are uniform in [L*(1-R), L*(1+R)] (default: %(default)s)")
    g.add_argument("--long-tokens", default=f"{LongSpec.min_tokens}:{LongSpec.max_tokens}", metavar="MIN:MAX",
                   help="long: context length range in prompt tokens (default: %(default)s)")
    g = p.add_argument_group("what to measure")
    g.add_argument("--slo", type=_slo, metavar="ttft:MS,tpot:MS",
                   help="service-level objectives for goodput (completed requests/s within all of them); "
                        "metrics: ttft, tpot, e2e in milliseconds. Without it no goodput is reported")
    g.add_argument("--audit", action="store_true",
                   help="replay every completed request through the in-process reference, teacher forced on "
                        "the served tokens, and count exact / within-margin / MISMATCH per level")
    g.add_argument("--baselines", action="store_true",
                   help="also measure, on the same requests: tether at concurrency = --batch-size, the raw "
                        "in-process engine, and transformers generate with static batching; report ratios")
    g.add_argument("--baseline-requests", type=_positive_int, default=32, metavar="N",
                   help="requests in the baseline set (default: %(default)s)")
    g.add_argument("--batch-size", type=_positive_int, default=settings.MAX_BATCH_SLOTS, metavar="N",
                   help="baseline batch size, and the served side's concurrency (default: the coordinator's "
                        "micro-batch cap, %(default)s)")
    g.add_argument("--baseline-threads", type=_positive_int, default=None, metavar="N",
                   help="torch threads of the in-process baselines (default: what one stage process gets, "
                        "--threads or cores divided among --stages)")
    g.add_argument("--repeats", type=_positive_int, default=1, metavar="N",
                   help="baseline runs per side, interleaved; the report gives medians (default: %(default)s)")
    g.add_argument("--chaos", action="store_true",
                   help="report faults injected / detected / recovered / failed / wrong tokens per fault kind; "
                        "needs a cluster with fault injection (the report says when it is unavailable)")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                   help="directory for report.json, report.md, requests.jsonl and the plots (default: %(default)s)")
    g.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    return p


def chaos_status(requested: bool) -> dict:
    """Whether fault counters can be reported. The coordinator's Stats is where the fault injector (the
    integrity issue) will publish them; as long as it has no fault fields there is nothing to report."""
    from tether.v1 import coordinator_pb2
    fields = [f for f in coordinator_pb2.StatsReply.DESCRIPTOR.fields_by_name if "fault" in f]
    if fields:
        reason = (f"the coordinator publishes fault counters ({', '.join(fields)}) but this version of "
                  f"`tether bench` does not read them yet")
    else:
        reason = ("this build of tether has no fault injector: the coordinator's Stats carries no fault counters. "
                  "Chaos figures arrive with the integrity issue's injector; no zeros are reported in their place")
    return dict(requested=requested, available=False, reason=reason)


def stage_threads(args: argparse.Namespace) -> int:
    """Torch threads per stage process: --threads, else the cores divided among the stages (as `tether up`)."""
    return args.threads or max(1, (os.cpu_count() or 1) // args.stages)


def levels_of(args: argparse.Namespace) -> list[loadgen.Level]:
    if args.sweep:
        return [loadgen.Level("open", rate=r) for r in args.sweep]
    if args.rate:
        return [loadgen.Level("open", rate=args.rate)]
    return [loadgen.Level("closed", concurrency=args.concurrency or DEFAULT_CONCURRENCY)]


def budget_of(args: argparse.Namespace) -> loadgen.Budget:
    if args.duration:
        return loadgen.Budget(duration_s=args.duration)
    return loadgen.Budget(num_requests=args.num_requests or DEFAULT_NUM_REQUESTS)


def workload_of(args: argparse.Namespace, lm: reference.LoadedModel) -> Workload:
    try:
        lo, hi = (int(x) for x in args.long_tokens.split(":"))
    except ValueError:
        raise SystemExit(f"tether bench: --long-tokens must be MIN:MAX, got {args.long_tokens!r}") from None
    if not 0 < lo <= hi:
        raise SystemExit(f"tether bench: --long-tokens needs 0 < MIN <= MAX, got {args.long_tokens!r}")
    if not 0 <= args.range_ratio < 1:
        raise SystemExit(f"tether bench: --range-ratio must be within [0, 1), got {args.range_ratio}")
    return Workload(args.workload, lm.tokenizer.encode, SyntheticSpec(args.input_len, args.output_len, args.range_ratio),
                    LongSpec(lo, hi))


class Bench:
    """One bench run against `target`: warm-up, the levels (each audited right after its load, while the
    cluster is idle), then the baselines."""

    def __init__(self, args: argparse.Namespace, target: str, lm: reference.LoadedModel, workload: Workload) -> None:
        self.args, self.target, self.lm, self.workload = args, target, lm, workload
        self.records: list[RequestRecord] = []

    def progress(self, label: str, budget: loadgen.Budget) -> Progress:
        return Progress(label, budget.num_requests, budget.duration_s, enabled=not self.args.quiet)

    async def level(self, client: AsyncClient, level: loadgen.Level, budget: loadgen.Budget, seed: str,
                    label: str | None = None) -> loadgen.LevelRun:
        bar = self.progress(label or level.label, budget)
        run = await loadgen.run_level(client, self.workload.stream(f"{self.args.seed}:{seed}"), level, budget,
                                      f"{self.args.seed}:{seed}", bar.update)
        bar.close()
        return run

    async def warm_up(self, client: AsyncClient) -> None:
        """Warm the cluster and check it serves --model: the receipts carry the served model's fingerprint."""
        run = await self.level(client, loadgen.Level("closed", concurrency=min(4, self.args.warmup)),
                               loadgen.Budget(num_requests=self.args.warmup), "warmup", "warm-up")
        done = [r for r in run.records if r.ok]
        if not done:
            errors = "; ".join(f"{r.error_code}: {r.error}" for r in run.records[:3])
            raise SystemExit(f"tether bench: every warm-up request to {self.target} failed ({errors})")
        served = done[0].model_fingerprint
        if served != self.lm.fingerprint:
            raise SystemExit(f"tether bench: the cluster at {self.target} serves model {served}, but --model "
                             f"{self.args.model} is {self.lm.fingerprint}; pass the served model with --model")

    async def run_levels(self) -> list[dict]:
        out = []
        async with AsyncClient(self.target, timeout=self.args.timeout) as client:
            await self.warm_up(client)
            for i, level in enumerate(levels_of(self.args)):
                load_before = os.getloadavg()[0]
                run = await self.level(client, level, budget_of(self.args), f"level{i}")
                self.records += run.records
                out.append(self.level_report(run, load_before))
        return out

    def level_report(self, run: loadgen.LevelRun, load_before: float) -> dict:
        slo = self.args.slo
        audit_json = None
        if self.args.audit:
            with baselines.torch_threads(AUDIT_THREADS):
                audit_json = audit.audit_records(self.lm, run.records).to_json()
        by_tag = {t: stats.breakdown(run.records, lambda r, t=t: r.tag(t), run.wall_s, slo) for t in BREAKDOWN_TAGS}
        return dict(label=run.level.label, mode=run.level.mode, rate=run.level.rate,
                    concurrency=run.level.concurrency, load_average=[load_before, os.getloadavg()[0]],
                    summary=stats.level_summary(run.records, run.wall_s, slo),
                    by_workload=stats.breakdown(run.records, lambda r: r.request.workload, run.wall_s, slo),
                    by_tag=by_tag, audit=audit_json)

    def run_baselines(self) -> dict:
        a = self.args
        # One stage's threads: on a shared 2-core machine more OpenMP threads than cores-per-process collapse
        # (GNU OpenMP spins; measured 9-170 instead of ~450 tok/s for 2 threads under load), and a ceiling
        # measured in that state would mean nothing.
        threads = a.baseline_threads or stage_threads(a)
        served_runs: list[float] = []
        engine_runs: list[float] = []
        hf_runs: list[float] = []
        hf_error = ""
        hf = None
        try:
            hf = baselines.load_hf(self.lm.folder)
        except ImportError:
            hf_error = "transformers is not installed (pip install -e '.[bench]')"
        jobs: list[baselines.Job] = []
        for i in range(a.repeats):
            run = asyncio.run(self.served_set(i))
            records = run.records
            served_runs.append(sum(r.output_tokens for r in records if r.ok) / run.wall_s)
            if not jobs:   # the exact prompts and sampling the server used, output budgets included
                jobs = [baselines.Job(self.lm.tokenizer.encode(r.request.prompt), audit.served_params(r))
                        for r in sorted(records, key=lambda r: r.request.index) if r.ok]
            with baselines.torch_threads(threads):
                engine_runs.append(baselines.run_engine(self.lm, jobs, a.batch_size,
                                                        settings.MAX_BATCH_TOKENS).output_token_throughput)
                if hf is not None:
                    pad = baselines.pad_token(hf, self.lm.tokenizer.eos_ids)
                    hf_runs.append(baselines.run_hf(hf, jobs, a.batch_size, pad,
                                                    self.lm.tokenizer.eos_ids).output_token_throughput)
        served_tps, engine_tps = stats.median(served_runs), stats.median(engine_runs)
        hf_tps = stats.median(hf_runs) if hf_runs else None
        return dict(requests=a.baseline_requests, completed=len(jobs), batch_size=a.batch_size, threads=threads,
                    stage_threads=stage_threads(a), stages=a.stages, repeats=a.repeats,
                    served=dict(output_token_throughput=served_tps, runs=served_runs),
                    engine=dict(output_token_throughput=engine_tps, runs=engine_runs),
                    hf=dict(output_token_throughput=hf_tps, runs=hf_runs, **({"error": hf_error} if hf_error else {})),
                    ratios=dict(vs_engine=served_tps / engine_tps if engine_tps else None,
                                vs_hf=served_tps / hf_tps if hf_tps else None))

    async def served_set(self, repeat: int) -> loadgen.LevelRun:
        """The baseline request set through the cluster, all at once up to --batch-size in flight."""
        requests = iter(self.workload.take(self.args.baseline_requests, f"{self.args.seed}:baseline"))
        level = loadgen.Level("closed", concurrency=self.args.batch_size)
        budget = loadgen.Budget(num_requests=self.args.baseline_requests)
        bar = self.progress(f"baseline set #{repeat + 1}", budget)
        async with AsyncClient(self.target, timeout=self.args.timeout) as client:
            run = await loadgen.closed_loop(client, requests, level, budget, bar.update)
        bar.close()
        return run


def meta(args: argparse.Namespace, argv: list[str], target: str, lm: reference.LoadedModel,
         cluster: LocalCluster | None) -> dict:
    budget = budget_of(args)
    return dict(
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        command="tether bench " + shlex.join(argv), target=target, spawned=cluster is not None,
        model=args.model, model_fingerprint=lm.fingerprint, stages=args.stages, stage_threads=stage_threads(args),
        machine=dict(cores=os.cpu_count(), torch=torch.__version__, python=platform.python_version(),
                     platform=platform.platform()),
        load_average_start=round(os.getloadavg()[0], 2),
        workload=dict(mix=",".join(f"{k}:{v:g}" for k, v in args.workload.items()), seed=args.seed,
                      synthetic=dict(input_len=args.input_len, output_len=args.output_len,
                                     range_ratio=args.range_ratio), long_tokens=args.long_tokens),
        budget=(f"{budget.num_requests} requests" if budget.num_requests else f"{budget.duration_s:g} s"),
        warmup=args.warmup, timeout_s=args.timeout, slo=args.slo)


def print_summary(rep: dict, files: list[Path], out: Callable[[str], None] = print) -> None:
    out("")
    out(f"tether bench: {rep['meta']['model']} at {rep['meta']['target']}")
    header = ["level", "done", "req/s", "goodput", "tok/s", "TTFT p50/p99", "TPOT p50/p99", "E2E p50/p99", "errors",
              "audit ex/mg/MISMATCH"]
    rows = [row[:7] + [row[8], row[9], row[10].replace("**", "")] for row in report.summary_rows(rep["levels"])]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for row in [header, *rows]:
        out("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    b = rep.get("baselines")
    if b:
        ratio = b["ratios"]
        out(f"baselines (output tok/s, median of {b['repeats']}): tether {b['served']['output_token_throughput']:.1f}, "
            f"engine {b['engine']['output_token_throughput']:.1f}, transformers "
            f"{report.fmt(b['hf']['output_token_throughput'])}; tether/engine {report.ratio_text(ratio['vs_engine'])}, "
            f"tether/transformers {report.ratio_text(ratio['vs_hf'])}")
    if rep["chaos"]["requested"]:
        out(f"chaos: unavailable — {rep['chaos']['reason']}")
    mismatches = sum(lv["audit"]["mismatch"] for lv in rep["levels"] if lv["audit"])
    if mismatches:
        out(f"!! {mismatches} MISMATCH(ES): answers the model would not give to their request; see report.md")
    out("report: " + ", ".join(str(f) for f in files))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        lm = reference.load(args.model)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"tether bench: {e}")
    workload = workload_of(args, lm)
    cluster = None
    if args.spawn:
        threads = stage_threads(args)
        cluster = LocalCluster(model=args.model, stages=args.stages, threads=threads, log_dir=args.out / "logs")
        print(f"starting a cluster: model {args.model}, {args.stages} stage(s), {threads} thread(s) each "
              f"(logs in {args.out / 'logs'}) ...", file=sys.stderr, flush=True)
        try:
            cluster.start(timeout=300)
        except (TimeoutError, RuntimeError, ValueError) as e:
            cluster.stop()
            raise SystemExit(f"tether bench: the cluster did not start: {e}")
    target = cluster.target if cluster else args.target
    try:
        rep = dict(meta=meta(args, argv, target, lm, cluster), chaos=chaos_status(args.chaos))
        bench = Bench(args, target, lm, workload)
        rep["levels"] = asyncio.run(bench.run_levels())
        if args.baselines:
            rep["baselines"] = bench.run_baselines()
    finally:
        if cluster is not None:
            cluster.stop()
    files = report.write_all(rep, bench.records, args.out)
    print_summary(rep, files)
