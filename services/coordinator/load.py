"""The pipeline's live load, streamed to admission (`Coordinator.Watch`): what its router scores and its
shedding predicts waits from (services/admission/routing.py). One report is O(active requests) to build and
goes out every interval whatever the request rate, so its cost never grows with traffic."""

from __future__ import annotations

import asyncio

from services.coordinator.driver import Driver
from services.coordinator.ledger import UNBOUNDED
from tether import settings
from tether.model import dtypes
from tether.v1 import coordinator_pb2

DEFAULT_INTERVAL_S = 0.25
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 5.0


def predicted_work(driver: Driver) -> float:
    """Prefill tokens still to compute plus weighted output tokens still to sample, over every active request."""
    work = 0.0
    for req in driver.active():
        seq = req.seq
        work += req.pending + settings.DECODE_TOKEN_COST * max(0, seq.sampling.max_tokens - len(seq.output_ids))
    return work


def load_report(driver: Driver, fingerprint: str, max_context: int) -> coordinator_pb2.LoadReport:
    s, ledger = driver.sched, driver.sched.ledger
    total = ledger.capacity if ledger.capacity < UNBOUNDED else 0
    return coordinator_pb2.LoadReport(
        serving=driver.serving and not driver.draining, draining=driver.draining,
        status="draining" if driver.draining else driver.status,
        model_fingerprint=dtypes.served_fingerprint(fingerprint, driver.pipeline.served_dtype,
                                                     driver.pipeline.served_kernels),
        running=len(s.running), waiting=len(s.waiting), preempted=s.num_preempted,
        kv_blocks_total=total, kv_blocks_free=max(0, ledger.pool.available) if total else 0,
        kv_block_tokens=ledger.block, max_context=max_context, step_seconds=driver.step_seconds,
        work=predicted_work(driver), cache_generation=ledger.generation,
        max_batch_slots=s.max_slots, max_batch_tokens=s.max_tokens)


class LoadWatch:
    """The Watch RPC, mixed into the Coordinator servicer (which has `driver`, `fingerprint` and `cfg`)."""

    driver: Driver
    fingerprint: str
    watchers = 0   # Watch streams open now: an admission that watches has this pipeline's load (a rolling
                   # restart moves on only once one does)
    stopping: asyncio.Event   # the server's (grpcutil.Server.stopping): Watch streams end when it is set

    async def Watch(self, request: coordinator_pb2.WatchRequest, context):
        interval = request.interval_s or DEFAULT_INTERVAL_S
        interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, interval))
        max_context = self.cfg.max_position_embeddings   # type: ignore[attr-defined]
        self.watchers += 1
        try:
            while not self.stopping.is_set():
                yield load_report(self.driver, self.fingerprint, max_context)
                try:
                    await asyncio.wait_for(self.stopping.wait(), interval)
                except TimeoutError:
                    pass
        finally:
            self.watchers -= 1
