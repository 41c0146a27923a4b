"""What the soak watches besides the answers: every service's resident memory over the run, and whether the
stages and the coordinator hold nothing once the load is gone."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from tether.loadtest.cluster_stats import proc_rss_kib
from tether.loadtest.stats import median
from tether.grpcutil import channel
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc

STATS_TIMEOUT_S = 2.0
DRAIN_POLL_S = 0.5


@dataclass
class RssSampler:
    """Samples every process's RSS every `interval_s` from `start()` until `stop()`."""

    pids: dict[str, int]
    interval_s: float
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)   # name -> [(t, KiB)]
    exited: set[str] = field(default_factory=set)
    _task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def sample(self) -> None:
        now = time.monotonic()
        for name, pid in self.pids.items():
            kib = proc_rss_kib(pid)
            if kib is None:
                self.exited.add(name)
            else:
                self.samples.setdefault(name, []).append((now, kib))

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def flatness(self, t0: float, t1: float, warmup_s: float) -> dict[str, dict]:
        """Per process, in MiB: RSS at the start (the first sample, before the load), after the warm-up (`warmup_s`
        of load; a third of [t0, t1] when the run is shorter than two warm-ups), at the end, and the peak after
        the warm-up; `growth` is that peak against the warm-up figure. Each figure but the start is a median of
        three samples in a row, so one sample taken mid-allocation does not decide it."""
        warm_at = t0 + (warmup_s if t1 - t0 >= 2 * warmup_s else (t1 - t0) / 3)
        out = {}
        for name, series in self.samples.items():
            after = [kib for t, kib in series if warm_at <= t <= t1]
            smooth = [median(after[i:i + 3]) for i in range(max(0, len(after) - 2))]
            if not series or len(smooth) < 2:
                out[name] = dict(samples=len(series), start_mib=None, warm_mib=None, end_mib=None, peak_mib=None,
                                 growth=None)
                continue
            warm, end, peak = smooth[0] / 1024, smooth[-1] / 1024, max(smooth) / 1024
            out[name] = dict(samples=len(series), start_mib=round(series[0][1] / 1024, 1), warm_mib=round(warm, 1),
                             end_mib=round(end, 1), peak_mib=round(peak, 1), growth=round(peak / warm - 1, 4))
        return out


async def stage_stats(address: str) -> dict:
    async with channel(address) as ch:
        s = await stage_pb2_grpc.StageStub(ch).Stats(stage_pb2.StageStatsRequest(), timeout=STATS_TIMEOUT_S)
    return dict(requests_held=s.requests_held, kv_used_tokens=s.kv_used_tokens,
                kv_capacity_tokens=s.kv_capacity_tokens, forward_streams=s.forward_streams,
                rejections=dict(s.rejections))


async def coordinator_stats(address: str) -> dict:
    async with channel(address) as ch:
        s = await coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(),
                                                                  timeout=STATS_TIMEOUT_S)
    return dict(running=s.running, waiting=s.waiting, requests_finished=s.requests_finished,
                requests_failed=s.requests_failed, tokens_generated=s.tokens_generated,
                slots_rejected=s.slots_rejected, rebuilds=s.rebuilds, resumes=s.resumes,
                rejections=dict(s.rejections))


def _drained(state: dict) -> bool:
    stages_empty = all(isinstance(s, dict) and s["requests_held"] == 0 and s["kv_used_tokens"] == 0
                       for s in state["stages"].values())
    c = state.get("coordinator")
    return stages_empty and (c is None or (isinstance(c, dict) and c["running"] == 0 and c["waiting"] == 0))


async def service_state(stages: dict[str, str], coordinator: str | None) -> dict:
    """Every stage's (and the coordinator's) Stats now; an unreachable service is reported by its error."""
    async def ask(fn, address: str) -> dict | str:
        try:
            return await fn(address)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"

    state: dict = dict(stages={name: await ask(stage_stats, a) for name, a in stages.items()})
    if coordinator:
        state["coordinator"] = await ask(coordinator_stats, coordinator)
    return state


async def wait_drained(stages: dict[str, str], coordinator: str | None, timeout_s: float) -> tuple[bool, float, dict]:
    """Poll until no stage holds a request or KV token and the coordinator runs and queues nothing, at most
    `timeout_s` (cancelled requests are released at once; nothing should wait for the KV lease).
    Returns (drained, seconds waited, the last state)."""
    start = time.monotonic()
    while True:
        state = await service_state(stages, coordinator)
        if _drained(state) or time.monotonic() - start >= timeout_s:
            return _drained(state), round(time.monotonic() - start, 2), state
        await asyncio.sleep(DRAIN_POLL_S)
