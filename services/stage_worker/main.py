"""`tether stage`: serve one slice of the model's layers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import torch

from services.stage_worker.server import StageServicer, step_executor
from services.stage_worker.worker import FrameLimits, StageWorker
from tether import grpcutil, service_main, settings, supervise
from tether.faults import FaultInjector, add_experiment_flags
from tether.model.config import ModelConfig, head_cost, parse_layers
from tether.model import dtypes, numerics
from tether.model.loader import checked_fingerprint, load_slice, resolve_model
from tether.security import authz
from tether.telemetry import logs, metrics

log = logging.getLogger("stage")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether stage",
        description="Stage worker: holds a contiguous slice of the model's layers and the KV state of the "
                    "requests passing through it; verifies every frame's stamps before touching that state. "
                    "Its place in the pipeline (next stage) comes from the coordinator's handshake.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=settings.STAGE_BASE_PORT, help="gRPC port (default: %(default)s)")
    p.add_argument("--model", default=settings.DEFAULT_MODEL,
                   help="smollm2 (the real default model), a random-weight preset (tiny, small, base) or a Hugging Face "
                        "folder (default: %(default)s)")
    p.add_argument("--layers", default=":",
                   help="layers to hold: START:END (END exclusive) or I/N for slice I of N, split so that the "
                        "slowest stage is fastest (the last also runs the LM head and sampling) (default: all)")
    p.add_argument("--dtype", default=settings.DTYPE, choices=dtypes.CHOICES,
                   help="compute dtype; auto: float32 on our own C kernels where this machine builds them (the "
                        "model's GGUF groups read where its folder keeps them), else bfloat16 where this CPU runs "
                        "it natively and invariantly, else float32 padded (default: %(default)s)")
    p.add_argument("--linear-inputs", default=settings.LINEAR_INPUTS, choices=dtypes.LINEAR_INPUTS,
                   help="what float32 linears multiply: their inputs as they are, or q8: rounded to 8 bits per group "
                        "of 32 against the model's GGUF Q4_1 / Q8_0 groups in integers, as llama.cpp computes them (~2.5x "
                        "faster linears on AVX-512 VNNI; answers differ from float32's by that rounding, still the "
                        "same whatever the batch). Every stage of a pipeline must say the same (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--alone-threads", type=int, default=0, metavar="N",
                   help="threads a step may take when its frame is the only micro-batch in the pipeline (the "
                        "coordinator's frames_in_flight hint: the other stages' cores are idle then); the same bits "
                        "on any count (default: the cores this process may run on; 1 turns it off)")
    p.add_argument("--kv-memory-mib", type=float, default=settings.KV_MEMORY_MIB, metavar="MIB",
                   help="KV memory over all requests, cached prefixes included; the pool in positions follows from "
                        "this slice's layers, KV heads and dtype (default: %(default)s)")
    p.add_argument("--kv-capacity", type=int, default=0, metavar="POSITIONS",
                   help="the KV pool in context positions instead of --kv-memory-mib (default: from the memory)")
    p.add_argument("--kv-prefault", action=argparse.BooleanOptionalAction, default=settings.kv_prefault(),
                   help="make the whole KV pool resident at start, so that this process's RSS is from the start what "
                        "it will use under load (~0.4 s a GiB); --no-kv-prefault maps its pages as blocks are first "
                        f"used, and RSS then grows under load up to the pool's size (default: on; "
                        f"${settings.KV_PREFAULT_ENV}=0 turns it off)")
    p.add_argument("--lease", type=float, default=settings.KV_LEASE_S,
                   help="free a request's state after this many idle seconds (default: %(default)s)")
    p.add_argument("--max-streams", type=int, default=settings.MAX_FORWARD_STREAMS,
                   help="Forward streams served at once; more are refused with RESOURCE_EXHAUSTED "
                        "(default: %(default)s)")
    p.add_argument("--max-streams-per-peer", type=int, default=settings.MAX_STREAMS_PER_PEER,
                   help="Forward streams served at once from one peer address (default: %(default)s)")
    p.add_argument("--max-frame-rows", type=int, default=settings.STAGE_MAX_FRAME_ROWS,
                   help="token rows one frame may carry over all its slots; advertised at handshake, frames "
                        "beyond are refused (default: %(default)s)")
    p.add_argument("--max-frame-slots", type=int, default=settings.STAGE_MAX_FRAME_SLOTS,
                   help="requests one frame may carry; advertised at handshake, frames beyond are refused "
                        "(default: %(default)s)")
    p.add_argument("--stream-idle", type=float, default=settings.STREAM_IDLE_S, metavar="SECONDS",
                   help="close a Forward stream with no frame in and no reply out for this long "
                        "(default: %(default)s)")
    add_experiment_flags(p, "this stage's traffic (the frames it forwards, the replies it answers)")
    service_main.add_flags(p)
    p.epilog = ("With TLS (mutual), --tls-cert must name spiffe://tether.local/stage/<i>: that is this stage's "
                "position. Handshake is taken from the coordinator (stage 0) or stage i-1 (relayed), the next hop "
                "must present stage/<i+1>, Forward "
                "only from the peer of the handshake accepted last, SyncState and Release from the coordinator, "
                "Stats from the coordinator or an operator certificate; other callers get PERMISSION_DENIED.")
    return p


def load_worker(args: argparse.Namespace, folder, start: int, end: int) -> StageWorker:
    """The slice (its start-up probe included) and its worker, made where its steps will run (`step_executor`)."""
    threads = args.threads or torch.get_num_threads()
    alone = args.alone_threads or len(os.sched_getaffinity(0))
    # Load (and probe) on every thread count a step may take: the rule's thread cap is found up to torch's
    # count, so a probe on `threads` alone would leave `alone` threads unchecked (a Xeon caps smollm2 at 1).
    torch.set_num_threads(max(threads, alone))
    try:
        model = load_slice(folder, start, end, args.dtype, args.linear_inputs)
    except ValueError as e:   # e.g. q8 inputs where this machine does not serve float32 on rowdot
        raise SystemExit(f"stage: {e}") from None
    finally:
        torch.set_num_threads(threads)
    kv_capacity = args.kv_capacity or model.kv_positions_for(args.kv_memory_mib)
    checks = not args.unsafe_disable_stamp_checks
    worker = StageWorker(model, index=0, kv_capacity_tokens=kv_capacity, dtype=numerics.name_of(model.dtype),
                         stamp_checks=checks, limits=FrameLimits(args.max_frame_rows, args.max_frame_slots),
                         alone_threads=alone, threads=threads, kv_prefault=args.kv_prefault)
    arena = worker.arena
    mib = arena.num_blocks * arena.block_bytes / 2**20
    log.info("KV pool: %d positions, %.0f MiB (%d bytes per position), %s", kv_capacity, mib,
             model.kv_bytes_per_position,
             "resident from the start (--kv-prefault)" if arena.prefaulted else
             f"NOT resident yet: this process's RSS grows by up to {mib:.0f} MiB as the pool's blocks are first "
             "used under load (--kv-prefault makes it resident at start)")
    return worker


async def serve(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)   # process-wide default (every thread's first parallel region)
    folder = resolve_model(args.model)
    cfg = ModelConfig.from_folder(folder)
    start, end = parse_layers(args.layers, cfg.num_hidden_layers, head_cost(cfg))
    fingerprint = checked_fingerprint(folder)   # before loading: refuses a folder changed since tether made it
    # Who may call what, with mutual TLS only (plaintext has no identities); refusals count in Stats.
    refusals: list = []   # the worker's counter, once it is loaded (nothing can call before the server starts)
    guard = authz.AuthzInterceptor(on_refusal=lambda method, why: refusals[0].update(["PERMISSION_DENIED"]))
    # Bound before the model loads: a port in use fails at once, and a launcher that passed --port 0 can start
    # the coordinator (which retries its handshake until this stage serves) while this one loads.
    server = grpcutil.Server(args.host, args.port, ["tether.v1.Stage"], tls=args.tls,
                             interceptors=[guard] if args.tls is not None else ())
    bound = {"--port": server.port}
    service_main.report_ports(args, bound, ready=False)
    address = f"{args.host}:{server.port}"
    executor = step_executor(last=end == cfg.num_hidden_layers)   # the last stage: steps on the loop's thread
    worker = await asyncio.get_running_loop().run_in_executor(executor, load_worker, args, folder, start, end)
    refusals.append(worker.refusals)
    model = worker.model
    faults = FaultInjector(args.fault_config)
    servicer = StageServicer(worker, fingerprint, address, args.lease, faults=faults,
                             stream_idle_s=args.stream_idle, max_streams=args.max_streams,
                             max_streams_per_peer=args.max_streams_per_peer, tls=args.tls, executor=executor)
    guard.state = servicer   # Forward is allowed from servicer.handshake_peer
    from tether.v1 import stage_pb2, stage_pb2_grpc
    stage_pb2_grpc.add_StageServicer_to_server(servicer, server.server)
    await server.start()
    if args.metrics_port:
        registry = metrics.new_registry()
        loop = asyncio.get_running_loop()
        # the very Stats reply gRPC clients get (its figures are read on the step thread, between steps), at
        # most once per METRICS_SNAPSHOT_MAX_AGE_S: scrapes never queue work on the model thread
        registry.register(metrics.StageCollector(
            metrics.loop_snapshot(loop, lambda: servicer.Stats(stage_pb2.StageStatsRequest(), None))))
        bound["--metrics-port"] = service_main.serve_metrics("stage", registry, args.metrics_host, args.metrics_port)
    await server.set_serving(True)
    service_main.report_ports(args, bound, ready=True)
    leases = supervise.start("lease", servicer.expire_leases)
    logs.announce(log, f"stage listening on {address} (layers [{start}, {end}) of {cfg.num_hidden_layers}, "
                       f"model {fingerprint}, {worker.dtype} {model.rows})")
    try:
        await server.wait_for_signal()
    finally:
        leases.cancel()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.max_streams, args.max_streams_per_peer, args.max_frame_rows, args.max_frame_slots) < 1 \
            or args.stream_idle <= 0:
        parser.error("--max-streams, --max-streams-per-peer, --max-frame-rows and --max-frame-slots must be >= 1 "
                     "and --stream-idle > 0")
    if args.threads < 0 or args.alone_threads < 0:
        parser.error("--threads and --alone-threads must be >= 1 (or 0: the default)")
    service_main.run("stage", parser, args, serve)
