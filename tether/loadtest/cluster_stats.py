"""Engine figures of `tether bench`: what the coordinator and the stages did during each load level (prefix
cache, KV blocks, preemptions, rejections, stage busy time, from their Stats before and after the level), and
how busy each process was (CPU time over wall time, from /proc for the services and os.times for the bench
itself, so the client's own CPU can be told apart on a machine whose cores everyone shares).

The pure parts (`parse_proc_stat`, `engine_delta`, `cpu_delta`) are separate from the parts that read.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import grpc

from tether.loadtest.stats import median

STATS_TIMEOUT_S = 10.0

# Cumulative coordinator counters (differenced per level) and gauges (taken as they are at the level's end).
COORDINATOR_COUNTERS = ("tokens_generated", "requests_finished", "requests_failed", "preemptions", "prefix_queries",
                        "prefix_hits", "prefix_hit_tokens", "prefix_misses", "prompt_tokens", "computed_tokens",
                        "rebuilds", "resumes")
COORDINATOR_GAUGES = ("running", "waiting", "preempted", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_total",
                      "step_seconds", "prefix_cache")
STAGE_COUNTERS = ("prefix_queries", "prefix_hits", "prefix_hit_tokens", "prefix_evictions", "busy_seconds",
                  "uptime_seconds", "steps", "sampling_seconds")
STAGE_GAUGES = ("requests_held", "kv_used_tokens", "kv_capacity_tokens", "kv_blocks_used", "kv_blocks_cached",
                "kv_blocks_total")


# --- reading ---------------------------------------------------------------------------------------------------

def read_engine(coordinator: str | None, stages: Iterable[str] = (), timeout: float = STATS_TIMEOUT_S) -> dict:
    """The engine counters of a cluster now: {"coordinator": {...} | None, "stages": [{...}, ...], "errors": []}.
    A Stats call that fails is recorded in `errors`, never raised: the load figures matter more."""
    from tether.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
    out: dict = {"coordinator": None, "stages": [], "errors": []}
    for address in stages:
        try:
            with grpc.insecure_channel(address) as ch:
                s = stage_pb2_grpc.StageStub(ch).Stats(stage_pb2.StageStatsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            out["errors"].append(f"stage {address}: {e.code().name}")
            out["stages"].append(None)
            continue
        out["stages"].append(dict(address=address, rejections=dict(s.rejections),
                                  **{k: getattr(s, k) for k in STAGE_COUNTERS + STAGE_GAUGES}))
    if coordinator:
        try:
            with grpc.insecure_channel(coordinator) as ch:
                c = coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=timeout)
            out["coordinator"] = dict(address=coordinator, rejections=dict(c.rejections),
                                      **{k: getattr(c, k) for k in COORDINATOR_COUNTERS + COORDINATOR_GAUGES})
        except grpc.RpcError as e:
            out["errors"].append(f"coordinator {coordinator}: {e.code().name}")
    return out


def parse_proc_stat(text: str, ticks_per_s: float) -> float:
    """CPU seconds (user + system) of a process from the text of /proc/<pid>/stat. The command name (field 2)
    may hold spaces and parentheses, so the fields are counted from its last ')'."""
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): utime and stime, fields 14 and 15, are fields[11] and fields[12].
    return (int(fields[11]) + int(fields[12])) / ticks_per_s


def proc_cpu_s(pid: int) -> float | None:
    """CPU seconds a live process has used; None once it has exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_proc_stat(f.read(), os.sysconf("SC_CLK_TCK"))
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None


def proc_rss_kib(pid: int) -> int | None:
    """VmRSS of a live process in KiB; None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def child_pids(pid: int) -> list[int]:
    """The live children of a process (e.g. admission's tagging worker), from /proc/<pid>/task/*/children."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return sorted(set(out))


def with_children(pids: Mapping[str, int]) -> dict[str, int]:
    """`pids` plus each one's children as NAME/child-PID: a service's worker processes are its CPU too."""
    out = dict(pids)
    for name, pid in pids.items():
        for child in child_pids(pid):
            out[f"{name}/child-{child}"] = child
    return out


def self_cpu_s() -> float:
    """CPU seconds of this process (every thread: the event loop, gRPC's threads, torch's)."""
    t = os.times()
    return t.user + t.system


def read_cpu(pids: Mapping[str, int]) -> dict:
    """{"wall": monotonic seconds, "cpu": {name: seconds | None}, "rss_kib": {...}}; "bench" is this process."""
    cpu: dict[str, float | None] = {name: proc_cpu_s(pid) for name, pid in pids.items()}
    cpu["bench"] = self_cpu_s()
    rss = {name: proc_rss_kib(pid) for name, pid in pids.items()}
    rss["bench"] = proc_rss_kib(os.getpid())
    return dict(wall=time.monotonic(), cpu=cpu, rss_kib=rss)


# --- deltas (pure) ---------------------------------------------------------------------------------------------

def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, None when either is missing or den is 0 (a figure that cannot be told, not 0)."""
    if num is None or not den:
        return None
    return num / den


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _diff(after: dict, before: dict, keys: Iterable[str]) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def _reasons(after: dict, before: dict) -> dict[str, int]:
    diff = {k: v - before.get(k, 0) for k, v in after.items()}
    return dict(sorted((k, v) for k, v in diff.items() if v))


def coordinator_delta(before: dict, after: dict) -> dict:
    """The coordinator's figures for one level: counters differenced, gauges at the end, and the ratios."""
    d = _diff(after, before, COORDINATOR_COUNTERS)
    # computed_tokens counts prefill and decode rows; a request's decode rows are its generated tokens but the
    # last (never fed back), so prefill ≈ computed - (generated - finished). An estimate: a failed or preempted
    # request's tokens blur it, and it assumes that accounting of the coordinator's.
    decode_rows = max(0, d["tokens_generated"] - d["requests_finished"])
    prefill = max(0, d["computed_tokens"] - decode_rows)
    return dict(
        address=after.get("address"), **d, rejections=_reasons(after.get("rejections", {}),
                                                                  before.get("rejections", {})),
        **{f"{k}_end": after.get(k) for k in COORDINATOR_GAUGES},
        prefix_hit_rate=ratio(d["prefix_hits"], d["prefix_queries"]),
        hit_tokens_per_prompt_token=ratio(d["prefix_hit_tokens"], d["prompt_tokens"]),
        computed_per_prompt_token=ratio(d["computed_tokens"], d["prompt_tokens"]),
        prefill_computed_est=prefill if d["computed_tokens"] else None,
        prefill_per_prompt_token_est=ratio(prefill, d["prompt_tokens"]) if d["computed_tokens"] else None,
        kv_blocks_used_fraction_end=ratio(after.get("kv_blocks_used"), after.get("kv_blocks_total")))


def stage_delta(before: dict, after: dict) -> dict:
    """One stage's figures for one level; busy fraction = Δbusy_seconds / Δuptime_seconds."""
    d = _diff(after, before, STAGE_COUNTERS)
    return dict(address=after.get("address"), **d,
                rejections=_reasons(after.get("rejections", {}), before.get("rejections", {})),
                **{f"{k}_end": after.get(k) for k in STAGE_GAUGES},
                prefix_hit_rate=ratio(d["prefix_hits"], d["prefix_queries"]),
                busy_fraction=ratio(d["busy_seconds"], d["uptime_seconds"]),
                busy_ms_per_step=ms(ratio(d["busy_seconds"], d["steps"])),
                sampling_ms_per_step=ms(ratio(d["sampling_seconds"], d["steps"])),
                kv_blocks_used_fraction_end=ratio(after.get("kv_blocks_used"), after.get("kv_blocks_total")))


def engine_delta(before: dict, after: dict) -> dict:
    """What the engine did between two `read_engine` of one cluster; a side read in neither is None."""
    c = None
    if before.get("coordinator") and after.get("coordinator"):
        c = coordinator_delta(before["coordinator"], after["coordinator"])
    stages = [stage_delta(b, a) if a and b else None
              for b, a in zip(before.get("stages", []), after.get("stages", []))]
    return dict(coordinator=c, stages=stages, errors=[*before.get("errors", []), *after.get("errors", [])])


def served_step(wall_s: float, stages: list[dict | None]) -> dict | None:
    """Where a served step's wall time went over one level, from the stages' deltas (`stage_delta`, in route
    order): the wall time per step of the first stage, each stage's busy time per step, the last stage's sampling
    per step, and the rest: what no stage was busy for (the hops between the processes, the coordinator's turn,
    a level's start and end). With one micro-batch in flight the stages take turns, so the parts add up to the
    step; with two they overlap and the rest reads negative. None where a stage was not read or ran no step."""
    read = [s for s in stages if s is not None and s["steps"]]
    if not read or len(read) != len(stages):
        return None
    step_ms = 1000 * wall_s / read[0]["steps"]
    busy = [s["busy_ms_per_step"] for s in read]
    return dict(step_ms=step_ms, busy_ms=busy, sampling_ms=read[-1]["sampling_ms_per_step"], rest_ms=step_ms - sum(busy))


def served_step_text(step: dict | None) -> str:
    """'38.1 ms a step: stage 0 12.0 + stage 1 21.3 (sampling 2.9) + 4.8 outside the stages' (or '–')."""
    if step is None:
        return "–"
    stages = " + ".join(f"stage {i} {b:.1f}" for i, b in enumerate(step["busy_ms"]))
    return (f"{step['step_ms']:.1f} ms a step: {stages} (sampling {step['sampling_ms']:.1f}) + "
            f"{step['rest_ms']:.1f} outside the stages")


def cpu_delta(before: dict, after: dict) -> dict:
    """Per process: CPU seconds used between two `read_cpu`, the wall time and their ratio (1.0 = one core
    busy the whole time; a multi-threaded process can exceed 1), and RSS at the end in MiB."""
    wall = after["wall"] - before["wall"]
    out = {}
    for name, cpu in after["cpu"].items():
        start = before["cpu"].get(name)
        used = None if cpu is None or start is None else cpu - start
        rss = after.get("rss_kib", {}).get(name)
        out[name] = dict(cpu_s=None if used is None else round(used, 3), busy_fraction=ratio(used, wall),
                         rss_mib_end=None if rss is None else round(rss / 1024, 1))
    return dict(wall_s=round(wall, 3), processes=out)


# --- the probe the runner calls around each level ---------------------------------------------------------------

@dataclass
class EngineProbe:
    """Reads the cluster's engine Stats and the processes' CPU around each level. `coordinator` None and no
    stages: only CPU (the bench's own, and any `pids`) is measured."""

    coordinator: str | None = None
    stages: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    _engine: dict | None = None
    _cpu: dict | None = None
    _pids: dict[str, int] = field(default_factory=dict)

    @property
    def reads_engine(self) -> bool:
        return bool(self.coordinator or self.stages)

    def before(self) -> None:
        self._engine = read_engine(self.coordinator, self.stages) if self.reads_engine else None
        self._pids = with_children(self.pids)
        self._cpu = read_cpu(self._pids)   # last: the Stats calls' own time stays outside the window

    def after(self) -> dict:
        assert self._cpu is not None, "after() without before()"
        cpu = cpu_delta(self._cpu, read_cpu(self._pids))   # first, for the same reason
        engine = engine_delta(self._engine, read_engine(self.coordinator, self.stages)) if self._engine else None
        if engine is not None:
            engine["step"] = served_step(cpu["wall_s"], engine["stages"])
        return dict(engine=engine, cpu=cpu)


def parse_pids(text: str) -> dict[str, int]:
    """'stage0=123,admission=456' -> {'stage0': 123, 'admission': 456}"""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, pid = part.partition("=")
        if not name or not pid.strip().isdigit():
            raise ValueError(f"expected NAME=PID, got {part!r}")
        out[name.strip()] = int(pid)
    return out


# --- with and without the prefix cache -----------------------------------------------------------------------------

CACHE_OFF, CACHE_ON = "prefix cache off", "prefix cache on"
TTFT_RATIO_TARGET = 0.3    # TTFT p50 with the cache ÷ without, on multi-turn with shared system prompts


def _coord(level: dict, key: str) -> float | None:
    c = (level.get("engine") or {}).get("coordinator")
    return None if c is None else c.get(key)


_VARIANT = re.compile(r"^(?P<level>.*), prefix cache (?P<side>off|on)(?P<repeat> #\d+)?$")


def _level(label: str) -> str:
    m = _VARIANT.match(label)
    assert m is not None, label   # only the variants' levels are paired
    return m["level"]


def compare_prefix_cache(levels: list[dict]) -> dict:
    """Pair each level run without the cache with the same level (and repeat) run with it (`Bench.variant`
    labels them); per pair: TTFT p50 with ÷ without (the issue's figure), E2E p50 and throughput likewise, and
    both hit rates. `levels` then gives, per load level, the median over its repeats of each pair's ratio."""
    sides: dict[str, dict[str, dict]] = {"off": {}, "on": {}}
    for lv in levels:
        if m := _VARIANT.match(lv["label"]):
            sides[m["side"]][m["level"] + (m["repeat"] or "")] = lv
    rows = []
    for key, a in sides["off"].items():
        b = sides["on"].get(key)
        if b is None:
            continue
        sa, sb = a["summary"], b["summary"]
        p50 = {side: s["latency_ms"]["ttft"]["p50"] for side, s in (("off", sa), ("on", sb))}
        e2e = {side: s["latency_ms"]["e2e"]["p50"] for side, s in (("off", sa), ("on", sb))}
        rows.append(dict(
            level=key, base_level=_level(a["label"]),
            completed_off=sa["completed"], completed_on=sb["completed"],
            ttft_p50_ms_off=p50["off"], ttft_p50_ms_on=p50["on"], ttft_p50_ratio=ratio(p50["on"], p50["off"]),
            e2e_p50_ms_off=e2e["off"], e2e_p50_ms_on=e2e["on"], e2e_p50_ratio=ratio(e2e["on"], e2e["off"]),
            output_tok_s_off=sa["output_token_throughput"], output_tok_s_on=sb["output_token_throughput"],
            hit_rate_off=_coord(a, "prefix_hit_rate"), hit_rate_on=_coord(b, "prefix_hit_rate"),
            computed_per_prompt_off=_coord(a, "computed_per_prompt_token"),
            computed_per_prompt_on=_coord(b, "computed_per_prompt_token"),
            prefill_per_prompt_est_off=_coord(a, "prefill_per_prompt_token_est"),
            prefill_per_prompt_est_on=_coord(b, "prefill_per_prompt_token_est")))
    per_level: dict[str, list[dict]] = {}
    for r in rows:
        per_level.setdefault(r["base_level"], []).append(r)

    def med(group: list[dict], key: str) -> float | None:
        values = [r[key] for r in group if r[key] is not None]
        return median(values) if values else None

    summary = [dict(level=name, repeats=len(group), ttft_p50_ratio=med(group, "ttft_p50_ratio"),
                    e2e_p50_ratio=med(group, "e2e_p50_ratio"), hit_rate_on=med(group, "hit_rate_on"),
                    computed_per_prompt_on=med(group, "computed_per_prompt_on"),
                    computed_per_prompt_off=med(group, "computed_per_prompt_off"))
               for name, group in per_level.items()]
    return dict(order=[CACHE_OFF, CACHE_ON], ttft_ratio_target=TTFT_RATIO_TARGET, rows=rows, levels=summary)
