"""`tether bench --chaos`: fault injection under load, counted per fault kind, with the stamp checks on and off.

With `--spawn`, each fault kind of the plan runs alone (so every count is attributable to it) on a freshly
started cluster: the kind is enabled on every stage (`--faults KIND=RATE,seed=...`), the coordinator notices
a lost frame after `--frame-timeout 3`, and the load is the bench's own (its workload, first load level and
per-level budget, the same requests for every run). Then the same again with the experiment-only switch
`--unsafe-disable-stamp-checks` on every stage and the coordinator. Each run gives one cell:

- injected: the faults the injectors report (stages' and coordinator's `Stats.faults_injected`); a `crash`
  kills its process, and its counter with it, so crashes are counted as the stage exits the bench saw (it
  restarts a crashed stage, as a container's restart policy would);
- detected: every rejection the stages and the coordinator count (`Stats.rejections`, all reasons). A slot a
  stage rejects is counted there and again by the coordinator that rebuilds it, and a lost frame also fails
  the next one on its hop, so this counts detections at every checkpoint, not distinct faults; the report
  keeps both sides by reason;
- caught / slipped (distinct faults, from the injectors' ledger in the services' logs, `read_ledger`): each
  fault that could change an answer, followed to its request's next frame: caught (rebuilt or resent) or
  slipped (the coordinator went on past the faulted slot); open when the request's next frame never came
  (it ended: failed, or finished on a faulted last frame);
- recovered: requests that finished after at least one rebuild or resume (coordinator `Stats.recovered`);
- failed explicitly: requests the client saw fail, by gRPC status;
- wrong answers: completed requests the fidelity audit flags as MISMATCH. A wrong answer counts once,
  however many of its tokens are wrong: after its first wrong token the rest answer another context.

Against a running cluster (`--target`) the bench cannot choose the faults: it reads the coordinator's (and,
if given, the stages') Stats before and after the load levels and reports the difference as one row, under
checks ON or OFF as the coordinator reports them.

The pure parts (plan parsing, counters, cells and the table) are separate from the part that spawns.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from tether import reference
from tether.loadtest import audit
from tether.loadtest.records import RequestRecord
from tether.loadtest.results import ChaosCell, SpawnedRun, StageExit
from tether.faults import FOLLOWED, KINDS, FaultConfig

if TYPE_CHECKING:   # for the annotation only: the load tool does not start clusters on import
    from tether.cli.cluster import LocalCluster

# Per-frame rates when the plan names a kind without one: each kind fires several times in a run of a few
# dozen requests, yet most requests stay within their rebuild budget (--max-rebuilds, 5) with the checks on.
# A frame-level fault (drop, duplicate, reorder, corrupted activations) costs every request of the frame a
# rebuild, and a lost frame also stalls its requests for the frame timeout; a slot-level fault (swap_slots,
# cross_ids, forget_kv) one or two requests; a crash restarts a whole stage process.
DEFAULT_RATES = {"drop": 0.01, "duplicate": 0.01, "reorder": 0.01, "delay": 0.1, "corrupt": 0.01,
                 "swap_slots": 0.03, "cross_ids": 0.03, "forget_kv": 0.03, "crash": 0.006}
FALLBACK_RATE = 0.01   # a kind with no default of its own above (a new one runs under `all` before it gets one)
DEFAULT_SEED = 11
UNSAFE_FLAG = "--unsafe-disable-stamp-checks"
COORDINATOR_FLAGS = ["--frame-timeout", "3"]   # a lost frame is noticed (and synced) after 3 s, not the default
STATS_TIMEOUT_S = 60.0                         # a crashed stage may still be restarting when Stats is read
CHECKS = ("on", "off")


# --- the plan --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChaosPlan:
    """Which kinds to run, each alone, at which rate; the injector's parameters shared by every run."""

    rates: dict[str, float]          # kind -> rate, in KINDS order
    seed: int = DEFAULT_SEED
    delay_ms: float | None = None
    hold_ms: float | None = None

    def config(self, kind: str, seed_offset: int = 0) -> FaultConfig:
        extra = {} if self.delay_ms is None else dict(delay_ms=self.delay_ms)
        return FaultConfig(rates={kind: self.rates[kind]}, seed=self.seed + seed_offset, hold_ms=self.hold_ms,
                           **extra)

    def spec(self, kind: str, seed_offset: int = 0) -> str:
        return self.config(kind, seed_offset).spec()

    def to_json(self) -> dict:
        return dict(rates=self.rates, seed=self.seed, delay_ms=self.delay_ms, hold_ms=self.hold_ms,
                    specs={k: self.spec(k) for k in self.rates})


def parse_plan(text: str) -> ChaosPlan:
    """'all', kinds ('forget_kv,corrupt'), a fault spec ('drop=0.05,corrupt=0.1,seed=7') or a mix of them.

    A bare kind (or `all`) runs at DEFAULT_RATES (FALLBACK_RATE for a kind without one); an explicit rate wins
    wherever it appears. `seed`,
    `delay_ms` and `hold_ms` apply to every run (seed default DEFAULT_SEED)."""
    explicit: set[str] = set()
    bare: set[str] = set()
    items: list[str] = []       # KIND=RATE and parameters, for the injector's parser
    params: set[str] = set()
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, eq, _ = item.partition("=")
        key = key.strip()
        if not eq and key == "all":
            bare.update(KINDS)
        elif not eq and key in KINDS:
            bare.add(key)
        elif not eq:
            raise ValueError(f"unknown fault kind {key!r}; kinds: all, {', '.join(KINDS)}")
        else:
            (explicit if key in KINDS else params).add(key)
            items.append(item)
    # The injector's own parser checks rates and parameters (and repeats) and says what a spec looks like.
    cfg = FaultConfig.parse(",".join(items))
    rates = {k: (cfg.rates[k] if k in explicit else DEFAULT_RATES.get(k, FALLBACK_RATE)) for k in KINDS
             if k in explicit or k in bare}
    if not rates:
        raise ValueError("no fault kind given; e.g. 'all', 'forget_kv' or 'drop=0.05,corrupt=0.1'")
    return ChaosPlan(rates, seed=cfg.seed if "seed" in params else DEFAULT_SEED,
                     delay_ms=cfg.delay_ms if "delay_ms" in params else None, hold_ms=cfg.hold_ms)


def cluster_flags(plan: ChaosPlan, kind: str, checks: str,
                  base: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """The per-service flags (LocalCluster `extra`) of the run of `kind` with the checks `on` or `off`, after
    the bench's own (`base`: e.g. the stages' --linear-inputs, which the audit's reference computes in too)."""
    unsafe = [UNSAFE_FLAG] if checks == "off" else []
    extra = {name: list(flags) for name, flags in (base or {}).items()}
    extra["stage"] = [*extra.get("stage", []), "--faults", plan.spec(kind), *unsafe]
    extra["coordinator"] = [*extra.get("coordinator", []), *COORDINATOR_FLAGS, *unsafe]
    return extra


# --- counters --------------------------------------------------------------------------------------------------

def read_stats(coordinator: str, stages: Iterable[str] = (), timeout: float = STATS_TIMEOUT_S) -> dict:
    """The fault and integrity counters of a cluster now: {"coordinator": {...}, "stages": [{...}, ...]}."""
    from tether.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
    out: dict = {"stages": []}
    for address in stages:
        with grpc.insecure_channel(address) as ch:
            s = stage_pb2_grpc.StageStub(ch).Stats(stage_pb2.StageStatsRequest(), timeout=timeout,
                                                   wait_for_ready=True)
        out["stages"].append(dict(address=address, faults_injected=dict(s.faults_injected),
                                  rejections=dict(s.rejections), stamp_checks=s.stamp_checks))
    with grpc.insecure_channel(coordinator) as ch:
        c = coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=timeout,
                                                           wait_for_ready=True)
    out["coordinator"] = dict(address=coordinator, faults_injected=dict(c.faults_injected),
                              rejections=dict(c.rejections), recovered=c.recovered, rebuilds=c.rebuilds,
                              resumes=c.resumes, requests_failed=c.requests_failed,
                              pipeline_reconnects=c.pipeline_reconnects, stamp_checks=c.stamp_checks)
    return out


def _minus(after: dict, before: dict) -> dict:
    """Counters after minus before: maps of counts lose their zero entries, flags and addresses stay."""
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            diff = {k: v - before.get(key, {}).get(k, 0) for k, v in value.items()}
            out[key] = {k: v for k, v in diff.items() if v}
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = value - before.get(key, 0)
        else:
            out[key] = value
    return out


def stats_delta(before: dict, after: dict) -> dict:
    """What happened between two `read_stats` of one cluster (counters are cumulative since start)."""
    return dict(coordinator=_minus(after["coordinator"], before["coordinator"]),
                stages=[_minus(a, b) for a, b in zip(after["stages"], before["stages"])])


# --- the injectors' ledger --------------------------------------------------------------------------------------

_RECORD = re.compile(r"fault (\d+) (\w+) at (\w+): ?(.*)$")
_OUTCOME = re.compile(r"fault (\d+) (\w+): (\S+)@(\d+):(\d+) (caught|SLIPPED THROUGH) \(next seen (\S+)\)")
_HARMLESS = re.compile(r"fault (\d+) (\w+): harmless")


def _slot(text: str) -> tuple[str, int, int]:
    rid, _, rest = text.rpartition("@")
    epoch, _, position = rest.partition(":")
    return rid, int(epoch), int(position)


def read_ledger(log_dir: Path) -> dict[tuple[str, int, int], dict]:
    """Every fault the injectors logged (tether/faults/ledger.py `FaultLedger`) in the service logs under `log_dir`:
    (service, life, number) -> {kind, hook, slots: {(request_id, epoch, position): "open" | "caught" |
    "slipped"}, harmless}. `life` counts the service's restarts (a crashed stage's injector starts again at 1)."""
    faults: dict[tuple[str, int, int], dict] = {}
    for path in sorted(Path(log_dir).glob("*.log")):
        life, seen = 0, set[int]()
        for line in path.read_text(errors="replace").splitlines():
            if m := _RECORD.search(line):
                if int(m[1]) in seen:
                    life, seen = life + 1, set()
                seen.add(int(m[1]))
                faults[(path.stem, life, int(m[1]))] = dict(
                    kind=m[2], hook=m[3], slots={_slot(x): "open" for x in m[4].split()}, harmless=False)
            elif (m := _OUTCOME.search(line)) and (path.stem, life, int(m[1])) in faults:
                faults[(path.stem, life, int(m[1]))]["slots"][(m[3], int(m[4]), int(m[5]))] = (
                    "caught" if m[6] == "caught" else "slipped")
            elif (m := _HARMLESS.search(line)) and (path.stem, life, int(m[1])) in faults:
                faults[(path.stem, life, int(m[1]))]["harmless"] = True
    return faults


def ledger_counts(faults: dict) -> dict[str, dict[str, int]]:
    """Distinct faults by kind: logged; followed (could change an answer); caught (every slot acted on);
    slipped (a slot the coordinator went on with); open (neither, the request's next frame never came)."""
    out: dict[str, dict[str, int]] = {}
    for f in faults.values():
        c = out.setdefault(f["kind"], dict(logged=0, followed=0, caught=0, slipped=0, open=0))
        c["logged"] += 1
        if f["kind"] not in FOLLOWED or f["harmless"]:
            continue
        c["followed"] += 1
        outcomes = set(f["slots"].values())
        c["slipped" if "slipped" in outcomes else "open" if "open" in outcomes else "caught"] += 1
    return dict(sorted(out.items()))


# --- one cell, the table ---------------------------------------------------------------------------------------

def _add(counters: Iterable[dict]) -> dict[str, int]:
    total: Counter = Counter()
    for c in counters:
        total.update(c)
    return dict(sorted((k, v) for k, v in total.items() if v))


def chaos_cell(stats: dict, records: list[RequestRecord], crashes: int = 0, ledger: dict | None = None) -> ChaosCell:
    """One run's figures from its Stats (`read_stats` shape) and its audited requests (verdicts set); with the
    run's `read_ledger`, the distinct faults caught and slipped by kind."""
    coord, stages = stats["coordinator"], stats["stages"]
    injected = _add([coord.get("faults_injected", {}), *(s.get("faults_injected", {}) for s in stages),
                     {"crash": crashes}])
    done = [r for r in records if r.ok]
    checks = coord.get("stamp_checks", True) and all(s.get("stamp_checks", True) for s in stages)
    return ChaosCell(stamp_checks=checks, requests=len(records), completed=len(done), injected_by_kind=injected,
                     detected_at_stages=_add(s.get("rejections", {}) for s in stages),
                     detected_at_coordinator=_add([coord.get("rejections", {})]),
                     recovered=coord.get("recovered", 0), rebuilds=coord.get("rebuilds", 0),
                     resumes=coord.get("resumes", 0), pipeline_reconnects=coord.get("pipeline_reconnects", 0),
                     stage_crashes=crashes,
                     failed_by_status=dict(sorted(Counter(r.error_code for r in records if not r.ok).items())),
                     wrong_answers=sum(r.verdict == reference.MISMATCH for r in done),
                     exact=sum(r.verdict == reference.EXACT for r in done),
                     within_margin=sum(r.verdict == reference.WITHIN_MARGIN for r in done),
                     not_audited=sum(not r.verdict for r in done),
                     faults_by_kind=None if ledger is None else ledger_counts(ledger))


def chaos_table(cells: Iterable[tuple[str, str, ChaosCell]]) -> list[dict]:
    """The report's rows of (kind, "on"/"off", cell) runs: one row per kind (first-seen order), checks on and
    off side by side as report.json has them; a side that did not run is None."""
    rows: dict[str, dict] = {}
    for kind, checks, cell in cells:
        if checks not in CHECKS:
            raise ValueError(f"checks must be 'on' or 'off', got {checks!r}")
        rows.setdefault(kind, dict(kind=kind, on=None, off=None))[checks] = cell.to_json()
    return list(rows.values())


def totals(rows: list[dict]) -> dict[str, int]:
    """Wrong answers over every run with the checks on, and with them off."""
    return {f"wrong_answers_checks_{c}": sum(r[c]["wrong_answers"] for r in rows if r[c]) for c in CHECKS}


def not_requested() -> dict:
    return dict(requested=False, available=False,
                reason="not requested: pass --chaos (with --spawn: the kinds to inject, e.g. 'all'; against "
                       "--target: --coordinator of a cluster started with --faults)")


# --- the runs --------------------------------------------------------------------------------------------------

def with_faults(argv: list[str], spec: str) -> list[str]:
    """A copy of a service's argv with its `--faults` value replaced by `spec` (unchanged without one)."""
    if "--faults" not in argv:
        return list(argv)
    at = argv.index("--faults") + 1
    return [*argv[:at], spec, *argv[at + 1:]]


@dataclass
class StageSupervisor:
    """Restarts a stage that exits during a run (a `crash` fault), as a container restart policy would, with
    the next fault seed so that a restarted stage does not crash at the very frame it crashed at before.

    Exit status 137 is the injector's `os._exit(137)`. Any other exit is the relaunch itself failing: the bench
    process has threads (gRPC, this one), and a child forked from it can die before it runs the stage (seen:
    SIGSEGV within a second of the fork, nothing logged). Those are retried and reported apart, never counted
    as injected crashes."""

    cluster: LocalCluster
    plan: ChaosPlan
    kind: str
    exits: list[StageExit] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "StageSupervisor":
        self._thread = threading.Thread(target=self._watch, name="chaos-supervisor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def crashes(self) -> int:
        return sum(e.status == 137 for e in self.exits)

    @property
    def failed_restarts(self) -> int:
        return sum(e.status != 137 for e in self.exits)

    def _watch(self) -> None:
        stages = [s for s in self.cluster.services if s.name.startswith("stage")]
        started = {s.name: time.monotonic() for s in stages}
        while not self._stop.wait(0.2):
            for svc in stages:
                code = None if svc.proc is None else svc.proc.poll()
                if code is None:
                    continue
                self.exits.append(StageExit(svc.name, code,
                                            round(time.monotonic() - started[svc.name], 1)))
                svc.argv = with_faults(svc.argv, self.plan.spec(self.kind, seed_offset=len(self.exits)))
                try:
                    self.cluster.restart(svc.name)
                    started[svc.name] = time.monotonic()
                except OSError as e:
                    self.errors.append(f"{svc.name}: restart failed: {e}")
                    return


def run_spawned(bench, plan: ChaosPlan, log_root: Path, base: dict[str, list[str]] | None = None) -> dict:
    """Every kind of `plan` alone, checks on then off, each on a fresh cluster; the report's `chaos` dict.

    `bench` is the run's `runner.Bench`: its options give model, stages, threads, workload and load, and its
    records receive the chaos requests (level `chaos KIND checks on|off`, audited). `base`: the per-service
    flags of the bench's own cluster, which every chaos cluster starts with too."""
    from tether.loadtest import baselines
    from tether.loadtest.runner import AUDIT_THREADS
    from tether.cli.cluster import LocalCluster

    o = bench.options
    level, budget = o.levels[0], o.budget
    cells = []
    runs = []
    for kind in plan.rates:
        for checks in CHECKS:
            label = f"chaos {kind} checks {checks}"
            log_dir = log_root / f"chaos-{kind}-checks-{checks}"
            cluster = LocalCluster(model=o.model, stages=o.stages, threads=o.stage_threads,
                                   log_dir=log_dir, extra=cluster_flags(plan, kind, checks, base))
            try:
                cluster.start(timeout=300)
            except (TimeoutError, RuntimeError, ValueError) as e:
                cluster.stop()
                raise SystemExit(f"tether bench: the chaos cluster for {kind} (checks {checks}) did not start: "
                                 f"{e}") from None
            try:
                with StageSupervisor(cluster, plan, kind) as supervisor:
                    run = asyncio.run(bench.chaos_load(cluster.target, level, budget, label))
                    stats = read_stats(cluster.service("coordinator").address,
                                       [s.address for s in cluster.services if s.name.startswith("stage")])
            finally:
                cluster.stop()
            for rec in run.records:
                rec.level = label
            with baselines.torch_threads(AUDIT_THREADS):   # the cluster is gone: the audit has the machine
                summary = audit.audit_records(bench.lm, run.records)
            bench.records += run.records
            cell = chaos_cell(stats, run.records, supervisor.crashes, read_ledger(log_dir))
            cell.spawned = SpawnedRun(wall_s=run.wall_s, spec=plan.spec(kind), stage_exits=supervisor.exits,
                                      failed_restarts=supervisor.failed_restarts, restart_errors=supervisor.errors,
                                      mismatches=summary.mismatches[:3])
            cell.stats = stats
            cells.append((kind, checks, cell))
            runs.append(dict(kind=kind, checks=checks, label=label, logs=str(log_dir)))
    rows = chaos_table(cells)
    return dict(requested=True, available=True, mode="spawn", plan=plan.to_json(),
                coordinator_flags=COORDINATOR_FLAGS, unsafe_flag=UNSAFE_FLAG,
                load=dict(level=level.label, budget=(f"{budget.num_requests} requests" if budget.num_requests
                                                    else f"{budget.duration_s:g} s")),
                wrong_answer_unit="request", rows=rows, totals=totals(rows), runs=runs)


def target_report(before: dict, after: dict, records: list[RequestRecord], label: str | None = None) -> dict:
    """The chaos dict against a running cluster: one row, what happened between the two Stats readings."""
    delta = stats_delta(before, after)
    cell = chaos_cell(delta, records)
    cell.stats = delta
    kind = label or "+".join(cell.injected_by_kind) or ("(none injected)" if after["stages"] else
                                                           "(as started; stage faults not read)")
    rows = chaos_table([(kind, "on" if cell.stamp_checks else "off", cell)])
    return dict(requested=True, available=True, mode="target", coordinator=after["coordinator"]["address"],
                stages=[s["address"] for s in after["stages"]], wrong_answer_unit="request", rows=rows,
                totals=totals(rows),
                note=("faults and checks as the cluster was started; counters are the difference of Stats read "
                      "after the warm-up and after the last level" +
                      ("" if after["stages"] else "; no --stage-addresses given, so faults injected by the stages "
                       "and their own rejections are not counted (the coordinator's rejections include the "
                       "stage rejections it received)")))
