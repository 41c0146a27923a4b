"""`tether drain --coordinator HOST:PORT`: take one pipeline out of service without failing a request.

It calls the coordinator's Drain (the same drain SIGTERM starts, services/coordinator/drain.py) and returns once
the drain has started: exit 0 then, 1 when the coordinator cannot be reached or refuses (the reason printed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

from tether import settings
from tether.security import certs, identity
from tether.security.tls import client_channel_credentials
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc

CALL_TIMEOUT_S = 10.0   # the call answers at once; this only bounds an unreachable or wedged coordinator


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether drain",
        description="Drain one coordinator (one pipeline): from now on it takes no new request, and its load "
                    "report says draining, so admission sends new work to the other pipelines at once; what it "
                    "runs and ends within the drain deadline ends there, and the rest is handed back to "
                    "admission, which continues each request on another pipeline from the tokens it already has "
                    "(the caller sees one uninterrupted stream). The same drain SIGTERM starts. Returns as soon as "
                    "the drain has started; asking again is harmless (it can only bring the deadline nearer).",
        epilog="Exit status: 0 the drain started (or was under way), 1 the coordinator could not be reached or "
               "refused (e.g. PERMISSION_DENIED: under mutual TLS only the operator and admission certificates "
               "may drain), 2 a usage error. Afterwards the coordinator keeps refusing work until it is restarted, "
               "unless --exit asked it to stop once drained.")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                   help=f"the coordinator's gRPC address: its --port ({settings.COORDINATOR_PORT} in the containers); "
                        "`tether up` lists where its coordinators listen")
    p.add_argument("--drain-seconds", type=float, default=0.0, metavar="N",
                   help="how long its running requests may finish there before they are handed back "
                        f"(0 to {settings.MAX_REQUEST_LIFETIME_S:g}; default 0: the coordinator's own "
                        f"--drain-seconds, {settings.DRAIN_S:g} s unless set)")
    p.add_argument("--exit", action="store_true",
                   help="stop the coordinator once drained, as SIGTERM would (default: it stays up, serving "
                        "nothing, so that it can be inspected)")
    p.add_argument("--tls-dir", type=Path, default=None, metavar="DIR",
                   help="a `tether certs init` folder: verify the coordinator against DIR/ca.pem (its "
                        "certificate must carry the coordinator identity) and present DIR/operator.pem and "
                        "DIR/operator.key (default: plaintext)")
    p.add_argument("--timeout", type=float, default=CALL_TIMEOUT_S, metavar="SECONDS",
                   help="give up on a coordinator that does not answer this long (default: %(default)s)")
    return p


def _channel(target: str, tls_dir: Path | None) -> grpc.Channel:
    # An operator's call to a coordinator address never goes through an HTTP proxy from the environment.
    options: list[tuple[str, str | int]] = [("grpc.enable_http_proxy", 0)]
    if tls_dir is None:
        return grpc.insecure_channel(target, options=options)
    creds = client_channel_credentials(certs.ca_path(tls_dir), tls_dir / "operator.pem", tls_dir / "operator.key")
    # Only a certificate with the coordinator identity's name passes: a drain is never sent to anyone else.
    options.append(("grpc.ssl_target_name_override", identity.COORDINATOR.server_name))
    return grpc.secure_channel(target, creds, options=options)


def drain(target: str, seconds: float = 0.0, exit_after: bool = False, tls_dir: Path | None = None,
          timeout: float = CALL_TIMEOUT_S) -> coordinator_pb2.DrainReply:
    """Ask the coordinator at `target` to drain (grpc.RpcError when it cannot be reached or refuses)."""
    with _channel(target, tls_dir) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        return stub.Drain(coordinator_pb2.DrainRequest(deadline_seconds=seconds, exit=exit_after),
                          timeout=timeout, wait_for_ready=False)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.drain_seconds <= settings.MAX_REQUEST_LIFETIME_S:
        parser.error(f"--drain-seconds must be 0 to {settings.MAX_REQUEST_LIFETIME_S:g}")
    try:
        reply = drain(args.coordinator, args.drain_seconds, args.exit, args.tls_dir, args.timeout)
    except (OSError, ValueError) as e:   # the --tls-dir files
        sys.exit(f"tether drain: cannot use the certificates in {args.tls_dir}: {e}")
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            sys.exit(f"tether drain: cannot reach a coordinator at {args.coordinator} "
                     f"({code.name}: {details})")
        if code == grpc.StatusCode.UNIMPLEMENTED:
            sys.exit(f"tether drain: {args.coordinator} has no Drain call (not a coordinator, or an older one)")
        sys.exit(f"tether drain: {args.coordinator} refused the drain ({code.name if code else 'ERROR'}: "
                 f"{details})")
    what = "drain started" if reply.started else "already draining"
    then = "then it exits" if args.exit else "then it stays up, taking no request, until restarted"
    print(f"{args.coordinator}: {what}; {reply.running} request(s) active, handed back to admission in at most "
          f"{reply.deadline_seconds:.1f} s if not finished; {then}")
