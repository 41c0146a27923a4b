"""No leaks: after a storm of cancels, expired deadlines, a killed stage and a killed coordinator, every stage
holds zero requests and zero KV once the work is done, without waiting for the stages' leases (300 s)."""

from __future__ import annotations

import asyncio
import time

import grpc

from tests.helpers import coordinator_running, stage_state
from tether import reference
from tether.cli.cluster import LocalCluster
from tether.client import AsyncClient, TetherError

EXPLICIT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED}


def _wait_drained(cluster: LocalCluster, timeout: float = 30.0) -> None:
    """Every stage reports nothing held (a restarted stage may still be starting: keep asking)."""
    deadline = time.monotonic() + timeout
    state: object = None
    while True:
        try:
            state = stage_state(cluster)
            if state == [(0, 0)] * (len(cluster.services) - 2):
                break
        except grpc.RpcError as e:
            state = e.code()
        assert time.monotonic() < deadline, f"stages still hold (requests, KV tokens): {state}"
        time.sleep(0.2)
    assert coordinator_running(cluster) == (0, 0)


async def _one(target: str, prompt: str, max_tokens: int, mode: str, started: asyncio.Event,
               timeout: float) -> str:
    """Run one request; return how it ended: exact, cancelled or the status code's name."""
    async with AsyncClient(target, timeout=timeout, retry=None) as client:
        return await _run(client, prompt, max_tokens, mode, started)


async def _run(client: AsyncClient, prompt: str, max_tokens: int, mode: str, started: asyncio.Event) -> str:
    stream = client.stream(prompt, max_tokens=max_tokens, ignore_eos=True)
    got: list[int] = []
    try:
        async for d in stream:
            got.append(d.token_id)
            started.set()
            if mode == "cancel" and len(got) == 2:
                stream.cancel()
                want = reference.generate(prompt, "tiny", max_tokens=max_tokens, ignore_eos=True).token_ids
                assert got == want[:2]
                return "cancelled"
    except TetherError as e:
        assert e.code in EXPLICIT, (e.code, e.message)
        return e.code.name
    want = reference.generate(prompt, "tiny", max_tokens=max_tokens, ignore_eos=True).token_ids
    assert got == want, prompt
    return "exact"


def test_storm_of_cancels_deadlines_and_kills_leaks_nothing(tmp_path):
    cluster = LocalCluster(model="tiny", stages=2, threads=1, log_dir=tmp_path).start(timeout=180)
    try:
        async def storm(kill: str) -> list[str]:
            started = asyncio.Event()
            # every 5th request has a deadline too short to finish; every 3rd is cancelled after 2 tokens
            tasks = [asyncio.create_task(_one(cluster.target, f"storm {kill} {i} " + "x" * (i * 7), 48 + i,
                                              "cancel" if i % 3 == 0 else "run", started,
                                              timeout=0.4 if i % 5 == 4 else 120))
                     for i in range(15)]
            await asyncio.wait_for(started.wait(), 120)
            # In this thread, not a worker thread: children are tied to the thread that spawned them
            # (tether/procutil.py), and a pool thread exits when asyncio.run ends.
            cluster.kill(kill)
            cluster.restart(kill)
            return await asyncio.gather(*tasks)

        outcomes = asyncio.run(storm("stage1"))
        assert outcomes.count("cancelled") >= 1 and "DEADLINE_EXCEEDED" in outcomes
        assert outcomes.count("exact") >= 3, outcomes          # a killed stage is recovered, not given up
        cluster.wait_ready(120)
        _wait_drained(cluster)

        outcomes = asyncio.run(storm("coordinator"))           # its requests fail; its state is orphaned
        assert set(outcomes) <= {"exact", "cancelled", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"}
        cluster.wait_ready(120)                                # the new coordinator's handshake frees it
        _wait_drained(cluster)
    finally:
        cluster.stop()
