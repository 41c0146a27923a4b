"""One bench run: warm-up, the load levels (each audited right after its load, while the cluster is idle), the
baselines; plus how the command-line options map to levels, budgets and threads."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable

from tether import reference, settings
from tether.loadtest import audit, baselines, capacity, loadgen, stats
from tether.loadtest.cluster_stats import EngineProbe
from tether.loadtest.progress import Progress
from tether.loadtest.records import BREAKDOWN_TAGS, RequestRecord
from tether.loadtest.workloads import Workload
from tether.client import AsyncClient

DEFAULT_NUM_REQUESTS = 32
DEFAULT_CONCURRENCY = 8
# The audit needs no parallelism, and on a shared 2-core machine two OpenMP threads collapse as soon as
# another process takes a core (measured: 1.2 s instead of 15 ms per token on `small`).
AUDIT_THREADS = 1


def ratio(ours: list[float], theirs: list[float]) -> float | None:
    """Median over repeats of our throughput divided by theirs in the same repeat."""
    pairs = [a / b for a, b in zip(ours, theirs) if b > 0]
    return stats.median(pairs) if pairs else None


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


class Bench:
    """One bench run against `target`: warm-up, the levels (each audited right after its load, while the
    cluster is idle), then the baselines."""

    def __init__(self, args: argparse.Namespace, target: str, lm: reference.LoadedModel, workload: Workload,
                 probe: EngineProbe | None = None, variant: str = "") -> None:
        self.args, self.target, self.lm, self.workload = args, target, lm, workload
        self.records: list[RequestRecord] = []
        self.probe = probe        # engine Stats and process CPU around each level; None: not measured
        self.variant = variant    # appended to level labels when one invocation runs several clusters

    @property
    def credentials(self) -> dict:
        """AsyncClient's api_key and TLS files from --api-key and --tls-* (None: the SDK reads $TETHER_API_KEY and
        $TETHER_TLS_*); a cluster without keys ignores the key."""
        return {k: getattr(self.args, k, None) for k in ("api_key", "tls_ca", "tls_cert", "tls_key")}

    def label(self, level: loadgen.Level) -> str:
        return f"{level.label}, {self.variant}" if self.variant else level.label

    def progress(self, label: str, budget: loadgen.Budget) -> Progress:
        return Progress(label, budget.num_requests, budget.duration_s, enabled=not self.args.quiet)

    async def level(self, client: AsyncClient, level: loadgen.Level, budget: loadgen.Budget, key: str,
                    label: str | None = None) -> loadgen.LevelRun:
        """Run one level; `key` seeds its request stream and (open loop) its arrival pattern."""
        seed = f"{self.args.seed}:{key}"
        async with self.progress(label or level.label, budget) as bar:
            return await loadgen.run_level(client, self.workload.stream(seed), level, budget, seed, bar.update)

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

    async def run_levels(self, after_warm_up: Callable[[], None] | None = None) -> list[dict]:
        """Warm up, call `after_warm_up` (chaos against --target reads the cluster's counters there), then run
        every level."""
        out = []
        async with AsyncClient(self.target, timeout=self.args.timeout, retry=None,
                               **self.credentials) as client:
            await self.warm_up(client)
            if after_warm_up is not None:
                after_warm_up()
            for level in levels_of(self.args):
                # Every level sends the same request sequence with the same arrival pattern (scaled to its
                # rate), so levels differ only in their load: common random numbers, the fair way to compare.
                out.append(await self.measured_level(client, level))
        return out

    async def run_capacity(self, pipelines: int) -> tuple[list[dict], dict]:
        """--find-capacity: warm up, then open-loop levels chosen by the capacity search (each audited)."""
        search = capacity.CapacitySearch(start=self.args.rate or 1.0)
        out = []
        async with AsyncClient(self.target, timeout=self.args.timeout, retry=None,
                               **self.credentials) as client:
            await self.warm_up(client)
            while (rate := search.next_rate()) is not None:
                level = await self.measured_level(client, loadgen.Level("open", rate=rate))
                ok, why = capacity.meets(level)
                level["capacity"] = dict(meets=ok, why=why)
                search.record(rate, ok, why)
                out.append(level)
        return out, search.report(pipelines)

    async def measured_level(self, client: AsyncClient, level: loadgen.Level, key: str = "levels",
                             label: str | None = None) -> dict:
        """One level with its engine figures (when probed) and audit: its report; its records join `records`."""
        label = label or self.label(level)
        load_before = os.getloadavg()[0]
        if self.probe is not None:
            self.probe.before()
        run = await self.level(client, level, budget_of(self.args), key, label)
        # Read right after the load, before the audit's own CPU lands in the window.
        measured = self.probe.after() if self.probe is not None else None
        for rec in run.records:
            rec.level = label
        self.records += run.records
        return self.level_report(run, load_before, measured, label)

    def level_report(self, run: loadgen.LevelRun, load_before: float, measured: dict | None = None,
                     label: str | None = None) -> dict:
        slo = self.args.slo
        audit_json = None
        if self.args.audit:
            with baselines.torch_threads(AUDIT_THREADS):
                audit_json = audit.audit_records(self.lm, run.records).to_json()
        by_tag = {t: stats.breakdown(run.records, lambda r, t=t: r.tag(t), run.wall_s, slo) for t in BREAKDOWN_TAGS}
        engine = cpu = None
        if measured is not None:
            engine, cpu = measured["engine"], measured["cpu"]
            if engine is not None:
                # The prompt tokens the receipts counted: a cross-check of the coordinator's prompt_tokens.
                engine["client_prompt_tokens"] = sum(r.prompt_tokens for r in run.records if r.ok)
        return dict(label=label or self.label(run.level), mode=run.level.mode, rate=run.level.rate,
                    concurrency=run.level.concurrency, load_average=[load_before, os.getloadavg()[0]],
                    summary=stats.level_summary(run.records, run.wall_s, slo),
                    by_workload=stats.breakdown(run.records, lambda r: r.request.workload, run.wall_s, slo),
                    by_tag=by_tag, audit=audit_json, engine=engine, cpu=cpu)

    async def chaos_load(self, target: str, level: loadgen.Level, budget: loadgen.Budget,
                         label: str) -> loadgen.LevelRun:
        """One chaos run's load on the cluster at `target`: no warm-up (every request counts), and the same
        request sequence for every run, so runs differ only in their faults."""
        async with AsyncClient(target, timeout=self.args.timeout, retry=None,
                               **self.credentials) as client:
            return await self.level(client, level, budget, "chaos", label)

    def run_baselines(self) -> dict:
        a = self.args
        # One stage's threads: on a shared 2-core machine more OpenMP threads than cores-per-process collapse
        # (GNU OpenMP spins; measured 9-170 instead of ~450 tok/s for 2 threads under load), and a ceiling
        # measured in that state would mean nothing.
        threads = a.baseline_threads or stage_threads(a)
        served_runs: list[float] = []
        engine_runs: list[float] = []
        hf_runs: list[float] = []
        hf_cb_runs: list[float] = []
        hf_error = hf_cb_error = ""
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
                    if not hf_cb_error:
                        try:
                            hf_cb_runs.append(baselines.run_hf_continuous(
                                hf, jobs, a.batch_size, pad, self.lm.tokenizer.eos_ids).output_token_throughput)
                        except Exception as e:   # noqa: BLE001 - transformers' CB is young: report, don't abort
                            hf_cb_error = f"generate_batch failed: {e!r}"
        hf_tps = stats.median(hf_runs) if hf_runs else None
        hf_cb_tps = stats.median(hf_cb_runs) if hf_cb_runs else None
        return dict(requests=a.baseline_requests, completed=len(jobs), batch_size=a.batch_size, threads=threads,
                    stage_threads=stage_threads(a), stages=a.stages, repeats=a.repeats,
                    served=dict(output_token_throughput=stats.median(served_runs), runs=served_runs),
                    engine=dict(output_token_throughput=stats.median(engine_runs), runs=engine_runs),
                    hf=dict(output_token_throughput=hf_tps, runs=hf_runs, **({"error": hf_error} if hf_error else {})),
                    hf_cb=dict(output_token_throughput=hf_cb_tps, runs=hf_cb_runs,
                               **({"error": hf_cb_error or hf_error} if (hf_cb_error or hf_error) else {})),
                    # Each ratio is the median of per-repeat ratios: the sides of one repeat ran back to back,
                    # so a change in the machine's load between repeats cancels out.
                    ratios=dict(vs_engine=ratio(served_runs, engine_runs), vs_hf=ratio(served_runs, hf_runs),
                                vs_hf_cb=ratio(served_runs, hf_cb_runs)))

    async def served_set(self, repeat: int) -> loadgen.LevelRun:
        """The baseline request set through the cluster, all at once up to --batch-size in flight."""
        requests = iter(self.workload.take(self.args.baseline_requests, f"{self.args.seed}:baseline"))
        level = loadgen.Level("closed", concurrency=self.args.batch_size)
        budget = loadgen.Budget(num_requests=self.args.baseline_requests)
        async with self.progress(f"baseline set #{repeat + 1}", budget) as bar, \
                AsyncClient(self.target, timeout=self.args.timeout, retry=None, **self.credentials) as client:
            return await loadgen.closed_loop(client, requests, level, budget, bar.update)
