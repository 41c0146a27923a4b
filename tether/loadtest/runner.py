"""One bench run: warm-up, the load levels (each audited right after its load, while the cluster is idle), the
baselines."""

from __future__ import annotations

import asyncio
import contextlib
import operator
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from tether import reference, settings
from tether.loadtest import audit, baselines, capacity, llama_cpp_server, loadgen, stats
from tether.loadtest.cluster_stats import EngineProbe
from tether.loadtest.options import BenchOptions
from tether.loadtest.progress import Progress
from tether.loadtest.records import BREAKDOWN_TAGS, RequestRecord
from tether.loadtest.results import BaselinesResult, LevelResult, Side
from tether.loadtest.workloads import Workload
from tether.client import AsyncClient

# The audit needs no parallelism, and on a shared 2-core machine two OpenMP threads collapse as soon as
# another process takes a core (measured: 1.2 s instead of 15 ms per token on `small`).
AUDIT_THREADS = 1


class Bench:
    """One bench run against `target`: warm-up, the levels (each audited right after its load, while the
    cluster is idle), then the baselines."""

    def __init__(self, options: BenchOptions, target: str, lm: reference.LoadedModel, workload: Workload,
                 probe: EngineProbe | None = None, variant: str = "") -> None:
        self.options, self.target, self.lm, self.workload = options, target, lm, workload
        self.records: list[RequestRecord] = []
        self.probe = probe        # engine Stats and process CPU around each level; None: not measured
        self.variant = variant    # appended to level labels when one invocation runs several clusters

    def client(self, target: str | None = None) -> AsyncClient:
        """A client of `target` (default: the run's) with the run's credentials and deadline, no retries; a
        cluster without keys ignores the key. With --api openai, the same over the HTTP API (openai_stream.py)."""
        if self.options.api == "openai" and target is None:
            from tether.loadtest.openai_stream import OpenAIStreamClient
            return OpenAIStreamClient(self.options.base_url, self.options.timeout_s,   # type: ignore[return-value]
                                      self.options.credentials.api_key)
        return AsyncClient(target or self.target, timeout=self.options.timeout_s, retry=None,
                           **self.options.credentials.client_kwargs())

    def label(self, level: loadgen.Level) -> str:
        return f"{level.label}, {self.variant}" if self.variant else level.label

    def progress(self, label: str, budget: loadgen.Budget) -> Progress:
        return Progress(label, budget.num_requests, budget.duration_s, enabled=not self.options.quiet)

    async def level(self, client: AsyncClient, level: loadgen.Level, budget: loadgen.Budget, key: str,
                    label: str | None = None) -> loadgen.LevelRun:
        """Run one level; `key` seeds its request stream and (open loop) its arrival pattern."""
        seed = f"{self.options.seed}:{key}"
        async with self.progress(label or level.label, budget) as bar:
            return await loadgen.run_level(client, self.workload.stream(seed), level, budget, seed, bar.update)

    async def warm_up(self, client: AsyncClient) -> None:
        """Warm the cluster and check it serves --model: the receipts carry the served model's fingerprint."""
        warmup = self.options.warmup
        run = await self.level(client, loadgen.Level("closed", concurrency=min(4, warmup)),
                               loadgen.Budget(num_requests=warmup), "warmup", "warm-up")
        done = [r for r in run.records if r.ok]
        if not done:
            errors = "; ".join(f"{r.error_code}: {r.error}" for r in run.records[:3])
            raise SystemExit(f"tether bench: every warm-up request to {self.target} failed ({errors})")
        served = done[0].model_fingerprint
        if served != self.lm.served_fingerprint:   # the model and its dtype: the audit compares like with like
            raise SystemExit(f"tether bench: the cluster at {self.target} serves model {served}, but --model "
                             f"{self.options.model} is {self.lm.served_fingerprint} here; pass the served model "
                             f"with --model (and what its stages run: --dtype, --linear-inputs)")

    async def run_levels(self, after_warm_up: Callable[[], None] | None = None) -> list[LevelResult]:
        """Warm up, call `after_warm_up` (chaos against --target reads the cluster's counters there), then run
        every level."""
        out = []
        async with self.client() as client:
            await self.warm_up(client)
            if after_warm_up is not None:
                after_warm_up()
            for level in self.options.levels:
                # Every level sends the same request sequence with the same arrival pattern (scaled to its
                # rate), so levels differ only in their load: common random numbers, the fair way to compare.
                out.append(await self.measured_level(client, level))
        return out

    async def run_capacity(self, pipelines: int) -> tuple[list[LevelResult], dict]:
        """--find-capacity: warm up, then open-loop levels chosen by the capacity search (each audited)."""
        search = capacity.CapacitySearch(start=self.options.capacity_start)
        out = []
        async with self.client() as client:
            await self.warm_up(client)
            while (rate := search.next_rate()) is not None:
                level = await self.measured_level(client, loadgen.Level("open", rate=rate))
                ok, why = capacity.meets(level.summary, level.audit)
                level.capacity = dict(meets=ok, why=why)
                search.record(rate, ok, why)
                out.append(level)
        return out, search.report(pipelines)

    async def measured_level(self, client: AsyncClient, level: loadgen.Level, key: str = "levels",
                             label: str | None = None) -> LevelResult:
        """One level with its engine figures (when probed) and audit: its report; its records join `records`."""
        label = label or self.label(level)
        load_before = os.getloadavg()[0]
        if self.probe is not None:
            self.probe.before()
        run = await self.level(client, level, self.options.budget, key, label)
        # Read right after the load, before the audit's own CPU lands in the window.
        measured = self.probe.after() if self.probe is not None else None
        for rec in run.records:
            rec.level = label
        self.records += run.records
        return self.level_report(run, load_before, measured, label)

    def level_report(self, run: loadgen.LevelRun, load_before: float, measured: dict | None = None,
                     label: str | None = None) -> LevelResult:
        slo = self.options.slo
        audit_json = None
        if self.options.audit:
            with baselines.torch_threads(AUDIT_THREADS):
                audit_json = audit.audit_records(self.lm, run.records).to_json()
        by_tag = {t: stats.breakdown(run.records, operator.methodcaller("tag", t), run.wall_s, slo)
                  for t in BREAKDOWN_TAGS}
        engine = cpu = None
        if measured is not None:
            engine, cpu = measured["engine"], measured["cpu"]
            if engine is not None:
                # The prompt tokens the receipts counted: a cross-check of the coordinator's prompt_tokens.
                engine["client_prompt_tokens"] = sum(r.prompt_tokens for r in run.records if r.ok)
        return LevelResult(label=label or self.label(run.level), mode=run.level.mode, rate=run.level.rate,
                           concurrency=run.level.concurrency, load_average=(load_before, os.getloadavg()[0]),
                           summary=stats.level_summary(run.records, run.wall_s, slo),
                           by_workload=stats.breakdown(run.records, lambda r: r.request.workload, run.wall_s, slo),
                           by_tag=by_tag, audit=audit_json, engine=engine, cpu=cpu)

    async def chaos_load(self, target: str, level: loadgen.Level, budget: loadgen.Budget,
                         label: str) -> loadgen.LevelRun:
        """One chaos run's load on the cluster at `target`: no warm-up (every request counts), and the same
        request sequence for every run, so runs differ only in their faults."""
        async with self.client(target) as client:
            return await self.level(client, level, budget, "chaos", label)

    def run_baselines(self) -> BaselinesResult:
        o = self.options
        served, engine, hf_side, hf_cb, llama = Side(), Side(), Side(), Side(), Side()
        hf = None
        try:
            hf = baselines.load_hf(self.lm.folder, self.lm.model.dtype)
        except ImportError:
            hf_side.error = hf_cb.error = "transformers is not installed (pip install -e '.[bench]')"
        eos = self.lm.tokenizer.eos_ids
        jobs: list[baselines.Job] = []
        with contextlib.ExitStack() as stack:
            server = self.start_llama_cpp(llama, stack)
            for i in range(o.repeats):
                run = asyncio.run(self.served_set(i))
                timed(served, run)
                records = run.records
                if not jobs:   # the exact prompts and sampling the server used, output budgets included
                    jobs = [baselines.Job(self.lm.tokenizer.encode(r.request.prompt), audit.served_params(r))
                            for r in sorted(records, key=lambda r: r.request.index) if r.ok]
                if server is not None:
                    if i == 0:   # its first request pays llama.cpp's own warm-up, as the levels paid ours
                        asyncio.run(self.served_set(i, self.llama_cpp_client(server.base_url), "llama.cpp warm-up",
                                                    requests=1))
                    timed(llama, asyncio.run(self.served_set(i, self.llama_cpp_client(server.base_url),
                                                             "llama.cpp")))
                with baselines.torch_threads(o.baseline_threads):
                    engine.runs.append(baselines.run_engine(self.lm, jobs, o.batch_size,
                                                            settings.MAX_BATCH_TOKENS).output_token_throughput)
                    if hf is not None:
                        pad = baselines.pad_token(hf, eos)
                        hf_side.runs.append(baselines.run_hf(hf, jobs, o.batch_size, pad,
                                                             eos).output_token_throughput)
                        if not hf_cb.error:
                            try:
                                hf_cb.runs.append(baselines.run_hf_continuous(
                                    hf, jobs, o.batch_size, pad, eos).output_token_throughput)
                            except Exception as e:   # noqa: BLE001 - transformers' CB is young: report, don't abort
                                hf_cb.error = f"generate_batch failed: {e!r}"
        return BaselinesResult(requests=o.baseline_requests, completed=len(jobs), batch_size=o.batch_size,
                               threads=o.baseline_threads, stage_threads=o.stage_threads, stages=o.stages,
                               repeats=o.repeats, served=served, engine=engine, hf=hf_side, hf_cb=hf_cb,
                               llama_cpp=llama, llama_cpp_threads=o.llama_cpp_threads,
                               llama_cpp_command=shlex.join(server.display_command) if server is not None else "")

    def start_llama_cpp(self, side: Side, stack: contextlib.ExitStack) -> llama_cpp_server.LlamaCppServer | None:
        """The llama.cpp baseline's server, up for the whole baseline run (`stack` stops it), or None with the
        reason in `side.error` when it cannot run."""
        o = self.options
        side.error = (llama_cpp_server.skip_reason(o.llama_cpp_python, o.model) if o.llama_cpp_python
                      else "not asked")
        if side.error:
            return None
        gguf = llama_cpp_server.gguf_of(o.model)
        assert gguf is not None   # skip_reason found it
        server = llama_cpp_server.LlamaCppServer(o.llama_cpp_python, gguf, o.llama_cpp_threads,
                                                 self.lm.config.max_position_embeddings,
                                                 Path(o.llama_cpp_log or "llama-cpp-server.log"))
        if not o.quiet:
            print(f"starting the llama.cpp baseline: {shlex.join(server.display_command)} ...",
                  file=sys.stderr, flush=True)
        try:
            return stack.enter_context(server)
        except (RuntimeError, TimeoutError, OSError) as e:
            side.error = f"the llama.cpp server did not start: {e}"
            return None

    def llama_cpp_client(self, base_url: str) -> Callable[[], AsyncClient]:
        from tether.loadtest.llama_cpp_client import LlamaCppStreamClient
        tok = self.lm.tokenizer
        return lambda: LlamaCppStreamClient(base_url, self.options.timeout_s, tok.encode,  # type: ignore[return-value]
                                            tok.eos_ids)

    async def served_set(self, repeat: int, client: Callable[[], AsyncClient] | None = None,
                         name: str = "baseline set", requests: int | None = None) -> loadgen.LevelRun:
        """The baseline request set (or its first `requests`) through the cluster (or `client`'s server), all at
        once up to --batch-size in flight."""
        o = self.options
        n = requests or o.baseline_requests
        sent = iter(self.workload.take(n, f"{o.seed}:baseline"))
        level = loadgen.Level("closed", concurrency=min(o.batch_size, n))
        budget = loadgen.Budget(num_requests=n)
        async with self.progress(f"{name} #{repeat + 1}", budget) as bar, (client or self.client)() as c:
            return await loadgen.closed_loop(c, sent, level, budget, bar.update)


def timed(side: Side, run: loadgen.LevelRun) -> None:
    """One repeat of a side served through a load client: its output tok/s, TTFT and TPOT p50."""
    summary = stats.level_summary(run.records, run.wall_s, None)
    side.runs.append(summary["output_token_throughput"] or 0.0)
    failed = [r for r in run.records if not r.ok]
    if failed and not side.error:   # its figures count only what completed: say what did not
        side.error = f"{len(failed)} of {len(run.records)} requests failed ({failed[0].error_code}: {failed[0].error})"
    for key, values in (("ttft", side.ttft_p50_ms), ("tpot", side.tpot_p50_ms)):
        p50 = summary["latency_ms"][key]["p50"]
        if p50 is not None:
            values.append(p50)
