"""`tether up`'s start-up under a supervisor, with real processes: a child that came up and then died while the
rest still start is restarted like any later crash (the start goes on and the cluster serves exactly); only a
child that never came up fails the start."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tether import reference
from tether.cli.cluster import LocalCluster
from tether.cli.supervisor import RestartPolicy, Supervisor
from tether.client import Client


class KillOnceUp:
    """The launcher's supervisor, with a fault: the first time `victim` has come up while admission is not
    SERVING yet (the other pipeline still starting), it is SIGKILLed."""

    def __init__(self, cluster: LocalCluster, victim: str, supervisor: Supervisor) -> None:
        self.cluster, self.victim, self.supervisor = cluster, victim, supervisor
        self.killed_pid: int | None = None

    def poll(self, now: float) -> None:
        svc = self.cluster.service(self.victim)
        if self.killed_pid is None and svc.came_up:
            self.killed_pid = svc.proc.pid
            os.kill(svc.proc.pid, signal.SIGKILL)
            svc.proc.wait(timeout=10)
        self.supervisor.poll(now)


def test_a_child_killed_after_it_came_up_is_restarted_and_the_start_goes_on(tmp_path):
    said: list[str] = []
    c = LocalCluster(model="tiny", stages=1, pipelines=2, threads=1, log_dir=tmp_path).launch()
    try:
        sup = Supervisor(c, RestartPolicy(backoff_base_s=0.1), now=0.0, say=said.append)
        fault = KillOnceUp(c, "coordinator", sup)
        c.wait_ready(180, supervisor=fault)             # no "exited with -9 during start-up"
        assert fault.killed_pid is not None
        deadline = time.monotonic() + 30
        while sup.restarts == 0:                       # the launcher keeps polling after the start
            assert time.monotonic() < deadline, said
            sup.poll(time.monotonic())
            time.sleep(0.1)
        assert c.service("coordinator").proc.pid != fault.killed_pid
        assert any("coordinator exited with -9; restarting" in m for m in said), said
        ref = reference.generate("The capital of France is", max_tokens=6, ignore_eos=True)
        with Client(c.target, timeout=60) as client:
            got = client.generate("The capital of France is", max_tokens=6, ignore_eos=True)
        assert got.token_ids == ref.token_ids
    finally:
        c.stop()


def test_a_child_that_never_came_up_fails_the_start(tmp_path):
    c = LocalCluster(model="tiny", stages=1, threads=1, log_dir=tmp_path, extra={"stage": ["--no-such-flag"]})
    sup = Supervisor(c, RestartPolicy(), now=0.0, say=lambda _: None)
    try:
        with pytest.raises(RuntimeError, match="stage0 exited with 2 during start-up"):
            c.start(timeout=60, supervisor=sup)
        assert sup.restarts == 0                       # restarting would fail the same way
    finally:
        c.stop()
