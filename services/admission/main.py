"""Command line of the admission service: `python -m services.admission --help`."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from services.admission.front_work import FrontWork, model_limits
from services.admission.auth import ApiKeys
from services.admission.limits import TenantLimits, read_tenants_file
from services.admission.pipelines import Pipelines, parse_coordinators
from services.admission.routing import POLICIES
from services.admission.door import FrontDoor
from services.admission.server import AdmissionServicer, follow_readiness
from services.admission.session import CoordinatorSession
from services.admission.validate import ModelLimits
from tether import ports, service_main, settings, supervise
from tether.argtypes import positive_int
from tether.grpcutil import Server
from tether.telemetry import logs, metrics
from tether.model.folder import checked_fingerprint, resolve_model
from tether.model.record import ModelFolderChanged
from tether.v1 import admission_pb2, admission_pb2_grpc

if TYPE_CHECKING:   # FastAPI and uvicorn are imported only when HTTP is served
    from services.admission.openai_api.serve import HttpFace

log = logging.getLogger("admission")
SERVICE_NAME = admission_pb2.DESCRIPTOR.services_by_name["Admission"].full_name


def _coordinators(text: str) -> list[tuple[str, frozenset[str]]]:
    try:
        return parse_coordinators(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.admission",
        description="tether's public front door: validates and tags requests, limits concurrency and tenants, routes "
                    "each to one of its pipelines and streams tokens back with an end-to-end receipt.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=settings.ADMISSION_PORT,
                   help="gRPC port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--http-port", type=int, default=settings.HTTP_PORT,
                   help="port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
                        "/health), on --host, with the same TLS as the gRPC port; 0 picks a free one "
                        "(default: %(default)s)")
    p.add_argument("--no-http", action="store_true", help="serve gRPC only, no HTTP API")
    p.add_argument("--coordinator", metavar="HOST:PORT[=ROLES],...", default=f"127.0.0.1:{settings.COORDINATOR_PORT}",
                   type=_coordinators, help="the pipelines to route to: each coordinator's address, optionally with the size classes "
                        "it is for, e.g. 'h1:50061=long,h2:50061=short+medium' (a pipeline without roles takes "
                        "any request) (default: %(default)s)")
    p.add_argument("--route-policy", choices=POLICIES, default=settings.ROUTE_POLICY,
                   help="how a request's pipeline is chosen: features (its predicted cost against each "
                        "pipeline's load, prefix-cache affinity, KV room, roles), least-loaded or round-robin "
                        "(for comparison) (default: %(default)s)")
    p.add_argument("--tenants", metavar="FILE", default=None,
                   help="TOML file of tenants: rate limits ([defaults] and [tenants.NAME] with requests_per_s, "
                        "tokens_per_s, burst_s) and API keys ([tenants.NAME] api_keys_sha256 = [...] from `tether "
                        "keys new`, and the priorities it may use, default [\"standard\", \"sheddable\"]); once "
                        "any key is listed every call needs 'authorization: Bearer <key>' and runs as its key's "
                        "tenant; without keys the tenant is whatever the caller claims, and without the file no "
                        "tenant is limited")
    p.add_argument("--model", default=settings.DEFAULT_MODEL,
                   help="smollm2 (the real default model), a random-weight preset (tiny, small, base) or Hugging Face folder; must be the coordinator's model, "
                        "since admission tokenizes (default: %(default)s)")
    p.add_argument("--max-concurrent", type=positive_int, default=settings.MAX_CONCURRENT_REQUESTS,
                   help="requests in flight beyond which admission answers RESOURCE_EXHAUSTED (default: %(default)s)")
    p.add_argument("--tag-workers", type=int, default=settings.TAG_WORKERS,
                   help="worker processes that tokenize and tag large requests (0: all inline on the event "
                        "loop, for debugging) (default: %(default)s)")
    p.add_argument("--max-request-seconds", type=float, default=settings.MAX_REQUEST_LIFETIME_S,
                   help="lifetime of a request whose caller set no deadline; past it the call ends with "
                        "DEADLINE_EXCEEDED (default: %(default)s)")
    p.add_argument("--resume-wait", type=float, default=settings.ADMISSION_RESUME_WAIT_S, metavar="SECONDS",
                   help="how long a request its pipeline dropped (a coordinator died or handed it back) waits for "
                        "a pipeline to continue it on, within its deadline, before it fails with the pipeline's "
                        "status (default: %(default)s, the coordinators' recovery window)")
    service_main.add_flags(p, public=True, log_levels=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--reflection", action="store_true",
                   help="serve gRPC server reflection on this public port (off by default: it lists every method to "
                        "anyone; the internal services keep it for operators' tools)")
    return p


def load_model_limits(model: str) -> tuple[Path, ModelLimits, str]:
    """The folder, tokenizer, limits and chat template of `model`, and its fingerprint (which the coordinator
    must report too). A template that does not compile stops admission here, not on the first conversation."""
    folder = resolve_model(model)
    fingerprint = checked_fingerprint(folder)   # before reading its tokenizer: refuses a folder changed since made
    return folder, model_limits(folder), fingerprint


def http_face(door: FrontDoor, args: argparse.Namespace) -> "HttpFace":
    """The OpenAI-compatible HTTP server of `door`, bound to --host:--http-port, TLS as the gRPC port's."""
    from services.admission.openai_api.app import build_app   # FastAPI is imported only when HTTP is served
    from services.admission.openai_api.serve import HttpFace
    tls_files = (args.tls_ca, args.tls_cert, args.tls_key) if args.tls is not None else None
    try:
        return HttpFace(build_app(door), args.host, args.http_port, tls_files,
                        require_client_auth=args.tls is not None and args.tls.require_client_auth)
    except OSError as e:
        raise ports.bind_error(args.host, args.http_port, "--http-port", e) from e


async def serve(args: argparse.Namespace) -> None:
    folder, limits, fingerprint = load_model_limits(args.model)
    work = FrontWork(folder, limits, args.tag_workers)
    work.warm_up()   # before listening, on this thread (see warm_up): the first large request pays no start-up
    try:
        tenants = read_tenants_file(args.tenants) if args.tenants else {}
        tenant_limits = TenantLimits.from_config(tenants, args.tenants) if args.tenants else None
        api_keys = ApiKeys.from_config(tenants, args.tenants or "")
    except ValueError as e:
        raise SystemExit(f"tether admission: {e}") from None
    if api_keys.active:
        log.info("API keys required: %d key(s) of %d tenant(s)", len(api_keys.by_digest),
                 len({p.tenant for p in api_keys.by_digest.values()}))
    else:
        log.warning("tenants are unauthenticated: no API key is configured (api_keys_sha256 in --tenants FILE), "
                    "so each request's tenant (cache namespace, limits) and priority are whatever its caller claims")
    pipelines = Pipelines(args.coordinator, fingerprint, CoordinatorSession, args.route_policy, tls=args.tls)
    server = Server(args.host, args.port, [SERVICE_NAME], max_message_bytes=settings.ADMISSION_MAX_MESSAGE_BYTES,
                    max_connection_age_s=settings.ADMISSION_MAX_CONNECTION_AGE_S, tls=args.tls,
                    reflection_on=args.reflection)
    registry = metrics.new_registry() if args.metrics_port else None
    door = FrontDoor(pipelines, limits, fingerprint, args.max_concurrent, args.max_request_seconds, work=work,
                     tenant_limits=tenant_limits, api_keys=api_keys, resume_wait_s=args.resume_wait)
    door.model_name = os.path.basename(os.path.normpath(args.model)) or args.model   # "tiny", a folder's name
    if registry is not None:
        registry.register(metrics.PipelinesCollector(pipelines))
        door.metrics = metrics.AdmissionMetrics(registry, lambda: door.limit.active, args.max_concurrent,
                                                lambda: door.ready)
    admission_pb2_grpc.add_AdmissionServicer_to_server(AdmissionServicer(door), server.server)
    http = None if args.no_http else http_face(door, args)   # binds now: a port in use fails before serving
    bound = {"--port": server.port} | ({"--http-port": http.port} if http is not None else {})
    service_main.report_ports(args, bound, ready=False)
    # NOT_SERVING until the readiness loop has seen a pipeline serve our model.
    await server.set_serving(False)
    await server.start()
    if http is not None:
        await http.start()
    async def not_ready(error: BaseException) -> None:
        door.set_ready(False, f"readiness check failed: {error!r}")
        await server.set_serving(False)

    readiness = supervise.start("readiness", lambda: follow_readiness(server, door), not_ready)
    pipelines.start()   # each pipeline's load, and the set of pipelines behind `dns:` names
    if registry is not None:
        bound["--metrics-port"] = service_main.serve_metrics("admission", registry, args.metrics_host,
                                                             args.metrics_port)
    service_main.report_ports(args, bound, ready=True)
    logs.announce(log, f"admission listening on {args.host}:{server.port} (pipelines {', '.join(pipelines.links)}, "
                       f"model {args.model} {fingerprint})")
    if http is not None:
        logs.announce(log, f"admission OpenAI-compatible API at {http.base_url}")
    try:
        await server.wait_for_signal()
    finally:
        if http is not None:
            await http.stop()
        readiness.cancel()
        work.close()
        await pipelines.close()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    # Only OSError (e.g. a --port or --metrics-port in use) and a changed model folder are fatal in one line:
    # serve words its own bad input.
    service_main.run("admission", parser, parser.parse_args(argv), serve, experiments=False,
                     fatal=(OSError, ModelFolderChanged))
