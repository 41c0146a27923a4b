"""The coordinator's driver loop under supervision, against an in-process fake pipeline (labelled as such):
an unexpected error fails the active requests explicitly, frees their state, reports NOT_SERVING and the loop
comes back; a reject reason this build does not know is a rebuild, not a crash."""

from __future__ import annotations

import asyncio

import grpc

from services.coordinator.driver import Driver, Failure
from services.stage_worker.worker import echo
from tether import supervise
from tether.v1 import stage_pb2


def test_an_unexpected_error_fails_requests_explicitly_frees_state_and_the_loop_comes_back(kit):
    health: list[bool] = []

    async def on_serving(serving: bool) -> None:
        health.append(serving)

    def answer(conn, seq, slots):
        return RuntimeError("a peer answered outside the contract") if conn == 1 else None

    async def go():
        pipe = kit.FakePipeline(answer)
        driver = Driver(pipe, on_serving=on_serving)
        task = supervise.start("driver", driver.run, driver.crashed, restart_s=0)
        await kit.until(lambda: driver.serving)
        events = driver.submit(kit.request("r1"))
        failure = await asyncio.wait_for(events.get(), 10)
        await kit.until(lambda: pipe.connects == 2 and driver.serving)
        # served again: a new request is accepted and framed on the new connection
        driver.submit(kit.request("r2"))
        await kit.until(lambda: pipe.stream_seq >= 2)
        task.cancel()
        return failure, pipe, driver

    failure, pipe, driver = asyncio.run(go())
    assert isinstance(failure, Failure) and failure.code == grpc.StatusCode.INTERNAL
    assert "outside the contract" in failure.message
    assert "r1" in pipe.released                       # its stage state is released, not left to the lease
    assert health[:3] == [True, False, True]           # NOT_SERVING while the loop was down
    assert driver.counters.failed == 1


def test_an_unknown_reject_reason_is_a_rebuild_not_a_crash(kit):
    def answer(conn, seq, slots):
        (slot,) = slots
        return stage_pb2.FrameReply(stream_seq=seq, results=[stage_pb2.SlotResult(
            stamp=echo(slot.stamp), ok=False, reason=99, detail="from a newer peer")])

    async def go():
        pipe = kit.FakePipeline(answer)
        driver = Driver(pipe, max_rebuilds=2)
        task = supervise.start("driver", driver.run, driver.crashed, restart_s=0)
        await kit.until(lambda: driver.serving)
        events = driver.submit(kit.request("r1"))
        failure = await asyncio.wait_for(events.get(), 10)
        task.cancel()
        return failure, pipe, driver

    failure, pipe, driver = asyncio.run(go())
    assert pipe.connects == 1                                     # the loop never died
    assert driver.counters.rejections["UNKNOWN_REASON_99"] == 3   # first try + 2 rebuilds
    assert failure.code == grpc.StatusCode.ABORTED and "UNKNOWN_REASON_99" in failure.message


def test_a_request_cancelled_with_its_frame_in_flight_is_released_when_the_loop_crashes(kit):
    def answer(conn, seq, slots):
        if conn == 1 and seq == 2:
            return RuntimeError("a peer answered outside the contract")
        return None                                   # frame 1 (r1's) is never answered

    async def go():
        pipe = kit.FakePipeline(answer)
        pipe.num_stages = 2                           # room for r2's frame while r1's is out
        driver = Driver(pipe)
        task = supervise.start("driver", driver.run, driver.crashed, restart_s=0)
        await kit.until(lambda: driver.serving)
        driver.submit(kit.request("r1"))
        await kit.until(lambda: pipe.stream_seq >= 1)
        assert driver.cancel("r1")                    # its frame is still in flight: nothing released yet
        assert "r1" not in pipe.released
        driver.submit(kit.request("r2"))              # its frame's reply crashes the loop
        await kit.until(lambda: pipe.connects == 2)
        task.cancel()
        return pipe, driver

    pipe, driver = asyncio.run(go())
    assert "r1" in pipe.released and "r2" in pipe.released
    assert driver.sched.ledger.used == 0 and not driver.sched.ledger.releasing
