"""`tether bench`: drive a running tether cluster (or one it starts) and write a report."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tether import reference, settings
from tether.argtypes import positive_int
from tether.loadtest import capacity, chaos, cluster_stats, loadgen, report, stats
from tether.loadtest.options import DEFAULT_CONCURRENCY, DEFAULT_NUM_REQUESTS, BenchOptions, Credentials
from tether.loadtest.results import LevelResult
from tether.loadtest.runner import Bench
from tether.loadtest.workloads import WORKLOADS, LongSpec, SharedDocSpec, SyntheticSpec, Workload, parse_mix
from tether.cli.cluster import LocalCluster, linear_inputs_flags
from tether.client import AsyncClient
from tether.model import dtypes

EPILOG = """examples:
  tether bench --spawn --sweep 1,2,4 --num-requests 32 --audit --out bench-out
  tether bench --target 127.0.0.1:50051 --concurrency 8 --duration 60 --slo ttft:1000,tpot:100
  tether bench --spawn --model small --workload synthetic --input-len 512 --output-len 128 --rate 2
  tether bench --spawn --concurrency 32 --baselines --repeats 3
  tether bench --spawn --chaos all --concurrency 8 --num-requests 16
  tether bench --target 127.0.0.1:50051 --coordinator 127.0.0.1:50052 --chaos --num-requests 32
  tether bench --spawn --model tiny --workload multiturn --concurrency 8 --compare-prefix-cache
  tether bench --spawn --model tiny --workload synthetic --input-len 384 --output-len 256 --range-ratio 0 \
      --concurrency 16 --stage-kv-tokens 3400

The report (report.json, report.md, requests.jsonl and PNG plots) goes to --out; docs/PERFORMANCE.md
explains every figure. Timings on shared machines are noisy: compare ratios measured in one run."""


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive; got {text}")
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


def _chaos(text: str) -> chaos.ChaosPlan:
    try:
        return chaos.parse_plan(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _addresses(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


def _pids(text: str) -> dict[str, int]:
    try:
        return cluster_stats.parse_pids(text)
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
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help="API key for --target's admission, when it requires keys (default: $TETHER_API_KEY); "
                        "the answers are audited under the key's tenant")
    g.add_argument("--tls-ca", metavar="PEM", default=None,
                   help="CA certificate that verifies --target's admission; any --tls-* turns TLS on "
                        "(default: $TETHER_TLS_CA)")
    g.add_argument("--tls-cert", metavar="PEM", default=None,
                   help="client certificate, when admission requires one (default: $TETHER_TLS_CERT)")
    g.add_argument("--tls-key", metavar="PEM", default=None,
                   help="the private key of --tls-cert (default: $TETHER_TLS_KEY)")
    g.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                   help="the face the load goes through: admission's gRPC port, or its OpenAI-compatible HTTP API "
                        "(streamed /v1/completions with the official openai client; same workloads, audit and "
                        "report) (default: %(default)s)")
    g.add_argument("--base-url", default=f"http://127.0.0.1:{settings.HTTP_PORT}/v1", metavar="URL",
                   help="with --api openai: admission's OpenAI base URL (default: %(default)s; ignored with --spawn)")
    g.add_argument("--spawn", action="store_true",
                   help="start a local cluster (--model, --stages, --threads) for the run and stop it after")
    g.add_argument("--model", default=settings.DEFAULT_MODEL,
                   help="the model the cluster serves: smollm2 (the real default model), a random-weight preset "
                        "(tiny, small, base: kernel benchmarks) or a Hugging Face folder. The "
                        "bench tokenizes with it, audits and runs baselines on it, and checks it against the "
                        "fingerprint in the answers' receipts (default: %(default)s)")
    g.add_argument("--linear-inputs", default=settings.LINEAR_INPUTS, choices=dtypes.LINEAR_INPUTS,
                   help="what the cluster's float32 linears multiply (the stages' --linear-inputs): the spawned "
                        "stages get it, and the audit and baselines compute in it (default: %(default)s)")
    g.add_argument("--stages", type=positive_int, default=2,
                   help="stage workers: with --spawn, how many to start (layers split evenly); against --target, "
                        "how many the running cluster has (recorded in the report) (default: %(default)s)")
    g.add_argument("--pipelines", type=positive_int, default=1,
                   help="with --spawn: independent pipelines (stages + coordinator each) behind the one admission; "
                        "the engine figures are read from the first pipeline (default: %(default)s)")
    g.add_argument("--route-policy", choices=settings.ROUTE_POLICIES, default=None,
                   help="with --spawn: admission's routing policy across pipelines (default: admission's, "
                        f"{settings.ROUTE_POLICY})")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per stage: with --spawn, what each stage gets; against --target, what the "
                        "running stages have (default: cores divided among the stages, as `tether up` does)")
    g = p.add_argument_group("load (one of; default: --concurrency %d)" % DEFAULT_CONCURRENCY)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=_positive_float, metavar="QPS",
                      help="open loop: Poisson arrivals at this many requests per second, whatever the latency")
    mode.add_argument("--concurrency", type=positive_int, metavar="N",
                      help="closed loop: N users, each sending its next request when its previous one ends")
    mode.add_argument("--sweep", type=_rates, metavar="QPS,QPS,...",
                      help="open loop at each rate in turn (one load level each), e.g. 1,2,4,8")
    g = p.add_argument_group("length of each load level (one of; default: --num-requests %d)" % DEFAULT_NUM_REQUESTS)
    size = g.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=positive_int, metavar="N", help="send N requests per level")
    size.add_argument("--duration", type=_positive_float, metavar="SECONDS",
                      help="send for this long per level, then wait for the requests in flight")
    g.add_argument("--warmup", type=positive_int, default=4, metavar="N",
                   help="requests sent before the first level and left out of every figure; their receipts "
                        "also tell which model the cluster serves (default: %(default)s)")
    g.add_argument("--timeout", type=_positive_float, default=120.0, metavar="SECONDS",
                   help="per-request deadline; a request past it counts as DEADLINE_EXCEEDED (default: %(default)s)")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", type=_mix, default=parse_mix("mix"), metavar="MIX",
                   help=f"weighted mix of {', '.join(WORKLOADS)}, e.g. single:6,multiturn:3,long:1 (that is "
                        "'mix', the default) or just synthetic")
    g.add_argument("--seed", type=int, default=0,
                   help="workload seed: the same seed sends the same requests, and every level the same sequence "
                        "(default: %(default)s)")
    g.add_argument("--input-len", type=positive_int, default=SyntheticSpec.input_len, metavar="TOKENS",
                   help="synthetic: mean prompt length (default: %(default)s)")
    g.add_argument("--output-len", type=positive_int, default=SyntheticSpec.output_len, metavar="TOKENS",
                   help="synthetic: mean output length; EOS is ignored so it is exact (default: %(default)s)")
    g.add_argument("--range-ratio", type=float, default=SyntheticSpec.range_ratio, metavar="R",
                   help="synthetic: lengths are uniform in [L*(1-R), L*(1+R)] (default: %(default)s)")
    g.add_argument("--long-tokens", default=f"{LongSpec.min_tokens}:{LongSpec.max_tokens}", metavar="MIN:MAX",
                   help="long: context length range in prompt tokens (default: %(default)s)")
    g.add_argument("--doc-tokens", type=positive_int, default=SharedDocSpec.tokens, metavar="TOKENS",
                   help="shared-doc: length of the shared passage in prompt tokens, question included "
                        "(default: %(default)s)")
    g = p.add_argument_group("what to measure")
    g.add_argument("--slo", type=_slo, metavar="ttft:MS,tpot:MS",
                   help="service-level objectives for goodput (completed requests/s within all of them); "
                        "metrics: ttft, tpot, e2e in milliseconds. Without it no goodput is reported")
    g.add_argument("--find-capacity", action="store_true",
                   help="search for the highest open-loop rate that meets --slo with zero audit mismatches "
                        "(at least 99%% of requests within every bound, none failed): the rate doubles from "
                        "--rate (default 1/s) until a level misses, then is bisected three times; each level "
                        "lasts --duration (default 15 s). Reports the capacity per pipeline")
    g.add_argument("--audit", action="store_true",
                   help="replay every completed request through the in-process reference, teacher forced on "
                        "the served tokens, and count exact / within-margin / MISMATCH per level")
    g.add_argument("--baselines", action="store_true",
                   help="also measure, on the same requests: tether at concurrency = --batch-size, the raw "
                        "in-process engine, transformers generate with static and continuous batching, and "
                        "llama.cpp's server (see --llama-cpp-python); report ratios")
    g.add_argument("--baseline-requests", type=positive_int, default=32, metavar="N",
                   help="requests in the baseline set (default: %(default)s)")
    g.add_argument("--batch-size", type=positive_int, default=settings.MAX_BATCH_SLOTS, metavar="N",
                   help="baseline batch size, and the served side's concurrency (default: the coordinator's "
                        "micro-batch cap, %(default)s)")
    g.add_argument("--baseline-threads", type=positive_int, default=None, metavar="N",
                   help="torch threads of the in-process baselines (default: what one stage process gets, "
                        "--threads or cores divided among --stages)")
    g.add_argument("--llama-cpp-python", default=sys.executable, metavar="PYTHON",
                   help="with --baselines: the interpreter whose llama-cpp-python[server] (the bench extra, maybe "
                        "in another virtual environment) serves the llama.cpp baseline: `PYTHON -m "
                        "llama_cpp.server` on the model's GGUF with the stages' threads in total, the same "
                        "requests at concurrency --batch-size over its OpenAI API; skipped, with the reason in "
                        "the report, when it is not importable there or the model has no GGUF (only smollm2 "
                        "has) (default: this interpreter)")
    g.add_argument("--llama-cpp-threads", type=positive_int, default=None, metavar="N",
                   help="threads of the llama.cpp baseline (default: the cluster's stages' in total, stages x "
                        "--threads x pipelines; on a shared machine fewer may be fairer: a llama.cpp whose threads "
                        "lose a core stalls at every barrier, see docs/PERFORMANCE.md)")
    g.add_argument("--repeats", type=positive_int, default=1, metavar="N",
                   help="baseline runs per side, interleaved; the report gives medians (default: %(default)s)")
    g = p.add_argument_group(
        "chaos (fault injection; see docs/PERFORMANCE.md)",
        "Per fault kind: faults injected, detected (rejections counted by the stages and the coordinator), "
        "recovered (requests finished after a rebuild or resume), failed explicitly (client errors by gRPC "
        "status) and wrong answers (completed requests the fidelity audit flags as MISMATCH; one per request), "
        "with the stamp checks on and, through the experiment-only --unsafe-disable-stamp-checks of the "
        "services, off.")
    g.add_argument("--chaos", type=_chaos, nargs="?", const=chaos.parse_plan("all"), default=None,
                   metavar="KINDS_OR_SPEC",
                   help="with --spawn, after the levels: for each fault kind alone, start a fresh cluster with "
                        "that fault on every stage (and --frame-timeout 3 on the coordinator), send it the first "
                        "load level (--concurrency or --rate, --num-requests) of the workload without warm-up and "
                        "audit every answer; then the same with --unsafe-disable-stamp-checks (experiment only) on "
                        "every stage and the coordinator. Two cluster starts per kind. The value: "
                        "'all' (the default when bare), kinds ('forget_kv,corrupt'), or a fault spec "
                        "('drop=0.05,corrupt=0.1,seed=7'); a kind without a rate runs at "
                        + ", ".join(f"{k}={r:g}" for k, r in chaos.DEFAULT_RATES.items())
                        + f"; seed {chaos.DEFAULT_SEED} unless given. Against --target: needs --coordinator, "
                        "injects nothing and ignores the value: it reports only the faults and checks that "
                        "cluster was started with (the services' --faults and --unsafe-disable-stamp-checks), "
                        "from Stats read before and after the levels, and audits every level")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="against --target: the running cluster's coordinator, whose Stats give each level's "
                        "engine figures and, with --chaos, the rejections, recoveries and its own injected faults "
                        "(ignored with --spawn)")
    g.add_argument("--stage-addresses", type=_addresses, default=[], metavar="HOST:PORT,...",
                   help="against --target: the running cluster's stages, for their engine figures (busy "
                        "fraction, prefix cache, KV blocks) and, with --chaos, the faults they inject and the slots "
                        "they reject (default: none, only the coordinator's Stats)")
    g = p.add_argument_group(
        "engine figures (prefix cache, KV pressure; see docs/PERFORMANCE.md)",
        "With --spawn, or --coordinator/--stage-addresses, every level reports what the engine did from the "
        "services' Stats before and after it: prefix hit rate and hit tokens, computed ÷ prompt tokens, "
        "preemptions, rejections by reason, stage busy fraction, KV blocks at the end; and each process's CPU "
        "busy fraction (the bench's own included).")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="with --spawn: start the coordinator with --no-prefix-cache (every prompt computed)")
    g.add_argument("--compare-prefix-cache", action="store_true",
                   help="with --spawn: run the levels twice on fresh clusters, first with --no-prefix-cache, then "
                        "with the cache, the same requests in both, and report TTFT p50 with ÷ without and the "
                        "hit rate side by side")
    g.add_argument("--compare-repeats", type=positive_int, default=1, metavar="N",
                   help="--compare-prefix-cache: run each level N times per side, alternating which side goes "
                        "first; repeat k > 1 sends a fresh request sequence (so the cache is not warmed by the "
                        "previous repeat's identical requests); the summary gives medians (default: %(default)s)")
    g.add_argument("--stage-kv-tokens", type=positive_int, metavar="TOKENS",
                   help="with --spawn: each stage's KV pool in tokens (the stages' --kv-capacity; default: "
                        "theirs), to put the cluster under KV pressure")
    g.add_argument("--pids", type=_pids, default={}, metavar="NAME=PID,...",
                   help="against --target: processes of the running cluster whose CPU busy fraction and RSS to "
                        "report per level (with --spawn: every service, automatically)")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                   help="directory for report.json, report.md, requests.jsonl and the plots (default: %(default)s)")
    g.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    return p


def workload_of(args: argparse.Namespace, lm: reference.LoadedModel) -> Workload:
    try:
        lo, hi = (int(x) for x in args.long_tokens.split(":"))
    except ValueError:
        raise SystemExit(f"tether bench: --long-tokens must be MIN:MAX, got {args.long_tokens!r}") from None
    if not 0 < lo <= hi:
        raise SystemExit(f"tether bench: --long-tokens needs 0 < MIN <= MAX, got {args.long_tokens!r}")
    if not 0 <= args.range_ratio < 1:
        raise SystemExit(f"tether bench: --range-ratio must be within [0, 1), got {args.range_ratio}")
    synthetic = SyntheticSpec(args.input_len, args.output_len, args.range_ratio)
    return Workload(args.workload, lm.tokenizer.encode, synthetic, LongSpec(lo, hi), SharedDocSpec(args.doc_tokens))


def stage_threads(args: argparse.Namespace) -> int:
    """Torch threads per stage process: --threads, else the cores divided among the stages (as `tether up`)."""
    return args.threads or max(1, (os.cpu_count() or 1) // (args.stages * getattr(args, "pipelines", 1)))


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


def options_of(args: argparse.Namespace) -> BenchOptions:
    """The options the runner and the chaos runs read, from the checked command line (after the checks
    that set --audit and --duration)."""
    threads = stage_threads(args)
    return BenchOptions(
        model=args.model, stages=args.stages, stage_threads=threads, levels=tuple(levels_of(args)),
        budget=budget_of(args), seed=args.seed, warmup=args.warmup, timeout_s=args.timeout, slo=args.slo,
        audit=args.audit, quiet=args.quiet,
        credentials=Credentials(args.api_key, args.tls_ca, args.tls_cert, args.tls_key),
        capacity_start=args.rate or 1.0, baseline_requests=args.baseline_requests, batch_size=args.batch_size,
        baseline_threads=args.baseline_threads or threads, repeats=args.repeats, api=args.api,
        base_url=args.base_url, llama_cpp_python=args.llama_cpp_python,
        llama_cpp_threads=args.llama_cpp_threads or threads * args.stages * args.pipelines,
        llama_cpp_log=str(args.out / "logs" / "llama-cpp-server.log"))


NO_PREFIX_CACHE = "--no-prefix-cache"   # the coordinator's switch
STAGE_KV_FLAG = "--kv-capacity"         # services/stage_worker/main.py: the stage's KV pool in tokens


def check_target_args(args: argparse.Namespace) -> None:
    if not args.spawn and args.chaos is not None and not args.coordinator:
        raise SystemExit("tether bench: --chaos against a running cluster (--target) needs --coordinator "
                         "HOST:PORT, the coordinator whose Stats counts faults and recoveries; with --spawn the "
                         "bench starts its own clusters with each fault kind")


def check_engine_args(args: argparse.Namespace) -> None:
    if args.find_capacity:
        if not args.slo:
            raise SystemExit("tether bench: --find-capacity searches for the highest rate within an SLO: give "
                             "--slo ttft:MS,tpot:MS")
        if args.sweep or args.concurrency or args.compare_prefix_cache or args.chaos is not None:
            raise SystemExit("tether bench: --find-capacity chooses its own open-loop rates (start one with --rate); "
                             "drop --sweep/--concurrency/--compare-prefix-cache/--chaos")
        if args.num_requests:
            raise SystemExit("tether bench: --find-capacity levels run for a time, not a count (a count sent at "
                             "a high rate is a burst, not a load): use --duration")
        args.duration = args.duration or capacity.LEVEL_S
        args.audit = True    # capacity counts only levels with zero mismatches
    spawn_only = [f for f, on in (("--no-prefix-cache", args.no_prefix_cache),
                                  ("--compare-prefix-cache", args.compare_prefix_cache),
                                  ("--stage-kv-tokens", args.stage_kv_tokens is not None)) if on]
    if args.api == "openai" and (args.compare_prefix_cache or args.chaos is not None):
        raise SystemExit("tether bench: --api openai drives the levels of one cluster; --compare-prefix-cache and "
                         "--chaos run over gRPC")
    if spawn_only and not args.spawn:
        raise SystemExit(f"tether bench: {', '.join(spawn_only)} start(s) the cluster with a flag: needs --spawn")
    if args.compare_prefix_cache and args.no_prefix_cache:
        raise SystemExit("tether bench: --compare-prefix-cache runs with and without the cache already; "
                         "drop --no-prefix-cache")
    if args.compare_repeats > 1 and not args.compare_prefix_cache:
        raise SystemExit("tether bench: --compare-repeats is for --compare-prefix-cache")
    if args.compare_prefix_cache and args.chaos is not None:
        raise SystemExit("tether bench: --compare-prefix-cache and --chaos start clusters of their own: run them "
                         "separately")


def cluster_extra(args: argparse.Namespace, prefix_cache: bool) -> dict[str, list[str]]:
    """Per-service flags (LocalCluster `extra`) of a spawned cluster; `prefix_cache` False adds the
    coordinator's --no-prefix-cache."""
    extra: dict[str, list[str]] = {}
    if args.stage_kv_tokens is not None:
        extra["stage"] = [STAGE_KV_FLAG, str(args.stage_kv_tokens)]
    if inputs := linear_inputs_flags(args.linear_inputs):
        extra["stage"] = extra.get("stage", []) + inputs
    if not prefix_cache:
        extra["coordinator"] = [NO_PREFIX_CACHE]
    if args.route_policy:
        extra["admission"] = ["--route-policy", args.route_policy]
    return extra


def offered_context(args: argparse.Namespace, workload: Workload, sample: int = 64) -> dict:
    """Closed loop: the KV the users ask for at once (concurrency × mean prompt + output tokens, tokenized
    here) against the stage pool, the figure a KV-pressure run is sized by; open loop: the mean alone."""
    requests = workload.take(sample, f"{args.seed}:levels")
    mean = sum(len(workload.encode(r.prompt)) + r.max_tokens for r in requests) / len(requests)
    level = levels_of(args)[0]
    offered = mean * level.concurrency if level.mode == "closed" else None
    return dict(mean_context_tokens=round(mean, 1), concurrency=level.concurrency or None,
                offered_tokens=None if offered is None else round(offered),
                stage_kv_tokens=args.stage_kv_tokens,
                offered_per_pool=cluster_stats.ratio(offered, args.stage_kv_tokens))


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


def engine_meta(args: argparse.Namespace, workload: Workload) -> dict:
    return dict(prefix_cache=("compared: off, then on" if args.compare_prefix_cache
                              else "off (--no-prefix-cache)" if args.no_prefix_cache else "the cluster's default"),
                stage_kv_tokens=args.stage_kv_tokens, doc_tokens=args.doc_tokens,
                context=offered_context(args, workload))


def probe_of(args: argparse.Namespace, cluster: LocalCluster | None) -> cluster_stats.EngineProbe:
    """What to read around each level: every service of a spawned cluster, else what the options name."""
    if cluster is not None:
        stages = [s for s in cluster.services if s.name.startswith("stage")]
        return cluster_stats.EngineProbe(cluster.service("coordinator").address, [s.address for s in stages],
                                  {s.name: s.proc.pid for s in cluster.services if s.proc is not None})
    return cluster_stats.EngineProbe(args.coordinator, list(args.stage_addresses), dict(args.pids))


def start_cluster(args: argparse.Namespace, prefix_cache: bool, log_dir: Path) -> LocalCluster:
    threads = stage_threads(args)
    extra = cluster_extra(args, prefix_cache)
    cluster = LocalCluster(model=args.model, stages=args.stages, pipelines=args.pipelines, threads=threads,
                           log_dir=log_dir, extra=extra)
    flags = "; " + ", ".join(f"{k} {' '.join(v)}" for k, v in extra.items()) if extra else ""
    print(f"starting a cluster: model {args.model}, {args.pipelines} pipeline(s) of {args.stages} stage(s), "
          f"{threads} thread(s) each{flags} "
          f"(logs in {log_dir}) ...", file=sys.stderr, flush=True)
    try:
        cluster.start(timeout=300)
    except (TimeoutError, RuntimeError, ValueError) as e:
        cluster.stop()
        raise SystemExit(f"tether bench: the cluster did not start: {e}") from None
    return cluster


# The one-screen summary's columns: its short header -> the report's column (report.py's *_HEADER).
PRINTED_SUMMARY = {"level": "level", "done": "done", "req/s": "req/s", "goodput": "goodput/s", "tok/s": "out tok/s",
                   "TTFT p50/p99": "TTFT p50/p99 ms", "TPOT p50/p99": "TPOT p50/p99 ms",
                   "E2E p50/p99": "E2E p50/p99 ms", "errors": "errors",
                   "audit ex/mg/MISMATCH": "audit exact/margin/MISMATCH"}
PRINTED_ENGINE = {"level": "level", "hit rate": "prefix hit rate", "computed/prompt": "computed ÷ prompt",
                  "preempt": "preemptions", "NO_CAPACITY coord/stages": "NO_CAPACITY coordinator / stages",
                  "stage busy": "stage busy", "KV blocks end": "KV blocks end used/cached/total",
                  "CPU bench": "CPU busy: bench", "CPU services": "CPU busy: services"}


def _columns(header: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a plain-text table, each column as wide as its widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header, *rows]]


def print_summary(rep: dict, files: list[Path], out: Callable[[str], None] = print) -> None:
    """The run in one screen, read from the report as report.json has it."""
    out("")
    out(f"tether bench: {rep['meta']['model']} at {rep['meta']['target']}")
    rows = [[r[col].replace("**", "") for col in PRINTED_SUMMARY.values()] for r in report.summary_rows(rep["levels"])]
    for line in _columns(list(PRINTED_SUMMARY), rows):
        out(line)
    engine = report.engine_rows(rep["levels"])
    if engine:
        out("engine (Δ Stats per level; CPU busy = CPU time ÷ wall, bench = this client):")
        for line in _columns(list(PRINTED_ENGINE), [[r[col] for col in PRINTED_ENGINE.values()] for r in engine]):
            out("  " + line)
    cap = rep.get("capacity")
    if cap:
        for lv in cap["levels"]:
            out(f"capacity: {lv['rate']:g} req/s {'meets' if lv['meets'] else 'misses'} the SLO: {lv['why']}")
        best = cap["capacity_rate"]
        out(f"capacity: {best:g} req/s within the SLO, {cap['per_pipeline']:g} per pipeline ({cap['pipelines']} "
            f"pipeline(s))" if best is not None else "capacity: no rate tried met the SLO")
    cmp = rep.get("prefix_cache_compare")
    if cmp:
        for r in cmp["rows"]:
            out(f"prefix cache, {r['level']}: TTFT p50 {report.fmt(r['ttft_p50_ms_off'])} ms without, "
                f"{report.fmt(r['ttft_p50_ms_on'])} ms with: with ÷ without {report.ratio_text(r['ttft_p50_ratio'])} "
                f"(target ≤ {cmp['ttft_ratio_target']:g}); hit rate {report.frac(r['hit_rate_on'])} with")
        for lv in cmp["levels"]:
            if lv["repeats"] > 1:
                out(f"prefix cache, {lv['level']}, median of {lv['repeats']}: TTFT p50 with ÷ without "
                    f"{report.ratio_text(lv['ttft_p50_ratio'])}; hit rate {report.frac(lv['hit_rate_on'])} with")
    b = rep.get("baselines")
    if b:
        ratio = b["ratios"]
        out(f"baselines (output tok/s, median of {b['repeats']}): tether {b['served']['output_token_throughput']:.1f}, "
            f"engine {b['engine']['output_token_throughput']:.1f}, transformers "
            f"{report.fmt(b['hf']['output_token_throughput'])}, transformers CB "
            f"{report.fmt(b.get('hf_cb', {}).get('output_token_throughput'))}, llama.cpp "
            f"{report.fmt(b.get('llama_cpp', {}).get('output_token_throughput'))}; "
            f"tether/engine {report.ratio_text(ratio['vs_engine'])}, "
            f"tether/transformers {report.ratio_text(ratio['vs_hf'])}, "
            f"tether/transformers CB {report.ratio_text(ratio.get('vs_hf_cb'))}, "
            f"tether/llama.cpp {report.ratio_text(ratio.get('vs_llama_cpp'))}")
        if b.get("llama_cpp", {}).get("error"):
            out(f"llama.cpp baseline not run: {b['llama_cpp']['error']}")
    if rep["chaos"]["requested"]:
        out("chaos (per fault kind: injected / detected / recovered / failed explicitly / wrong answers):")

        def side(cell: dict | None) -> str:
            cells = report.chaos_side(cell)
            return cells[0] if cells[0] == report.NOT_RUN else " / ".join(cells).replace("**", "")
        rows = [[r["kind"], side(r["on"]), side(r["off"])] for r in rep["chaos"]["rows"]]
        for line in _columns(["kind", "checks ON", "checks OFF"], rows):
            out("  " + line)
        t = rep["chaos"]["totals"]
        out(f"  wrong answers: {t['wrong_answers_checks_on']} with stamp checks on, "
            f"{t['wrong_answers_checks_off']} with them off")
    mismatches = sum(lv["audit"]["mismatch"] for lv in rep["levels"] if lv["audit"])
    if mismatches:
        out(f"!! {mismatches} MISMATCH(ES): answers the model would not give to their request; see report.md")
    out("report: " + ", ".join(str(f) for f in files))


async def compare_levels(options: BenchOptions, repeats: int, off: Bench, on: Bench) -> list[LevelResult]:
    """--compare-prefix-cache: both clusters up at once, each level run `repeats` times on one then the other
    (the order alternating by repeat), so a change in the machine's load hits both sides alike."""
    out = []
    async with AsyncClient(off.target, timeout=options.timeout_s, retry=None) as c_off, \
            AsyncClient(on.target, timeout=options.timeout_s, retry=None) as c_on:
        await off.warm_up(c_off)
        await on.warm_up(c_on)
        sides = [(off, c_off), (on, c_on)]
        for level in options.levels:
            for r in range(repeats):
                suffix = f" #{r + 1}" if repeats > 1 else ""
                for bench, client in (sides if r % 2 == 0 else sides[::-1]):
                    out.append(await bench.measured_level(client, level, f"levels:{r}" if r else "levels",
                                                          bench.label(level) + suffix))
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    check_target_args(args)
    check_engine_args(args)
    target_chaos = args.chaos is not None and not args.spawn
    if target_chaos:
        args.audit = True     # wrong answers are what the audit finds
    try:
        lm = reference.load(args.model, inputs=args.linear_inputs)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"tether bench: {e}") from None
    workload = workload_of(args, lm)
    options = options_of(args)
    if args.compare_prefix_cache:
        rep, records, bench = run_compare(args, options, argv, lm, workload)
    else:
        rep, records, bench = run_one(args, options, argv, lm, workload, target_chaos)
    if args.spawn and args.chaos is not None:
        kinds = ", ".join(f"{k}={r:g}" for k, r in args.chaos.rates.items())
        print(f"chaos: {kinds}; each alone on a fresh cluster, stamp checks on then off ...", file=sys.stderr,
              flush=True)
        rep["chaos"] = chaos.run_spawned(bench, args.chaos, args.out / "logs",
                                         cluster_extra(args, not args.no_prefix_cache))
        records = bench.records
    files = report.write_all(rep, records, args.out)
    print_summary(rep, files)


def run_one(args: argparse.Namespace, options: BenchOptions, argv: list[str], lm: reference.LoadedModel,
            workload: Workload, target_chaos: bool) -> tuple[dict, list, Bench]:
    """The levels (and baselines) on one cluster: spawned, or the running one at --target; the report as
    report.json has it."""
    cluster = start_cluster(args, not args.no_prefix_cache, args.out / "logs") if args.spawn else None
    target = cluster.target if cluster else args.target
    before: dict = {}

    def read_before() -> None:
        before.update(chaos.read_stats(args.coordinator, args.stage_addresses))

    try:
        if cluster is not None:
            options = dataclasses.replace(options, base_url=cluster.base_url or "")
        rep: dict[str, Any] = dict(meta=meta(args, argv, target, lm, cluster), chaos=chaos.not_requested())
        rep["meta"]["engine"] = engine_meta(args, workload)
        rep["meta"]["api"] = options.api if options.api == "grpc" else f"openai ({options.base_url})"
        bench = Bench(options, target, lm, workload, probe_of(args, cluster))
        capacity_found = None
        if args.find_capacity:
            levels, capacity_found = asyncio.run(bench.run_capacity(args.pipelines))
        else:
            levels = asyncio.run(bench.run_levels(read_before if target_chaos else None))
        rep["levels"] = [lv.to_json() for lv in levels]
        if capacity_found is not None:
            rep["capacity"] = capacity_found
        if target_chaos:
            after = chaos.read_stats(args.coordinator, args.stage_addresses)
            rep["chaos"] = chaos.target_report(before, after, bench.records)
        if args.baselines:
            rep["baselines"] = bench.run_baselines().to_json()
    finally:
        if cluster is not None:
            cluster.stop()
    return rep, bench.records, bench


def run_compare(args: argparse.Namespace, options: BenchOptions, argv: list[str], lm: reference.LoadedModel,
                workload: Workload) -> tuple[dict, list, Bench]:
    """--compare-prefix-cache: two clusters, without and with the cache, the same levels on both; baselines (if
    asked) on the one with the cache."""
    clusters: list[LocalCluster] = []
    try:
        for cache in (False, True):
            clusters.append(start_cluster(args, cache, args.out / "logs" / ("cache-on" if cache else "cache-off")))
        off, on = (Bench(options, c.target, lm, workload, probe_of(args, c), name)
                   for c, name in zip(clusters, (cluster_stats.CACHE_OFF, cluster_stats.CACHE_ON)))
        rep: dict[str, Any] = dict(meta=meta(args, argv, f"{off.target} (without), {on.target} (with)", lm,
                                                  clusters[1]), chaos=chaos.not_requested())
        rep["meta"]["engine"] = engine_meta(args, workload)
        rep["levels"] = [lv.to_json() for lv in asyncio.run(compare_levels(options, args.compare_repeats, off, on))]
        rep["prefix_cache_compare"] = cluster_stats.compare_prefix_cache(rep["levels"])
        if args.baselines:
            rep["baselines"] = on.run_baselines().to_json()
    finally:
        for c in clusters:
            c.stop()
    return rep, off.records + on.records, on
