"""The Coordinator gRPC service: Submit (stream tokens back), Cancel, Stats."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.coordinator.engine import DuplicateRequest, Engine, Failure
from services.coordinator.pipeline import PipelineDown
from services.coordinator.scheduler import Request
from tether.engine.sequence import Sequence
from tether.model.config import ModelConfig
from tether.model.tokenizer import Tokenizer
from tether import settings
from tether.protocol.hashing import hash_seed
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, engine: Engine, tokenizer: Tokenizer, cfg: ModelConfig, fingerprint: str,
                 max_lifetime_s: float = settings.MAX_REQUEST_LIFETIME_S) -> None:
        self.engine = engine
        self.max_lifetime_s = max_lifetime_s
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.fingerprint = fingerprint

    def _validate(self, request: coordinator_pb2.SubmitRequest) -> str | None:
        n = len(request.prompt_token_ids)
        if not request.request_id or len(request.request_id) > settings.MAX_REQUEST_ID_CHARS:
            return (f"request_id must be 1 to {settings.MAX_REQUEST_ID_CHARS} characters (admission mints one "
                    f"per request)")
        if n == 0:
            return "prompt_token_ids is empty"
        if max(request.prompt_token_ids) >= self.cfg.vocab_size:
            return f"prompt has a token id >= the vocabulary size {self.cfg.vocab_size}"
        if request.sampling.max_tokens < 1:
            return "sampling.max_tokens must be at least 1"
        if n + request.sampling.max_tokens > self.cfg.max_position_embeddings:
            return (f"prompt ({n} tokens) + max_tokens ({request.sampling.max_tokens}) exceeds the context "
                    f"window of {self.cfg.max_position_embeddings}")
        if request.sampling.temperature < 0:
            return "sampling.temperature must be >= 0"
        return None

    async def Submit(self, request, context):
        error = self._validate(request)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        rid = request.request_id
        seq = Sequence(rid, list(request.prompt_token_ids), request.sampling, self.tokenizer,
                       hash_seed(self.fingerprint, request.tenant), self.cfg.max_position_embeddings)
        req = Request(seq, tenant=request.tenant, priority=request.priority or "standard")
        try:
            events = self.engine.submit(req)
        except PipelineDown as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except DuplicateRequest as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        # A caller that set no deadline still gets one: nothing waits forever on a wedged request. (A gRPC
        # deadline, which admission always sets, cancels this handler by itself.)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_lifetime_s if context.time_remaining() is None else None
        finished = False
        try:
            while True:
                if deadline is None:
                    ev = await events.get()
                else:
                    try:
                        ev = await asyncio.wait_for(events.get(), deadline - loop.time())
                    except TimeoutError:
                        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                            f"request {rid} ran past the coordinator's maximum lifetime of "
                                            f"{self.max_lifetime_s:g} s (the caller set no deadline)")
                if isinstance(ev, Failure):
                    finished = True
                    await context.abort(ev.code, ev.message)
                yield coordinator_pb2.TokenEvent(index=ev.index, token_id=ev.token_id, text=ev.text,
                                                 finish_reason=ev.finish_reason, context_hash=ev.context_hash)
                if ev.finish_reason:
                    finished = True
                    return
        finally:
            if not finished:   # client went away, the call was cancelled or ran out of time: free it now
                self.engine.cancel(rid, only=req)

    async def Cancel(self, request, context):
        return coordinator_pb2.CancelReply(found=self.engine.cancel(request.request_id))

    async def Stats(self, request, context):
        e, c = self.engine, self.engine.counters
        f, ledger = e.sched.figures, e.sched.ledger
        return coordinator_pb2.StatsReply(
            serving=e.serving, model_fingerprint=self.fingerprint, num_stages=e.pipeline.num_stages,
            running=len(e.sched.running), waiting=len(e.sched.waiting), tokens_generated=c.tokens,
            requests_finished=c.finished, requests_failed=c.failed, slots_rejected=sum(c.rejections.values()),
            pipeline_epoch=e.pipeline.epoch, status=e.status, max_context=self.cfg.max_position_embeddings,
            rejections=dict(c.rejections), rebuilds=c.rebuilds, resumes=c.resumes, recovered=c.recovered,
            pipeline_reconnects=c.reconnects, stamp_checks=e.stamp_checks,
            faults_injected={k: v for k, v in e.pipeline.faults.counts.items() if v},
            preempted=e.sched.num_preempted, preemptions=f.preemptions, kv_blocks_used=ledger.used,
            kv_blocks_cached=ledger.cached, kv_blocks_total=min(ledger.capacity, 2**32 - 1),
            prefix_queries=f.prefix_queries, prefix_hits=f.prefix_hits, prefix_hit_tokens=f.prefix_hit_tokens,
            prefix_misses=c.prefix_misses, prompt_tokens=f.prompt_tokens, computed_tokens=f.computed_tokens,
            step_seconds=e.step_seconds, prefix_cache=e.prefix_cache)
