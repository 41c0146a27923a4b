"""The restart policy of `tether up` as pure logic (a fake clock, no processes), and the Supervisor driving it
against a fake cluster."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

import pytest

from tether import settings
from tether.cli.supervisor import CrashHistory, GaveUp, RestartPolicy, RollingRestart, Supervisor
from tether.ports import EXIT_PORT_IN_USE

POLICY = RestartPolicy(backoff_base_s=0.5, backoff_cap_s=10.0, stable_s=30.0, max_restarts=5, window_s=60.0)


def _crash_loop(policy: RestartPolicy, uptime: float, n: int) -> list:
    """n crashes, each `uptime` s after the restart the previous one scheduled; the decisions in order."""
    h = CrashHistory(policy, started_at=0.0)
    now, out = 0.0, []
    for _ in range(n):
        now += uptime
        d = h.crashed(now)
        out.append(d)
        if d.give_up:
            break
        now += d.restart_in
        h.started(now)
    return out


def test_defaults_come_from_settings():
    p = RestartPolicy()
    assert (p.backoff_base_s, p.backoff_cap_s, p.stable_s, p.max_restarts, p.window_s) == (
        settings.SUPERVISE_BACKOFF_BASE_S, settings.SUPERVISE_BACKOFF_CAP_S, settings.SUPERVISE_STABLE_S,
        settings.SUPERVISE_MAX_RESTARTS, settings.SUPERVISE_WINDOW_S)


def test_backoff_doubles_from_the_base():
    decisions = _crash_loop(POLICY, uptime=0.1, n=5)
    assert [d.restart_in for d in decisions] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert [d.crashes for d in decisions] == [1, 2, 3, 4, 5]


def test_backoff_is_capped():
    policy = RestartPolicy(backoff_base_s=0.5, backoff_cap_s=10.0, stable_s=1e9, max_restarts=100, window_s=1.0)
    delays = [d.restart_in for d in _crash_loop(policy, uptime=2.0, n=12)]   # window 1 s: never gives up
    assert delays[:6] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert set(delays[5:]) == {10.0}
    assert policy.backoff(10_000) == 10.0   # no overflow for absurd streaks


def test_backoff_resets_after_a_stable_run():
    h = CrashHistory(POLICY, started_at=0.0)
    assert h.crashed(1.0).restart_in == 0.5
    h.started(1.5)
    assert h.crashed(2.0).restart_in == 1.0
    h.started(3.0)
    assert h.crashed(3.0 + POLICY.stable_s - 0.01).restart_in == 2.0    # just short of stable: keeps doubling
    h.started(40.0)
    assert h.crashed(40.0 + POLICY.stable_s).restart_in == 0.5          # stayed up long enough: base again
    h.started(71.0)
    assert h.crashed(72.0).restart_in == 1.0                            # and doubles again from there


def test_gives_up_after_more_than_max_restarts_within_the_window():
    decisions = _crash_loop(POLICY, uptime=0.1, n=10)
    assert [d.give_up for d in decisions] == [False] * 5 + [True]
    assert decisions[-1].crashes == 6 and decisions[-1].restart_in is None


def test_the_window_slides():
    h = CrashHistory(POLICY, started_at=0.0)
    for t in (0.0, 10.0, 20.0, 30.0, 40.0):       # 5 crashes: the most the window tolerates
        assert not h.crashed(t).give_up
    d = h.crashed(60.0)                            # the crash at 0 s has left the window (60 s is not < 60)
    assert not d.give_up and d.crashes == 5
    d = h.crashed(65.0)                            # 10..65: six crashes within 60 s
    assert d.give_up and d.crashes == 6


def test_a_slow_crash_loop_never_gives_up_but_a_fast_one_does():
    slow = _crash_loop(POLICY, uptime=POLICY.window_s / POLICY.max_restarts + 1, n=50)
    assert not any(d.give_up for d in slow)
    assert _crash_loop(POLICY, uptime=1.0, n=50)[-1].give_up


def test_zero_restarts_gives_up_at_the_first_crash():
    assert CrashHistory(RestartPolicy(max_restarts=0), started_at=0.0).crashed(100.0).give_up


# --------------------------------------------------------------------------------------------- Supervisor

@dataclass
class FakeProc:
    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class FakeService:
    name: str
    proc: FakeProc
    log: str = ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.splitlines()[-lines:])

    def exit_reason(self, code: int | None) -> str | None:
        return f"{self.name}: port 7 is in use" if code == EXIT_PORT_IN_USE else None


@dataclass
class FakeCluster:
    services: list[FakeService]
    restarted: list[str] = field(default_factory=list)
    next_pid: int = 1000

    def service(self, name: str) -> FakeService:
        return next(s for s in self.services if s.name == name)

    def restart(self, name: str) -> None:
        self.restarted.append(name)
        self.next_pid += 1
        self.service(name).proc = FakeProc(self.next_pid)


def _cluster() -> FakeCluster:
    return FakeCluster([FakeService("stage0", FakeProc(1)), FakeService("stage1", FakeProc(2),
                                                                         log="a\nb\nstage1 last words"),
                        FakeService("coordinator", FakeProc(3)), FakeService("admission", FakeProc(4))])


def test_supervisor_restarts_a_dead_child_after_the_backoff():
    cluster, said = _cluster(), []
    sup = Supervisor(cluster, POLICY, now=0.0, say=said.append)
    sup.poll(1.0)
    assert said == [] and cluster.restarted == []
    cluster.service("stage1").proc.returncode = -9
    sup.poll(2.0)
    assert said == ["stage1 exited with -9; restarting in 0.5 s (crash 1 of 5 in 60 s)"]
    assert cluster.restarted == []                 # not before the backoff has passed
    sup.poll(2.4)
    assert cluster.restarted == []
    sup.poll(2.5)
    assert cluster.restarted == ["stage1"]
    assert said[-1] == "stage1 restarted (pid 1001)"
    sup.poll(3.0)
    assert cluster.restarted == ["stage1"] and len(said) == 2   # the new process is alive: nothing to do
    # a second quick crash doubles the delay; other services are untouched
    cluster.service("stage1").proc.returncode = 1
    sup.poll(4.0)
    assert said[-1] == "stage1 exited with 1; restarting in 1 s (crash 2 of 5 in 60 s)"
    sup.poll(5.0)
    assert cluster.restarted == ["stage1", "stage1"] and sup.restarts == 2


def test_supervisor_gives_up_naming_the_service_exit_code_and_log():
    cluster = _cluster()
    sup = Supervisor(cluster, RestartPolicy(max_restarts=1, window_s=60.0), now=0.0, say=lambda _: None)
    cluster.service("stage1").proc.returncode = -9
    sup.poll(1.0)
    sup.poll(2.0)
    assert cluster.restarted == ["stage1"]
    cluster.service("stage1").proc.returncode = -9
    with pytest.raises(GaveUp) as info:
        sup.poll(3.0)
    msg = str(info.value)
    assert info.value.name == "stage1" and info.value.returncode == -9
    assert "stage1 exited with -9" in msg and "giving up" in msg and "2 crashes within 60 s" in msg
    assert "stage1 last words" in msg


def test_supervisor_without_restarts_stops_at_the_first_death():
    cluster = _cluster()
    sup = Supervisor(cluster, RestartPolicy(max_restarts=0), now=0.0, say=lambda _: None)
    cluster.service("coordinator").proc.returncode = 0
    with pytest.raises(GaveUp, match="coordinator exited with 0; restarts are off"):
        sup.poll(1.0)
    assert cluster.restarted == []


def test_a_rolling_restart_drains_one_coordinator_at_a_time_and_is_never_a_crash():
    class SignalledProc(FakeProc):
        def send_signal(self, sig: int) -> None:
            self.signal = sig

    cluster = FakeCluster([FakeService("stage0", FakeProc(1)), FakeService("coordinator", SignalledProc(2)),
                           FakeService("p1-coordinator", SignalledProc(3)), FakeService("admission", FakeProc(4))])
    serving: set[str] = set()
    sup = Supervisor(cluster, POLICY, now=0.0, say=lambda _: None)
    rolling = RollingRestart(cluster, sup, lambda name: name in serving, say=lambda _: None)
    rolling.poll(1.0)
    first = cluster.service("coordinator").proc
    assert first.signal == signal.SIGTERM and rolling.current == "coordinator"
    assert not hasattr(cluster.service("p1-coordinator").proc, "signal")   # one at a time
    first.returncode = 0                                                     # drained and exited
    sup.poll(1.1)
    assert sup.due == {} and sup.restarts == 0                               # not a crash
    rolling.poll(1.2)
    assert cluster.restarted == ["coordinator"] and rolling.current == "coordinator"
    rolling.poll(1.3)
    assert rolling.current == "coordinator"                                  # not serving yet: wait
    serving.add("coordinator")
    rolling.poll(1.4)
    rolling.poll(1.5)
    assert rolling.current == "p1-coordinator" and cluster.service("p1-coordinator").proc.signal == signal.SIGTERM
    cluster.service("p1-coordinator").proc.returncode = 0
    rolling.poll(1.6)
    serving.add("p1-coordinator")
    rolling.poll(1.7)
    assert rolling.done and cluster.restarted == ["coordinator", "p1-coordinator"] and not sup.exempt


def test_a_child_whose_port_is_taken_is_not_restarted():
    """Exit EXIT_PORT_IN_USE: restarting would fail the same way, so the supervisor gives up at once, with the
    child's one line and no log tail, however many restarts the policy allows."""
    stage = FakeService("stage0", FakeProc(1), log="a traceback\nthat nobody needs")
    cluster = FakeCluster([stage])
    sup = Supervisor(cluster, RestartPolicy(max_restarts=5), now=0.0, say=lambda _: None)
    stage.proc.returncode = EXIT_PORT_IN_USE
    with pytest.raises(GaveUp) as info:
        sup.poll(1.0)
    assert str(info.value) == "stage0: port 7 is in use" and info.value.returncode == EXIT_PORT_IN_USE
    assert cluster.restarted == [] and sup.restarts == 0
