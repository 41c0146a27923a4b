"""The coordinator's recovery policy (docs/PROTOCOL.md "Recovery") against an in-process fake stage that keeps
real context chains: a frame lost before the stages saw it is synced and resumed (no rebuild); a reply lost
after they applied it is synced and rebuilt; resumes count against the same budget as rebuilds."""

from __future__ import annotations

import asyncio

import grpc

from services.coordinator.driver import Failure
from services.stage_worker.worker import echo
from tether.generation.sequence import TokenOut
from tether.protocol.hashing import ContextHasher, sampling_digest
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

TOKEN = 66
KEY = StampKey(bytes(range(32)))   # the fake pipeline's (tests/services/coordinator/conftest.py)


def fake_stage(lose):
    """An `answer` for FakePipeline acting as a one-stage pipeline that holds each request's chain.

    `lose(seq, stage)` says what happens to frame `seq`: None (normal), "before" (dropped before the stage:
    no state change, no reply) or "after" (applied by the stage, reply lost)."""
    chains: dict[str, tuple[int, ContextHasher]] = {}

    def answer(conn, seq, slots):
        what = lose(seq)
        if what == "before":
            return None
        results = []
        for slot in slots:
            st = slot.stamp
            if st.position == 0:
                chains[st.request_id] = (st.epoch, ContextHasher(slot.hash_seed))
            _, chain = chains[st.request_id]
            chain.extend(st.token_ids)
            chains[st.request_id] = (st.epoch, chain)
            res = stage_pb2.SlotResult(stamp=echo(st), ok=True)
            if slot.sample:
                res.has_token, res.token_id = True, TOKEN
                res.token_hash = KEY.token_mac(chain.peek([TOKEN]), st.request_id, st.epoch,
                                               st.position + len(st.token_ids), sampling_digest(slot.sampling), TOKEN)
            results.append(res)
        return None if what == "after" else stage_pb2.FrameReply(stream_seq=seq, results=results)

    async def sync(ids):
        return [{rid: stage_pb2.HeldState(request_id=rid, held=True, epoch=e, length=c.length,
                                          context_hash=c.value)
                 for rid, (e, c) in chains.items() if rid in ids}]
    return answer, sync


async def _run_one(kit, lose, max_rebuilds: int = 5):
    answer, sync = fake_stage(lose)
    pipe = kit.FakePipeline(answer)
    pipe.sync = sync
    return await kit.run_one(pipe, kit.request("r1", max_tokens=4), frame_timeout_s=0.3, max_rebuilds=max_rebuilds)


def test_a_frame_lost_before_the_stages_is_resumed_not_rebuilt(kit):
    out, c = asyncio.run(_run_one(kit, lambda seq: "before" if seq == 2 else None))
    assert [type(e) for e in out] == [TokenOut] * 4 and [e.token_id for e in out] == [TOKEN] * 4
    assert c.resumes == 1 and c.rebuilds == 0 and c.rejections["FRAME_LOST"] == 1 and c.recovered == 1


def test_a_reply_lost_after_the_stages_applied_it_is_rebuilt(kit):
    out, c = asyncio.run(_run_one(kit, lambda seq: "after" if seq == 2 else None))
    assert [e.token_id for e in out] == [TOKEN] * 4          # the replay continues exactly where it was
    assert c.rebuilds == 1 and c.resumes == 0 and c.rejections["STATE_LOST"] == 1


def test_resumes_count_against_the_recovery_budget(kit):
    out, c = asyncio.run(_run_one(kit, lambda seq: "before" if seq >= 2 else None, max_rebuilds=2))
    assert isinstance(out[-1], Failure) and out[-1].code == grpc.StatusCode.ABORTED
    assert "lost frames" in out[-1].message and c.resumes == 2


def test_a_request_cancelled_while_its_lost_frame_is_synced_is_released(kit):
    """Phase SYNCING: its frame was given up on and every stage is being asked what it holds; cancelled then,
    it is released at once (Request.end) and the sync's answer is ignored for it."""
    answer, held = fake_stage(lambda seq: "before" if seq == 2 else None)
    syncing, answered = asyncio.Event(), asyncio.Event()

    async def sync(ids):
        syncing.set()
        await answered.wait()
        return await held(ids)

    async def go():
        from services.coordinator.driver import Driver
        from services.coordinator.scheduler import Phase
        from tether import supervise
        pipe = kit.FakePipeline(answer)
        pipe.sync = sync
        driver = Driver(pipe, frame_timeout_s=0.3)
        task = supervise.start("driver", driver.run, driver.crashed, restart_s=0)
        await kit.until(lambda: driver.serving)
        req = kit.request("r1", max_tokens=4)
        driver.submit(req)
        await asyncio.wait_for(syncing.wait(), 10)
        assert req.phase is Phase.SYNCING and "r1" not in pipe.released
        assert driver.cancel("r1")
        await kit.until(lambda: "r1" in pipe.released)   # released now, not after the sync
        answered.set()
        await kit.until(lambda: req.phase is Phase.DONE)
        task.cancel()
        return pipe, driver

    pipe, driver = asyncio.run(go())
    assert pipe.released.count("r1") == 1 and driver.sched.ledger.used == 0
