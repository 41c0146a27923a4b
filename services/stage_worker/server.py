"""The Stage gRPC service: handshake down the chain, Forward with relay, SyncState, Release, Stats, leases.

Each upstream Forward stream gets its own downstream stream to the next stage; replies from downstream are
merged with this stage's own rejections and relayed upstream, so results reach the coordinator on the
stream it opened. A broken downstream aborts the upstream stream with UNAVAILABLE: nothing hangs.

Hostile input (docs/PROTOCOL.md): at most `max_streams` Forward streams at once, and `max_streams_per_peer`
from one peer address (RESOURCE_EXHAUSTED beyond), a frame over the advertised row/slot limits is refused
(BAD_FRAME for every slot), a stream with no frame in and no reply out for `stream_idle_s` is closed (DEADLINE_EXCEEDED), an
undecodable frame ends its stream with INVALID_ARGUMENT, gRPC itself refuses messages over
settings.GRPC_MAX_MESSAGE_BYTES (RESOURCE_EXHAUSTED), and a bounded reply queue plus HTTP/2 flow control
bound a stream's memory when its client stops reading.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import grpc

from services.stage_worker.relay import DONE, Relay
from services.stage_worker.worker import StageTraces, StageWorker, StepOutcome
from tether import grpcutil, settings
from tether.faults import FaultInjector, crash
from tether.security import identity, server_check
from tether.security.identity import Identity
from tether.security.tls import TlsConfig
from tether.protocol.stamp_key import KEY_BYTES, StampKey
from tether.telemetry import tracing
from tether.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)
RejectReason = stage_pb2.RejectReason


def step_thread() -> ThreadPoolExecutor:
    """The one thread that runs every step. The model should be loaded on it too: each thread that runs an OpenMP
    region keeps its own pool, and with more pool threads than cores libgomp throttles their spin to almost
    nothing, so that a second pool (the main thread's, from loading) made every 2-thread region of the step
    thread pay a wake (1536x576 bf16 product at 1 row: 139 us against 97 with the step thread's pool alone)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-step")


class InlineExecutor(Executor):
    """Runs each call at once on the calling thread (the event loop's), its result or exception in the returned
    future: `run_in_executor` with it runs the step where the frame arrived."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:   # as a pool's worker does: the caller's await raises it
            done.set_exception(e)
        return done


def step_executor(last: bool) -> Executor:
    """Where this stage's steps (and everything else that touches its model and request state) run, for the
    process's life. The last stage runs them on the event loop's own thread: it has no next stage's replies to
    relay, so a step blocks nothing that could go on meanwhile, and each step saves two thread handoffs (~0.3 ms
    each on a 2-core VM, where the woken thread's core has gone idle: 1-4% of tok/s, docs/PERFORMANCE.md). Any
    other stage keeps a step thread: its loop relays the next stage's replies while a step runs (with two
    micro-batches in flight they arrive mid-step). Load the model with the same executor (`step_thread` says why)."""
    return InlineExecutor() if last else step_thread()


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, worker: StageWorker, fingerprint: str, address: str,
                 lease_s: float = settings.KV_LEASE_S, faults: FaultInjector | None = None,
                 stream_idle_s: float = settings.STREAM_IDLE_S,
                 max_streams: int = settings.MAX_FORWARD_STREAMS,
                 max_streams_per_peer: int = settings.MAX_STREAMS_PER_PEER, tls: TlsConfig | None = None,
                 executor: Executor | None = None) -> None:
        self.worker = worker
        self.tls = tls                                    # for the channel to the next stage (our certificate)
        # With TLS the stage's position is the one its own certificate names (stage/<i>): who may handshake it
        # (authz.py reads it), the index a handshake must give it, and the next hop's identity (stage/<i+1>).
        self.position: int | None = None
        if tls is not None:
            own = identity.of_certificate(tls.cert)
            self.position = identity.stage_index(own)
            if self.position is None:
                raise ValueError(f"a stage's --tls-cert must name spiffe://{settings.TLS_TRUST_DOMAIN}/stage/<i> "
                                 f"(`tether certs init` stage-<i>.pem); this one names {own or 'no identity'}")
            worker.index = self.position
        # Who sent the handshake accepted last (None in plaintext): the only peer whose frames are served
        # (tether/security/authz.py reads it).
        self.handshake_peer: Identity | None = None
        self.model = worker.model
        self.fingerprint = fingerprint
        self.address = address
        self.lease_s = lease_s
        self.stream_idle_s = stream_idle_s
        self.max_streams = max_streams
        self.max_streams_per_peer = max_streams_per_peer
        self.open_streams = 0
        self.streams_by_peer: Counter[str] = Counter()   # peer address (host) -> Forward streams open
        self.coordinator_instance: str | None = None
        self.relays: set[Relay] = set()                  # one per open Forward stream
        self.faults = _StageFaults(faults) if faults is not None and faults.enabled else None
        self.pipeline_epoch: int | None = None
        self.next_address: str | None = None
        self.next_channel: grpc.aio.Channel | None = None
        # One thread: the model and KV state are touched by one step at a time, in frame order (`step_executor`:
        # a step thread, or the loop's own on the last stage).
        self.executor = executor or step_thread()
        # None while tracing is off: the step is then exactly worker.process (no per-slot look at traceparent).
        self.traces = StageTraces(worker) if tracing.TRACER is not None else None

    @property
    def who(self) -> str:
        return f"stage {self.worker.index} ({self.address})"

    # --- handshake ------------------------------------------------------------------------------------
    def info(self, disclose: bool = True) -> stage_pb2.StageInfo:
        """This stage as a handshake reply describes it; without `disclose`, no model fingerprint (a refused
        peer that is not an authenticated coordinator or stage must not learn what to send next time)."""
        m = self.model
        threads, alone_threads = self.worker.step_threads()
        return stage_pb2.StageInfo(
            address=self.address, layer_start=m.layer_start, layer_end=m.layer_end, has_embedding=m.has_embedding,
            has_head=m.has_head, model_fingerprint=self.fingerprint if disclose else "",
            protocol_version=settings.PROTOCOL_VERSION, kv_capacity_tokens=self.worker.kv_capacity_tokens,
            num_layers=m.cfg.num_hidden_layers, dtype=self.worker.dtype,
            max_frame_rows=self.worker.limits.max_rows, max_frame_slots=self.worker.limits.max_slots,
            max_streams_per_peer=self.max_streams_per_peer, kv_block_tokens=self.worker.block_tokens,
            threads=threads, alone_threads=alone_threads, kernels=m.rows.kernels,
            linear_inputs=m.rows.inputs)

    def _refusal(self, req: stage_pb2.HandshakeRequest) -> str | None:
        m = self.model
        who = f"stage {req.index} ({self.address})"
        if req.protocol_version != settings.PROTOCOL_VERSION:
            return f"{who} speaks protocol v{settings.PROTOCOL_VERSION}, coordinator v{req.protocol_version}"
        if req.model_fingerprint != self.fingerprint:
            # the stage's own fingerprint is not said: a peer that does not know it must not learn it here
            return f"{who} loaded another model: the fingerprints differ (the coordinator expects {req.model_fingerprint})"
        if req.dtype and req.dtype != self.worker.dtype:
            # req.dtype is the coordinator's --dtype at stage 0 and the upstream stage's own dtype after it
            # (a coordinator with --dtype auto sends none): a pipeline never mixes numerics
            whose = "the coordinator expects" if req.index == 0 else "the stages before it run"
            return f"{who} runs {self.worker.dtype}, {whose} {req.dtype}: a pipeline never mixes numerics"
        kernels = self.model.rows.kernels
        if req.kernels and req.kernels != kernels:
            return (f"{who} runs {self.worker.dtype} {kernels}, the stages before it run {req.kernels}: a pipeline "
                    f"never mixes numerics (their CPUs or torch builds differ)")
        if len(req.stamp_key) != KEY_BYTES:
            return f"{who} needs a {KEY_BYTES}-byte stamp key, got {len(req.stamp_key)} bytes"
        if req.index >= len(req.route):
            return f"{who} is not in the route"
        if self.position is not None and req.index != self.position:
            return (f"this stage is stage {self.position} by its certificate, but the handshake places it at "
                    f"position {req.index} of the route")
        if m.layer_start != req.prev_layer_end:
            kind = "gap" if m.layer_start > req.prev_layer_end else "overlap"
            return (f"{who} holds layers [{m.layer_start}, {m.layer_end}) but the previous stage ends at "
                    f"{req.prev_layer_end}: a {kind} in the layer ranges")
        last = req.index == len(req.route) - 1
        if last and not m.has_head:
            return (f"{who} is the last stage but holds layers [{m.layer_start}, {m.layer_end}) of "
                    f"{m.cfg.num_hidden_layers}: the route lacks the head")
        if not last and m.has_head:
            return f"{who} holds the head but {len(req.route) - 1 - req.index} stage(s) follow it"
        return None

    async def Handshake(self, request, context):
        peer = identity.of_peer(context)   # with mutual TLS authz already checked its role; plaintext: None
        refusal = self._refusal(request)
        if refusal:
            log.warning("handshake refused: %s", refusal)
            # our fingerprint only to an authenticated pipeline peer (never in plaintext)
            disclose = peer is not None and peer.role in ("coordinator", "stage")
            return stage_pb2.HandshakeReply(ok=False, error=refusal, stages=[self.info(disclose)])
        stages = [self.info()]
        if request.index + 1 < len(request.route):
            nxt = request.route[request.index + 1].address
            expect = identity.stage(request.index + 1)   # verified by TLS on every connection (grpcutil.channel)
            if nxt != self.next_address:
                if self.next_channel is not None:
                    await self.next_channel.close()
                self.next_channel, self.next_address = grpcutil.channel(nxt, tls=self.tls, expect=expect), nxt
            down = stage_pb2.HandshakeRequest()
            down.CopyFrom(request)
            down.index = request.index + 1
            down.prev_layer_end = self.model.layer_end
            down.dtype = self.worker.dtype   # every stage after us must run what we run
            down.kernels = self.model.rows.kernels
            try:
                reply = await stage_pb2_grpc.StageStub(self.next_channel).Handshake(down, timeout=10)
            except grpc.aio.AioRpcError as e:
                why = await server_check.refusal(nxt, self.tls, expect)
                if why is not None:   # someone else serves there: refused (and told to the coordinator)
                    self.worker.refusals["SERVER_IDENTITY"] += 1
                    return stage_pb2.HandshakeReply(
                        ok=False, stages=stages, error=f"stage {request.index} refused the server at {nxt} as "
                                                      f"stage {down.index}: {why}")
                # Not a refusal: the route may assemble once that stage is up, so the caller retries.
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"stage {down.index} ({nxt}) unreachable from stage {request.index}: {e.details()}")
            stages.extend(reply.stages)
            if not reply.ok:
                return stage_pb2.HandshakeReply(ok=False, error=reply.error, stages=stages)
        self.pipeline_epoch = request.pipeline_epoch
        if peer != self.handshake_peer:
            await self._end_streams_not_of(peer)
        self.handshake_peer = peer
        self.worker.stamp_key = StampKey(request.stamp_key)   # this epoch's: older frames fail STALE_EPOCH anyway
        self.worker.index = request.index
        if request.coordinator_instance != self.coordinator_instance:
            if self.coordinator_instance is not None:
                # The state held belongs to a coordinator process that is gone: nobody will release it. Listed on
                # the step thread, after the step it may be running now: a step of the old instance's stream that
                # began before this handshake registers its requests only as it ends (listed here, before it,
                # they leaked until the lease).
                freed = await asyncio.get_running_loop().run_in_executor(
                    self.executor, lambda: self._release(list(self.worker.state.requests), "new coordinator"))
                log.info("new coordinator instance %s: freed %d request state(s) of the previous one",
                         request.coordinator_instance or "(unnamed)", freed)
            self.coordinator_instance = request.coordinator_instance
        log.info("handshake ok: stage %d of %d, layers [%d, %d), pipeline epoch %x", request.index,
                 len(request.route), self.model.layer_start, self.model.layer_end, request.pipeline_epoch)
        return stage_pb2.HandshakeReply(ok=True, stages=stages)

    async def _end_streams_not_of(self, peer: Identity | None) -> None:
        """The handshake peer changed: the Forward streams another peer opened end (authz admitted them under
        the previous handshake; frames must come from the new peer alone)."""
        for relay in list(self.relays):
            opener = identity.of_peer(relay.context)
            if opener != peer:
                log.warning("ending a Forward stream of %s: %s sent this stage its handshake", opener, peer)
                await relay.fail(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"{self.who} was handshaken by {peer}: streams of {opener} end")

    # --- forward --------------------------------------------------------------------------------------
    async def Forward(self, request_iterator, context):
        if self.pipeline_epoch is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no handshake yet: stage is not part of a pipeline")
        peer = peer_host(context.peer())
        if self.open_streams >= self.max_streams:
            self.worker.refusals["STREAMS"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.who} already has {self.open_streams} Forward streams open (limit "
                                f"{self.max_streams}); close one before opening another")
        if self.streams_by_peer[peer] >= self.max_streams_per_peer:
            self.worker.refusals["STREAMS_PER_PEER"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.who} already has {self.streams_by_peer[peer]} Forward streams open from "
                                f"{peer} (limit {self.max_streams_per_peer} per peer, advertised at handshake)")
        self.open_streams += 1
        self.streams_by_peer[peer] += 1
        handler = asyncio.current_task()
        assert handler is not None   # a grpc.aio handler runs in a task
        relay = Relay(self, context, handler)
        self.relays.add(relay)
        tasks = [asyncio.create_task(relay.pump(request_iterator)), asyncio.create_task(relay.watch_idle())]
        try:
            while True:
                item = await relay.out.get()
                if item is DONE:
                    return
                try:
                    await context.write(item)
                except Exception as e:   # the client left mid-write (cancelled, connection lost)
                    log.debug("Forward stream ended while writing a reply: %r", e)
                    return
                relay.touch()
        finally:
            self.open_streams -= 1
            self.streams_by_peer[peer] -= 1
            if self.streams_by_peer[peer] <= 0:
                del self.streams_by_peer[peer]
            for t in tasks:
                t.cancel()
            self.relays.discard(relay)
            await relay.close()

    def step(self, frame: stage_pb2.Frame, forget: str | None) -> StepOutcome:
        """On the step thread: apply an injected forget_kv, then process the frame."""
        if forget is not None:
            self.worker.state.release([forget])
        if self.traces is not None:
            return self.traces.process(frame)
        return self.worker.process(frame)

    def _release(self, request_ids: list[str], why: str) -> int:
        """On the step thread: free the requests' state (and end their spans, tracing on)."""
        n = self.worker.state.release(request_ids)
        if self.traces is not None:
            self.traces.released(request_ids, why)
        return n

    async def SyncState(self, request, context):
        return stage_pb2.SyncReply(states=[self.worker.state.held(r) for r in request.request_ids])

    async def Stats(self, request, context):
        faults = dict(self.faults.injector.counts) if self.faults is not None else {}
        streams = self.open_streams
        queued = sum(r.out.qsize() for r in self.relays)

        def snapshot() -> stage_pb2.StageStats:   # on the step thread: no step mutates what we read
            w = self.worker
            stats = stage_pb2.StageStats(
                faults_injected=faults, rejections=dict(w.rejections), requests_held=len(w.state.requests),
                kv_used_tokens=w.kv_used_tokens(), kv_capacity_tokens=w.kv_capacity_tokens,
                stamp_checks=w.state.stamp_checks, forward_streams=streams, refusals=dict(w.refusals),
                replies_queued=queued, busy_seconds=w.busy_seconds, uptime_seconds=time.monotonic() - w.started,
                steps=w.steps, sampling_seconds=w.sampling_seconds)
            pool = w.arena.pool
            stats.prefix_queries, stats.prefix_hits = pool.counters.queries, pool.counters.hits
            stats.prefix_hit_tokens = pool.counters.hit_tokens
            stats.prefix_evictions = pool.counters.evictions
            stats.kv_blocks_used, stats.kv_blocks_cached = pool.used, len(pool.evictable)
            stats.kv_blocks_total = pool.capacity
            stats.kv_blocks_touched = w.arena.touched_blocks
            stats.kv_block_bytes = w.arena.block_bytes
            return stats
        return await asyncio.get_running_loop().run_in_executor(self.executor, snapshot)

    async def Release(self, request, context):
        n = await asyncio.get_running_loop().run_in_executor(
            self.executor, self._release, list(request.request_ids), "release")
        return stage_pb2.ReleaseReply(released=n)

    async def expire_leases(self) -> None:
        """Forever (supervised by the caller): free state idle past the lease."""
        while True:
            await asyncio.sleep(max(1.0, self.lease_s / 10))
            stale = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._expire)
            if stale:
                log.info("lease expired: freed %d idle request(s)", len(stale))

    def _expire(self) -> list[str]:
        stale = self.worker.state.expire(self.lease_s)
        if stale and self.traces is not None:
            self.traces.released(stale, "lease")
        return stale


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string ("ipv4:127.0.0.1:5432" -> "ipv4:127.0.0.1"): streams are
    counted per peer machine, not per connection (a new connection per stream must not escape the limit)."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


class _StageFaults:
    """Where a stage applies its fault injector (tether/faults/): on a frame's arrival (crash, forget_kv),
    on each frame it forwards (through the relay's OutboundFaults: delay, drop, duplicate, reorder, corrupt,
    swap_slots, cross_ids) and on each reply it answers itself rather than relays (cross_ids, corrupt: on the
    last stage, the sampled tokens)."""

    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector

    def on_arrival(self) -> None:
        if self.injector.crash():
            crash(log)

    def forget(self, frame: stage_pb2.Frame) -> str | None:
        rid = self.injector.forget(frame)
        if rid is not None:
            log.info("fault injection: forgetting the state of %s", rid)
        return rid

    def reply(self, reply: stage_pb2.FrameReply) -> stage_pb2.FrameReply:
        return self.injector.reply(reply)
