"""`python -m tether.cli.healthcheck HOST:PORT`: exit 0 if the service's gRPC health says SERVING, else 1.

The container health check of every tether service (see docker-compose.yml): it needs nothing but the Python
the image already has. It asks the standard grpc.health.v1 Check (by default for the whole server, service
name ""), with a short deadline, so a service that is up but not ready (a coordinator whose pipeline is not
assembled, an admission whose coordinator is not serving) is reported unhealthy, as is one that is down or hung.

With TLS (--tls-ca/--tls-cert/--tls-key, defaults from TETHER_TLS_CA/CERT/KEY like the services' own, so a
container's environment configures both) it verifies the service against the CA and presents the certificate:
the service's own, since internal services accept only certificates of their CA.

Exit status follows Docker's HEALTHCHECK convention: 0 healthy, 1 unhealthy. A usage error also exits 1
(Docker reserves 2), so a misconfigured check shows up as an unhealthy container rather than a mystery.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_TIMEOUT_S = 2.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would exit 2, which Docker reserves
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m tether.cli.healthcheck",
        description="Ask a tether service's gRPC health (grpc.health.v1) whether it is SERVING. "
                    "Exit 0 if it is; 1 if it is not, cannot be reached, or does not answer in time.")
    p.add_argument("target", metavar="HOST:PORT", help="address of the service, e.g. 127.0.0.1:50051")
    p.add_argument("--service", default="",
                   help="health service name to ask about (default: \"\", the server as a whole)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds to wait for the answer (default: %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing, only set the exit status")
    from tether.security.tls import env_defaults
    env = env_defaults()
    p.add_argument("--tls-ca", metavar="PEM", default=env["ca"],
                   help="CA to verify the service with; with it the check speaks TLS (default: $TETHER_TLS_CA; "
                        "none: plaintext)")
    p.add_argument("--tls-cert", metavar="PEM", default=env["cert"],
                   help="certificate to present (default: $TETHER_TLS_CERT)")
    p.add_argument("--tls-key", metavar="PEM", default=env["key"], help="its key (default: $TETHER_TLS_KEY)")
    return p


def check(target: str, service: str = "", timeout: float = DEFAULT_TIMEOUT_S, tls_ca: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None) -> tuple[bool, str]:
    """(serving?, what was seen) for one Check call against `target`; over TLS when `tls_ca` is given."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # A health check of a local port must never go through an HTTP proxy from the environment.
    options = [("grpc.enable_http_proxy", 0)]
    if tls_ca:
        from tether.security.tls import client_channel_credentials
        try:
            creds = client_channel_credentials(tls_ca, tls_cert, tls_key)
        except (OSError, ValueError) as e:
            return False, f"TLS configuration: {e}"
        ch = grpc.secure_channel(target, creds, options=options)
    else:
        ch = grpc.insecure_channel(target, options=options)
    with ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=timeout)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            return False, f"{code.name if code else 'ERROR'}: {e.details() if hasattr(e, 'details') else e}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, name


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    on = args.tls_cert or args.tls_ca   # TLS with a certificate, or with a CA that verifies the server
    tls = (args.tls_ca, args.tls_cert, args.tls_key) if on else (None, None, None)
    ok, seen = check(args.target, args.service, args.timeout, *tls)
    if not args.quiet:
        print(f"{args.target}{'/' + args.service if args.service else ''}: {seen}",
              file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
