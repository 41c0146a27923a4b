"""What `tether up` does when a child dies: restart it like a container restart policy, or give up.

`RestartPolicy` and `CrashHistory` are pure logic: given crash times and a clock they answer "restart after
X s" or "give up". Backoff doubles from `backoff_base_s` to `backoff_cap_s` over consecutive crashes and
resets once a child has stayed up `stable_s`; more than `max_restarts` crashes of one child within a sliding
`window_s` give up (a crash loop is a bug to fix, not something to retry forever).

`Supervisor` applies the policy to a running `LocalCluster` (any object with `services` and `restart(name)`):
`poll(now)` notices dead children, schedules their restarts and respawns them once due, with the same command
and ports, so the coordinator's re-handshake finds the stage where it was and replays in-flight requests.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tether import settings
from tether.procutil import Proc


@dataclass(frozen=True)
class RestartPolicy:
    backoff_base_s: float = settings.SUPERVISE_BACKOFF_BASE_S
    backoff_cap_s: float = settings.SUPERVISE_BACKOFF_CAP_S
    stable_s: float = settings.SUPERVISE_STABLE_S        # up this long: the next crash starts the backoff over
    max_restarts: int = settings.SUPERVISE_MAX_RESTARTS   # per child within window_s; 0: never restart
    window_s: float = settings.SUPERVISE_WINDOW_S

    def backoff(self, streak: int) -> float:
        """Delay before restart number `streak` + 1 of an unbroken run of quick crashes."""
        return min(self.backoff_cap_s, self.backoff_base_s * 2 ** min(streak, 64))   # min: no float overflow

    def describe(self) -> str:
        if self.max_restarts == 0:
            return "a child that exits stops the whole cluster (restarts are off)"
        return (f"a child that exits is restarted with the same command and ports after {self.backoff_base_s:g} s, "
                f"doubling per quick crash up to {self.backoff_cap_s:g} s, back to {self.backoff_base_s:g} s once it "
                f"has stayed up {self.stable_s:g} s; more than {self.max_restarts} crash(es) of one child within "
                f"{self.window_s:g} s stop the whole cluster")


@dataclass(frozen=True)
class Decision:
    restart_in: float | None   # seconds to wait before the restart; None: give up
    crashes: int               # crashes of this child within the window, this one included

    @property
    def give_up(self) -> bool:
        return self.restart_in is None


@dataclass
class CrashHistory:
    """One child's crashes; `started(now)` at every (re)spawn, `crashed(now)` when it is found dead."""
    policy: RestartPolicy
    started_at: float
    streak: int = 0                                   # consecutive crashes without a stable run in between
    crash_times: list[float] = field(default_factory=list)

    def started(self, now: float) -> None:
        self.started_at = now

    def crashed(self, now: float) -> Decision:
        if now - self.started_at >= self.policy.stable_s:
            self.streak = 0
        # sliding window: only crashes within the last window_s count towards giving up
        self.crash_times = [t for t in self.crash_times if now - t < self.policy.window_s] + [now]
        crashes = len(self.crash_times)
        if crashes > self.policy.max_restarts:
            return Decision(None, crashes)
        delay = self.policy.backoff(self.streak)
        self.streak += 1
        return Decision(delay, crashes)


class GaveUp(Exception):
    """A child crashed more often than the policy allows; the message names it, its exit code and log tail."""

    def __init__(self, message: str, name: str, returncode: int) -> None:
        super().__init__(message)
        self.name = name
        self.returncode = returncode


class _Service(Protocol):
    name: str
    proc: Proc | None

    def log_tail(self, lines: int = 30) -> str: ...

    def exit_reason(self, code: int | None) -> str | None: ...


class _Cluster(Protocol):
    services: list

    def restart(self, name: str) -> None: ...


class Supervisor:
    """Restarts dead children of `cluster` per `policy`; `poll(now)` raises GaveUp when it must stop."""

    def __init__(self, cluster: _Cluster, policy: RestartPolicy, now: float,
                 say: Callable[[str], None] = print, log_lines: int = 20) -> None:
        self.cluster = cluster
        self.policy = policy
        self.say = say
        self.log_lines = log_lines
        # per child, from its first poll: the supervisor may start before the cluster has built its children
        self.history: dict[str, CrashHistory] = {}
        self.started_at = now
        self.due: dict[str, float] = {}   # name -> when its restart is due (dead, waiting out the backoff)
        self.restarts = 0
        self.exempt: set[str] = set()    # children being restarted on purpose (RollingRestart): not crashes

    def poll(self, now: float) -> None:
        for svc in self.cluster.services:
            if svc.proc is None or svc.name in self.exempt:   # not spawned yet, or restarted on purpose
                continue
            if svc.name not in self.history:
                self.history[svc.name] = CrashHistory(self.policy, max(now, self.started_at))
            if svc.name in self.due:
                if now >= self.due[svc.name]:
                    del self.due[svc.name]
                    self.cluster.restart(svc.name)
                    self.history[svc.name].started(now)
                    self.restarts += 1
                    self.say(f"{svc.name} restarted (pid {svc.proc.pid})")
                continue
            code = svc.proc.poll()
            if code is None:
                continue
            reason = svc.exit_reason(code)
            if reason is not None:   # e.g. its port was taken while it was down: a restart would fail the same way
                raise GaveUp(reason, svc.name, code)
            # Any exit counts, 0 included: under `tether up` only the launcher stops children, so a child that
            # left on its own took part of the pipeline with it (compose's `unless-stopped`, not `on-failure`).
            decision = self.history[svc.name].crashed(now)
            if decision.restart_in is None:   # give_up
                raise GaveUp(self._give_up_message(svc, code, decision), svc.name, code)
            self.due[svc.name] = now + decision.restart_in
            self.say(f"{svc.name} exited with {code}; restarting in {decision.restart_in:g} s "
                     f"(crash {decision.crashes} of {self.policy.max_restarts} in {self.policy.window_s:g} s)")

    def _give_up_message(self, svc: _Service, code: int, decision: Decision) -> str:
        if self.policy.max_restarts == 0:
            msg = f"{svc.name} exited with {code}; restarts are off: stopping the cluster"
        else:
            msg = (f"{svc.name} exited with {code}: {decision.crashes} crashes within {self.policy.window_s:g} s, "
                   f"more than the {self.policy.max_restarts} restart(s) allowed; giving up and stopping the cluster")
        tail = svc.log_tail(self.log_lines)
        if tail:
            msg += f"\n--- last lines of {svc.name}'s log ---\n{tail}"
        return msg


class _Rolling(Protocol):
    services: list

    def service(self, name: str) -> Any: ...
    def restart(self, name: str) -> None: ...


class RollingRestart:
    """Restart the coordinators one after another without failing a request: each is drained first (SIGTERM:
    it takes no new request, finishes what ends within its --drain-seconds and hands the rest back to admission,
    which continues them on another pipeline), respawned once it has exited, and the next one is only started
    once this one serves again (`serving(name)`). Driven by `poll(now)` from the launcher's loop (the spawning
    thread), alongside the Supervisor, which does not count these exits as crashes."""

    def __init__(self, cluster: _Rolling, supervisor: Supervisor, serving: Callable[[str], bool],
                 say: Callable[[str], None] = print) -> None:
        self.cluster, self.supervisor, self.serving, self.say = cluster, supervisor, serving, say
        self.pending = [s.name for s in cluster.services if s.name.endswith("coordinator")]
        self.current: str | None = None
        self.step = ""                   # "draining" (SIGTERM sent) or "starting" (respawned)

    @property
    def done(self) -> bool:
        return self.current is None and not self.pending

    def poll(self, now: float) -> None:
        if self.current is None:
            if not self.pending:
                return
            self.current, self.step = self.pending.pop(0), "draining"
            self.supervisor.exempt.add(self.current)
            svc = self.cluster.service(self.current)
            self.say(f"rolling restart: draining {self.current} (pid {svc.proc.pid})")
            svc.proc.send_signal(signal.SIGTERM)
            return
        svc = self.cluster.service(self.current)
        if self.step == "draining" and svc.proc.poll() is not None:
            self.say(f"rolling restart: {self.current} drained (exit {svc.proc.returncode}); starting it again")
            self.cluster.restart(self.current)
            self.step = "starting"
        elif self.step == "starting" and self.serving(self.current):
            self.say(f"rolling restart: {self.current} serves again (pid {svc.proc.pid})")
            self.supervisor.exempt.discard(self.current)
            self.supervisor.history.pop(self.current, None)   # a fresh start, not a crash streak
            self.current = None
