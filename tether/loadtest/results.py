"""Typed records of what a bench run measured: one load level, the baselines, one chaos run.

The runner and the chaos runs build these; `to_json` turns each into its part of report.json at the edge
(tether/loadtest/cli.py), with the keys and order docs/PERFORMANCE.md describes. The nested figures (a
level's latency summary, the services' Stats deltas) stay the dicts tether/loadtest/stats.py and
cluster_stats.py build: they are report.json's shape already.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tether.loadtest import stats


def median_ratio(ours: list[float], theirs: list[float]) -> float | None:
    """Median over repeats of our throughput divided by theirs in the same repeat."""
    pairs = [a / b for a, b in zip(ours, theirs) if b > 0]
    return stats.median(pairs) if pairs else None


@dataclass
class LevelResult:
    """One load level: its load, latency and throughput summary, breakdowns, audit and engine figures."""

    label: str
    mode: str                           # "open" or "closed"
    rate: float | None
    concurrency: int | None
    load_average: tuple[float, float]   # 1-minute load average before and after the level
    summary: dict                       # stats.level_summary
    by_workload: dict[str, dict]
    by_tag: dict[str, dict[str, dict]]
    audit: dict | None                  # audit.AuditSummary.to_json(); None: not audited
    engine: dict | None                 # cluster_stats.EngineProbe's Stats delta; None: not probed
    cpu: dict | None
    capacity: dict | None = None        # --find-capacity: {meets, why}

    def to_json(self) -> dict:
        out = dict(label=self.label, mode=self.mode, rate=self.rate, concurrency=self.concurrency,
                   load_average=list(self.load_average), summary=self.summary, by_workload=self.by_workload,
                   by_tag=self.by_tag, audit=self.audit, engine=self.engine, cpu=self.cpu)
        if self.capacity is not None:
            out["capacity"] = self.capacity
        return out


@dataclass
class Side:
    """One side of the baselines: output tokens per second of each repeat, or why it did not run; the sides
    served through a load client (tether, llama.cpp) also have each repeat's TTFT and TPOT p50."""

    runs: list[float] = field(default_factory=list)
    error: str = ""
    ttft_p50_ms: list[float] = field(default_factory=list)
    tpot_p50_ms: list[float] = field(default_factory=list)

    @property
    def output_token_throughput(self) -> float | None:
        return stats.median(self.runs) if self.runs else None

    def to_json(self) -> dict:
        out: dict = dict(output_token_throughput=self.output_token_throughput, runs=self.runs)
        if self.ttft_p50_ms or self.tpot_p50_ms:
            out.update(ttft_p50_ms=_median(self.ttft_p50_ms), tpot_p50_ms=_median(self.tpot_p50_ms),
                       ttft_p50_ms_runs=self.ttft_p50_ms, tpot_p50_ms_runs=self.tpot_p50_ms)
        if self.error:
            out["error"] = self.error
        return out


def _median(values: list[float]) -> float | None:
    return stats.median(values) if values else None


@dataclass
class BaselinesResult:
    """The same request set served, through the in-process engine, through transformers (static and
    continuous batching) and through llama.cpp's server, interleaved `repeats` times."""

    requests: int
    completed: int
    batch_size: int
    threads: int                        # torch threads of the in-process sides
    stage_threads: int
    stages: int
    repeats: int
    served: Side
    engine: Side
    hf: Side
    hf_cb: Side
    llama_cpp: Side = field(default_factory=Side)
    llama_cpp_threads: int = 0
    llama_cpp_command: str = ""         # the server's command line, when it ran

    def to_json(self) -> dict:
        return dict(requests=self.requests, completed=self.completed, batch_size=self.batch_size,
                    threads=self.threads, stage_threads=self.stage_threads, stages=self.stages,
                    repeats=self.repeats, served=self.served.to_json(), engine=self.engine.to_json(),
                    hf=self.hf.to_json(), hf_cb=self.hf_cb.to_json(), llama_cpp=self.llama_cpp.to_json(),
                    llama_cpp_threads=self.llama_cpp_threads, llama_cpp_command=self.llama_cpp_command,
                    # Each ratio is the median of per-repeat ratios: the sides of one repeat ran back to back,
                    # so a change in the machine's load between repeats cancels out.
                    ratios=dict(vs_engine=median_ratio(self.served.runs, self.engine.runs),
                                vs_hf=median_ratio(self.served.runs, self.hf.runs),
                                vs_hf_cb=median_ratio(self.served.runs, self.hf_cb.runs),
                                vs_llama_cpp=median_ratio(self.served.runs, self.llama_cpp.runs)))


@dataclass(frozen=True)
class StageExit:
    """A stage process that exited during a chaos run (137: an injected crash; else a failed relaunch)."""

    stage: str
    status: int
    uptime_s: float


@dataclass
class SpawnedRun:
    """What a chaos run on a cluster the bench started adds to its cell."""

    wall_s: float
    spec: str                           # the stages' --faults
    stage_exits: list[StageExit]
    failed_restarts: int
    restart_errors: list[str]
    mismatches: list[dict]              # the first few, as the audit reports them

    def to_json(self) -> dict:
        return dict(wall_s=self.wall_s, spec=self.spec, stage_exits=[asdict(e) for e in self.stage_exits],
                    failed_restarts=self.failed_restarts, restart_errors=self.restart_errors,
                    mismatches=self.mismatches)


@dataclass
class ChaosCell:
    """One chaos run (one fault kind, stamp checks on or off): faults injected, detected, recovered, failed
    explicitly and wrong answers (tether/loadtest/chaos.py says how each is counted)."""

    stamp_checks: bool
    requests: int
    completed: int
    injected_by_kind: dict[str, int]
    detected_at_stages: dict[str, int]
    detected_at_coordinator: dict[str, int]
    recovered: int
    rebuilds: int
    resumes: int
    pipeline_reconnects: int
    stage_crashes: int
    failed_by_status: dict[str, int]
    wrong_answers: int
    exact: int
    within_margin: int
    not_audited: int
    faults_by_kind: dict[str, dict[str, int]] | None = None   # from the injectors' ledger, when read
    spawned: SpawnedRun | None = None
    stats: dict | None = None           # the Stats the cell was counted from

    @property
    def injected(self) -> int:
        return sum(self.injected_by_kind.values())

    @property
    def detected(self) -> int:
        return sum(self.detected_at_stages.values()) + sum(self.detected_at_coordinator.values())

    @property
    def failed(self) -> int:
        return sum(self.failed_by_status.values())

    def to_json(self) -> dict:
        out = dict(stamp_checks=self.stamp_checks, requests=self.requests, completed=self.completed,
                   injected=self.injected, injected_by_kind=self.injected_by_kind, detected=self.detected,
                   detected_at_stages=self.detected_at_stages, detected_at_coordinator=self.detected_at_coordinator,
                   recovered=self.recovered, rebuilds=self.rebuilds, resumes=self.resumes,
                   pipeline_reconnects=self.pipeline_reconnects, stage_crashes=self.stage_crashes,
                   failed=self.failed, failed_by_status=self.failed_by_status, wrong_answers=self.wrong_answers,
                   exact=self.exact, within_margin=self.within_margin, not_audited=self.not_audited)
        if self.faults_by_kind is not None:
            out["faults_by_kind"] = self.faults_by_kind
        if self.spawned is not None:
            out.update(self.spawned.to_json())
        if self.stats is not None:
            out["stats"] = self.stats
        return out
