"""`tether coordinator`: own one pipeline of stage workers, batch continuously, stream tokens back."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.coordinator.drain import Drain
from services.coordinator.driver import Driver
from services.coordinator.pipeline import Pipeline
from services.coordinator.server import CoordinatorServicer
from tether import grpcutil, service_main, settings, supervise
from tether.faults import FaultInjector, add_experiment_flags
from tether.model.config import ModelConfig
from tether.model import dtypes
from tether.model.folder import checked_fingerprint, load_model_tokenizer, resolve_model
from tether.security import authz
from tether.telemetry import logs, metrics
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("coordinator")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether coordinator",
        description="Coordinator: handshakes its route of stage workers, batches requests continuously, keeps "
                    "one micro-batch in flight per stage, and appends a token only when its echoed stamp matches.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=settings.COORDINATOR_PORT, help="gRPC port (default: %(default)s)")
    p.add_argument("--model", default=settings.DEFAULT_MODEL,
                   help="smollm2 (the real default model), a random-weight preset (tiny, small, base) or a Hugging Face folder: must be what the stages loaded "
                        "(default: %(default)s)")
    p.add_argument("--stages", required=True,
                   help="the route: comma-separated HOST:PORT of the stage workers, first layers first")
    p.add_argument("--dtype", default=settings.DTYPE, choices=dtypes.CHOICES,
                   help="dtype the stages must run; auto: whatever they chose, the same on every stage "
                        "(default: %(default)s)")
    p.add_argument("--max-batch-slots", type=int, default=settings.MAX_BATCH_SLOTS,
                   help="requests per micro-batch (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=settings.MAX_BATCH_TOKENS,
                   help="rows per micro-batch; longer prompts are prefilled in chunks (default: %(default)s)")
    p.add_argument("--alone-max-requests", type=int, default=None, metavar="N",
                   help="while at most N requests are active, keep one micro-batch in flight instead of one per "
                        "stage, if every stage runs a micro-batch alone on more threads than under load (their "
                        "--alone-threads; on shared cores that is faster for small batches); 0: always one per "
                        f"stage (default: {settings.ALONE_MAX_REQUESTS}, or {settings.ALONE_MAX_REQUESTS_Q8} where "
                        "the stages multiply q8 inputs, as their handshake says)")
    p.add_argument("--frame-timeout", type=float, default=settings.FRAME_TIMEOUT_S,
                   help="seconds before an unanswered micro-batch counts as lost; its requests are synced with "
                        "the stages and resumed or replayed (default: %(default)s)")
    p.add_argument("--recovery-window", type=float, default=settings.RECOVERY_WINDOW_S,
                   help="seconds in-flight requests wait for a broken pipeline (e.g. a restarting stage) to "
                        "come back before failing with UNAVAILABLE (default: %(default)s)")
    p.add_argument("--max-rebuilds", type=int, default=settings.MAX_REBUILDS,
                   help="times one request's state may be replayed after integrity failures before it fails "
                        "with ABORTED (default: %(default)s)")
    p.add_argument("--stream-idle", type=float, default=settings.STREAM_IDLE_S, metavar="SECONDS",
                   help="the stages' idle timeout (their --stream-idle): an idle pipeline gets a keep-alive frame "
                        "every third of it (default: %(default)s)")
    p.add_argument("--max-request-seconds", type=float, default=settings.MAX_REQUEST_LIFETIME_S,
                   help="lifetime of a request whose caller set no deadline; past it the request ends with "
                        "DEADLINE_EXCEEDED and its state is released (default: %(default)s)")
    p.add_argument("--drain-seconds", type=float, default=settings.DRAIN_S, metavar="SECONDS",
                   help="on SIGTERM, or a Drain call (`tether drain`) that names no deadline of its own: take no "
                        "new request (the load report says draining, so admission routes elsewhere), let running "
                        "ones finish this long, hand the rest back to admission to continue on another pipeline; "
                        "then exit (after a Drain call only if it asks) (default: %(default)s)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="never start a request from the stages' prefix cache: every prompt is prefilled whole (for "
                        "comparisons; the stages still cache, and the KV accounting is unchanged)")
    add_experiment_flags(p, "the frames this coordinator sends")
    service_main.add_flags(p)
    p.epilog = ("With TLS (mutual), Submit, Session, Cancel and Watch are taken from admission only, Stats and "
                "Drain from an operator certificate (or admission); other callers get PERMISSION_DENIED. Its calls "
                "to the "
                "stages present --tls-cert (the coordinator identity), which is what they accept handshakes from.")
    return p


async def serve(args: argparse.Namespace) -> None:
    folder = resolve_model(args.model)
    cfg = ModelConfig.from_folder(folder)
    fingerprint = checked_fingerprint(folder)   # refuses a folder changed since tether made it
    addresses = [a.strip() for a in args.stages.split(",") if a.strip()]
    pipeline = Pipeline(addresses, fingerprint, "" if args.dtype == dtypes.AUTO else args.dtype, FaultInjector(args.fault_config), tls=args.tls)
    guard = [authz.AuthzInterceptor()] if args.tls is not None else []   # who may call what (mutual TLS only)
    server = grpcutil.Server(args.host, args.port, ["tether.v1.Coordinator"],
                             max_message_bytes=settings.COORDINATOR_MAX_MESSAGE_BYTES, tls=args.tls,
                             interceptors=guard)
    bound = {"--port": server.port}
    service_main.report_ports(args, bound, ready=False)
    driver = Driver(pipeline, args.max_batch_slots, args.max_batch_tokens, args.frame_timeout,
                    args.recovery_window, args.max_rebuilds, stamp_checks=not args.unsafe_disable_stamp_checks,
                    on_serving=server.set_serving, stream_idle_s=args.stream_idle,
                    prefix_cache=not args.no_prefix_cache, alone_max=args.alone_max_requests)
    registry = metrics.new_registry() if args.metrics_port else None
    observed = metrics.CoordinatorMetrics(registry) if registry is not None else None
    servicer = CoordinatorServicer(driver, load_model_tokenizer(folder), cfg, fingerprint, args.max_request_seconds)
    # One drain for SIGTERM and the Drain RPC (services/coordinator/drain.py); a call that asks to exit stops the
    # server as SIGTERM would, once drained.
    drain = Drain(driver, args.drain_seconds, on_start=lambda: server.set_serving(False))
    servicer.drain, servicer.on_drained_exit, servicer.stopping = drain, server.request_stop, server.stopping
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server.server)
    await server.start()
    if registry is not None and observed is not None:   # metrics on
        servicer.metrics, driver.on_batch = observed, observed.on_batch
        loop = asyncio.get_running_loop()
        # the very Stats reply gRPC clients get, built on the loop that owns the driver's state
        registry.register(metrics.CoordinatorCollector(
            metrics.loop_snapshot(loop, lambda: servicer.Stats(coordinator_pb2.StatsRequest(), None))))
        bound["--metrics-port"] = service_main.serve_metrics("coordinator", registry, args.metrics_host,
                                                             args.metrics_port)
    await server.set_serving(False)
    service_main.report_ports(args, bound, ready=True)
    loop_task = supervise.start("driver", driver.run, driver.crashed)
    logs.announce(log, f"coordinator listening on {args.host}:{server.port} (route {', '.join(addresses)})")
    try:
        await server.wait_for_signal(before_stop=drain.wait)   # SIGTERM drains, then exits
    finally:
        loop_task.cancel()
        await pipeline.close()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    service_main.run("coordinator", parser, parser.parse_args(argv), serve)
