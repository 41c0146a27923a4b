"""Chaos on loopback: whatever the injector does to frames between the services, no client receives a token
computed from the wrong state. Every response equals its solo reference or fails with an explicit status, a
stated share of them completes exactly, and every harmful fault injected is caught before the coordinator
appends the faulted slot's token: the injectors' ledger (tether/faults/ledger.py, in the services' logs) follows
each faulted slot to the request's next frame, which must be a rebuild or a resend, never the next position."""

from __future__ import annotations

import asyncio
import functools
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from tether import reference
from tether.loadtest.chaos import read_ledger
from tether.cli.cluster import LocalCluster
from tether.client import AsyncClient, TetherError
from tether.faults import FOLLOWED
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc

EXPLICIT = {grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Kinds that change what a stage would compute: every one injected must be caught.
HARMFUL = {"drop", "duplicate", "reorder", "corrupt", "swap_slots", "cross_ids", "forget_kv"}

CASES = [dict(prompt=p, max_tokens=mt, **extra) for p, mt, extra in [
    ("请用不超过50字向老人解释血糖仪读数", 24, {}),
    ("Explain why the sky is blue.", 20, dict(temperature=0.8, seed=3)),
    ("写一首关于秋天的短诗", 16, dict(temperature=1.0, seed=9, top_p=0.9)),
    ("def fib(n):", 24, {}),
    ("Summarize: the quick brown fox jumps over the lazy dog.", 12, dict(temperature=0.7, seed=5, top_k=20)),
    ("你好", 30, {}),
]] * 2


@dataclass
class Ledger:
    """The injectors' ledger (tether/faults/ledger.py) from every service log: each fault, its slots and their fate."""

    faults: dict = field(default_factory=dict)        # (service, life, number) -> fault (tether.loadtest.chaos)
    rebuilds: Counter = field(default_factory=Counter)  # request id -> rebuilds the coordinator logged

    @classmethod
    def read(cls, log_dir: Path) -> Ledger:
        log = (log_dir / "coordinator.log").read_text(errors="replace")
        return cls(read_ledger(log_dir), Counter(re.findall(r" INFO request (\S+): [A-Z_0-9]+ \(", log)))

    def cancelled(self) -> list[dict]:
        """cross_ids on two consecutive hops that picked the same two slots (only slots at position 0 of a new
        epoch pass the hop between: parent hash = seed for both, and the digest binds hashes, not ids).
        The second gives the ids back, so the frame is computed right and its tokens are the right ones, but the
        stage between now holds each request's state under the other's id, bound to the other's context hash:
        the next frame of either is refused there. Counted as caught if both requests were rebuilt past that
        epoch (or did not complete)."""
        out = []
        for (svc, _, _), f in self.faults.items():
            if f["kind"] != "cross_ids" or f["hook"] != "outbound":
                continue
            after = "stage0" if svc == "coordinator" else f"stage{int(svc.removeprefix('stage')) + 1}"
            if len(f["slots"]) != 2:
                continue
            (a, ea, pa), (b, eb, pb) = f["slots"]
            crossed = {(b, ea, pa), (a, eb, pb)}     # the stamps as the next hop saw them
            for (svc2, _, _), g in self.faults.items():
                if (svc2 == after and g["kind"] == "cross_ids" and g["hook"] == "outbound"
                        and set(g["slots"]) == crossed):
                    out += [f, g]
        return out

    def _excused(self, f: dict, completed_ids: set[str]) -> bool:
        return any(f is c for c in self.cancelled()) and all(
            rid not in completed_ids or self.rebuilds[rid] >= epoch for rid, epoch, _ in f["slots"])

    def slipped_unexcused(self, completed_ids: set[str]) -> list[str]:
        return [f"{key[0]} fault {key[2]} {f['kind']} at {f['hook']}: {slot} slipped through"
                for key, f in self.faults.items() for slot, o in f["slots"].items()
                if o == "slipped" and not self._excused(f, completed_ids)]

    @property
    def slipped(self) -> list[str]:
        """Every slot that slipped through, excused or not."""
        return [f"{key[0]} fault {key[2]} {f['kind']}: {slot}" for key, f in self.faults.items()
                for slot, o in f["slots"].items() if o == "slipped"]

    def by_kind(self) -> Counter:
        return Counter(f["kind"] for f in self.faults.values())

    def harmful(self) -> list[dict]:
        """The followed faults that could change an answer (a reorder sent in order after all could not)."""
        return [f for f in self.faults.values() if f["kind"] in FOLLOWED and not f["harmless"]]

    def uncaught(self, completed_ids: set[str]) -> list[dict]:
        """Harmful faults with a slot that slipped through, or left open on a request that completed: its last
        frame was faulted and the coordinator finished it anyway. (Open on a request that failed explicitly
        is fine: nothing more was appended.)"""
        return [f for f in self.harmful() if not self._excused(f, completed_ids) and
                any(o == "slipped" or (o == "open" and s[0] in completed_ids) for s, o in f["slots"].items())]

    def caught_by_kind(self, completed_ids: set[str]) -> Counter:
        bad = {id(f) for f in self.uncaught(completed_ids)}
        return Counter(f["kind"] for f in self.harmful() if id(f) not in bad)

    def slot_ids(self) -> set[str]:
        return {s[0] for f in self.faults.values() for s in f["slots"]}


@dataclass
class Outcome:
    exact: int
    wrong: int
    failures: Counter
    completed_ids: set[str]
    injected: Counter
    stage_rejections: list[Counter]
    coordinator: coordinator_pb2.StatsReply
    ledger: Ledger

    def summary(self) -> str:
        return (f"exact {self.exact} wrong {self.wrong} failed {dict(self.failures)} injected "
                f"{dict(+self.injected)} recovered {self.coordinator.recovered} rebuilds "
                f"{self.coordinator.rebuilds} resumes {self.coordinator.resumes} stage rejections "
                f"{[dict(r) for r in self.stage_rejections]} coordinator rejections "
                f"{dict(self.coordinator.rejections)} caught {dict(self.ledger.caught_by_kind(self.completed_ids))}")


@functools.cache
def _reference_ids(case: tuple) -> list[int]:
    """The solo reference's tokens for a case (deterministic: computed once per test process, not per test)."""
    params = dict(case)
    return reference.generate(params.pop("prompt"), "tiny", **params).token_ids


def _run(target: str) -> tuple[int, int, Counter, set[str]]:
    """Send CASES concurrently; return (exact, wrong, failures by status, internal ids of completed requests)."""
    async def go():
        async with AsyncClient(target, timeout=120, retry=None) as client:
            return await asyncio.gather(*(client.generate(**c) for c in CASES), return_exceptions=True)
    results = asyncio.run(go())
    exact = wrong = 0
    failures: Counter = Counter()
    completed: set[str] = set()
    for case, got in zip(CASES, results):
        if isinstance(got, TetherError):
            assert got.code in EXPLICIT, (got.code, got.message)
            failures[got.code.name] += 1
            continue
        assert not isinstance(got, BaseException), got
        completed.add(got.receipt.internal_id)
        if got.token_ids == _reference_ids(tuple(sorted(case.items()))):
            exact += 1
        else:
            wrong += 1
    return exact, wrong, failures, completed


def _collect(cluster: LocalCluster, stages: int, log_dir: Path, run: tuple) -> Outcome:
    injected: Counter = Counter()
    stage_rejections = []
    for i in range(stages):
        with grpc.insecure_channel(cluster.service(f"stage{i}").address) as ch:
            s = stage_pb2_grpc.StageStub(ch).Stats(stage_pb2.StageStatsRequest(), timeout=30, wait_for_ready=True)
        injected.update(dict(s.faults_injected))
        stage_rejections.append(Counter(dict(s.rejections)))
    with grpc.insecure_channel(cluster.service("coordinator").address) as ch:
        c = coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=30)
    injected.update(dict(c.faults_injected))
    return Outcome(*run, injected, stage_rejections, c, Ledger.read(log_dir))


def _cluster(tmp_path, stages: int, stage_faults: str = "", coordinator_faults: str = "",
             unsafe: bool = False, max_rebuilds: int = 8) -> LocalCluster:
    # A dropped frame is noticed by its timeout: 1.5 s, not the 30 s default, as the drop and reorder runs meet
    # several (a tiny frame takes milliseconds, so a late reply under load is not mistaken for a lost one).
    # One micro-batch per stage, never one alone (--alone-max-requests 0): alone, all 12 requests ride one frame,
    # so every seeded drop hits all of them, rebuild frames included, and which frames the seed hits follows
    # the machine's speed (on a slow hour every request spent its rebuild budget: exact 0 of 12, at 381ea03's
    # successor ab3e02f too). The figures below were measured with two micro-batches in flight.
    extra = {"coordinator": ["--frame-timeout", "1.5", "--max-rebuilds", str(max_rebuilds), "--alone-max-requests",
                             "0"], "stage": []}
    if stage_faults:
        extra["stage"] += ["--faults", stage_faults]
    if coordinator_faults:
        extra["coordinator"] += ["--faults", coordinator_faults]
    if unsafe:
        extra["stage"].append("--unsafe-disable-stamp-checks")
        extra["coordinator"].append("--unsafe-disable-stamp-checks")
    return LocalCluster(model="tiny", stages=stages, threads=1, log_dir=tmp_path, extra=extra)


def _chaos(tmp_path, stages: int, **options) -> Outcome:
    """Start a cluster with these faults (and options), send CASES, read Stats and the ledger, stop it."""
    cluster = _cluster(tmp_path, stages, **options).start(timeout=180)
    try:
        return _collect(cluster, stages, tmp_path, _run(cluster.target))
    finally:
        cluster.stop()


def _assert_every_harmful_fault_caught(o: Outcome) -> None:
    """The ledger's account, asserted before any wrong answer is counted: a wrong answer is explained by the
    fault that slipped through (the one that caused it), not only counted."""
    slipped = o.ledger.slipped_unexcused(o.completed_ids)
    assert not slipped, f"{len(slipped)} faulted slot(s) the coordinator went on with:\n" + "\n".join(slipped[:8])
    uncaught = o.ledger.uncaught(o.completed_ids)
    assert not uncaught, f"harmful faults never acted on: {uncaught}"
    # the ledger is the injectors' own account: one line per fault counted in Stats, and it names this run's ids
    assert o.ledger.by_kind() == +Counter({k: n for k, n in o.injected.items() if k not in ("delay", "crash")}), \
        (o.ledger.by_kind(), o.injected)
    # a completed request that a caught fault hit was rebuilt or resumed: the coordinator counts it recovered
    hit = {slot[0] for f in o.ledger.harmful() for slot, fate in f["slots"].items() if fate == "caught"}
    assert len(hit & o.completed_ids) <= o.coordinator.recovered <= len(o.completed_ids), o.summary()
    if o.completed_ids and o.ledger.faults:   # stamps carry the receipts' internal ids: the match means something
        assert o.ledger.slot_ids() & o.completed_ids, (o.ledger.slot_ids(), o.completed_ids)


# A lost or reordered frame also fails the next frame on that hop (BAD_SEQUENCE) and costs its requests a
# replay, so those kinds run at a lower rate: enough to fire several times, not so much that every request
# exhausts its rebuild budget.
RATES = {"drop": 0.05, "reorder": 0.05}
# Exact completions of the 12 required per kind (seeded, but batching follows the load: measured 12/12 for
# duplicate, reorder, delay, corrupt, cross_ids and forget_kv, 11 once for corrupt; drop 7-9, swap_slots 8-9,
# whose every fault fails a whole frame, the rest ABORTED on their rebuild budget). A harmless kind must leave
# every request exact, a recoverable one most of them; each failure must be explicit.
MIN_EXACT = {"drop": 6, "swap_slots": 6, "delay": 12, "duplicate": 12}
MIN_EXACT_DEFAULT = 9


@pytest.mark.parametrize("kind", ["drop", "duplicate", "reorder", "delay", "corrupt", "swap_slots", "cross_ids",
                                  "forget_kv"])
def test_each_stage_fault_kind_is_caught_and_never_delivers_a_wrong_token(tmp_path, kind):
    o = _chaos(tmp_path, 2, stage_faults=f"{kind}={RATES.get(kind, 0.15)},seed=11,delay_ms=30")
    print(kind, o.summary())
    _assert_every_harmful_fault_caught(o)   # first: a wrong answer's cause is the fault that slipped through
    assert o.wrong == 0, o.summary()
    assert o.injected[kind] > 0, f"{kind} was never injected: the test proves nothing"
    assert o.exact >= MIN_EXACT.get(kind, MIN_EXACT_DEFAULT), o.summary()
    if kind in FOLLOWED:
        harmful = Counter(f["kind"] for f in o.ledger.harmful())
        assert harmful[kind] > 0 and o.ledger.caught_by_kind(o.completed_ids)[kind] == harmful[kind], o.summary()
        # a request hit by a caught fault was replayed: the ones that still completed count as recovered
        assert o.coordinator.rebuilds + o.coordinator.resumes > 0 and o.coordinator.recovered > 0, o.summary()
    if kind == "duplicate":
        # every copy is refused by the next stage's sequence check, slot by slot, and nothing else is
        copies = sum(len(f["slots"]) for f in o.ledger.faults.values() if f["kind"] == "duplicate")
        assert o.stage_rejections[1] == Counter(BAD_SEQUENCE=copies), o.summary()
    if kind == "delay":
        assert sum(sum(r.values()) for r in o.stage_rejections) == 0 and o.coordinator.rebuilds == 0, o.summary()


def test_coordinator_side_faults(tmp_path):
    # 30% of frames faulted: the 30-token requests meet ~9 faulted frames, so at the default budget (8) whether 3 or
    # 4 of the 12 exhaust it depends on the machine's timing (how requests share frames), and exact read 8-12
    # over runs. This test is about detection and recovery; exhausting the budget is test_recovery_statuses'.
    o = _chaos(tmp_path, 2, coordinator_faults="drop=0.05,duplicate=0.05,reorder=0.05,corrupt=0.05,"
                                               "cross_ids=0.05,swap_slots=0.05,seed=5", max_rebuilds=16)
    print("coordinator side", o.summary())
    _assert_every_harmful_fault_caught(o)
    assert o.wrong == 0, o.summary()
    assert o.exact >= 9, o.summary()
    assert sum(o.injected[k] for k in HARMFUL) > 0
    assert len(o.ledger.harmful()) >= 3 and o.coordinator.recovered > 0, o.summary()
    assert all(f["hook"] == "outbound" for f in o.ledger.faults.values())


def test_every_fault_at_once_through_three_stages(tmp_path):
    o = _chaos(tmp_path, 3, stage_faults="drop=0.03,duplicate=0.03,reorder=0.03,delay=0.05,corrupt=0.03,"
                                         "swap_slots=0.03,cross_ids=0.03,forget_kv=0.03,seed=3,delay_ms=20")
    print("all at once", o.summary())
    _assert_every_harmful_fault_caught(o)
    assert o.wrong == 0, o.summary()
    assert o.exact >= 6, o.summary()   # half; measured 7-9 of 12 over 7 runs (the rest ABORTED: rebuild budget)
    assert len({f["kind"] for f in o.ledger.harmful()}) >= 3, o.summary()
    assert o.coordinator.recovered > 0, o.summary()


def test_with_stamp_checks_off_the_same_faults_deliver_wrong_answers(tmp_path):
    """The 答非所问 failure reproduced: the experiment-only switch turns every check off, and the faults that
    the checked cluster survives with zero wrong tokens now change answers silently: the ledger sees the
    coordinator go on past the faulted slots."""
    o = _chaos(tmp_path, 2, stage_faults="forget_kv=0.15,swap_slots=0.15,seed=11", unsafe=True)
    print("unchecked", o.summary())
    assert o.injected["forget_kv"] + o.injected["swap_slots"] > 0
    assert o.wrong >= UNCHECKED_MIN_WRONG, f"unchecked faults should corrupt answers: {o.summary()}"
    assert sum(sum(r.values()) for r in o.stage_rejections) == 0 and not o.coordinator.rejections
    assert o.ledger.slipped, "with the checks off, faulted slots must be seen going through"


UNCHECKED_MIN_WRONG = 8   # of 12, as docs/PROTOCOL.md "Fault injection" states (measured 10, 11, 12)


def test_a_crashing_stage_is_restarted_and_no_wrong_token_is_delivered(tmp_path):
    """`crash`: a stage exits (137) at a drawn frame. Restarted from this thread (the one that spawned it: a
    child dies with the thread that started it, tether/procutil.py) with the next seed, as a restart policy
    would, it is re-admitted by the handshake; the coordinator syncs and rebuilds what the dead stage held."""
    spec = "crash={rate},seed={seed}"
    cluster = _cluster(tmp_path, 2, stage_faults=spec.format(rate=CRASH_RATE, seed=11)).start(timeout=180)
    result: dict = {}

    def send() -> None:
        try:
            result["run"] = _run(cluster.target)
        except BaseException as e:   # noqa: BLE001 - re-raised below, in the test's thread
            result["error"] = e

    client = threading.Thread(target=send, daemon=True)
    exits: list[tuple[str, int]] = []
    try:
        client.start()
        while client.is_alive():
            client.join(0.2)
            for svc in cluster.services:
                if svc.name.startswith("stage") and svc.proc.poll() is not None:
                    exits.append((svc.name, svc.proc.returncode))
                    svc.argv[svc.argv.index("--faults") + 1] = spec.format(rate=CRASH_RATE, seed=11 + len(exits))
                    cluster.restart(svc.name)
        if "error" in result:
            raise result["error"]
        o = _collect(cluster, 2, tmp_path, result["run"])
    finally:
        cluster.stop()
    print("crash", exits, o.summary())
    assert exits and all(code == 137 for _, code in exits), exits
    assert o.wrong == 0, o.summary()
    assert o.exact >= 9, o.summary()
    assert o.coordinator.pipeline_reconnects >= 1 and o.coordinator.recovered > 0, o.summary()


CRASH_RATE = 0.01
