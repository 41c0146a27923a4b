"""Telemetry shared by every service: Prometheus metrics (metrics.py) and structured logs (logs.py).

and OpenTelemetry traces over OTLP (tracing.py). The services call one setup function per concern from their
main.py; on the serving paths tracing is one `tracing.TRACER is not None` check while it is off.
"""

from __future__ import annotations

import argparse

from tether import settings


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--metrics-host, --metrics-port, --log-format and --otlp-endpoint, the same on every service."""
    from tether.telemetry import tracing
    parser.add_argument("--metrics-host", default=settings.METRICS_HOST, metavar="HOST",
                        help="address /metrics listens on, apart from --host: loopback by default, since the "
                             "metrics show load, tenants and pipelines; a Prometheus on another machine needs "
                             "0.0.0.0 and a firewall or NetworkPolicy on the port (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=settings.METRICS_PORT, metavar="PORT",
                        help="serve Prometheus metrics on http://HOST:PORT/metrics (HOST: --metrics-host); 0 turns them "
                             "off (default: %(default)s; `tether up --metrics`, docker-compose.yml and deploy/k8s "
                             f"use admission {settings.ADMISSION_METRICS_PORT}, coordinator "
                             f"{settings.COORDINATOR_METRICS_PORT}, stage i {settings.STAGE_METRICS_BASE_PORT}+i)")
    parser.add_argument("--log-format", default=settings.LOG_FORMAT, choices=settings.LOG_FORMATS,
                        help="text: one readable line per record; json: one JSON object per line with ts, level, "
                             "service, logger, message and, on lines about a request, request_id "
                             "and, when the request is traced, trace_id (default: %(default)s)")
    tracing.add_flags(parser)
