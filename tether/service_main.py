"""The start-up and metrics endpoint every service's `main()` shares, so each main.py keeps only its own flags and wiring.

A service (services/{admission,coordinator,stage_worker}/main.py) builds its parser and its `serve(args)`
coroutine; `run` does the rest the same way for all three: die with the parent (tether/procutil.py), the heap's
thresholds (tether/heap.py), logs,
tracing, the experiment flags, TLS from the flags, then the event loop until SIGINT/SIGTERM (the coroutine
ends in `grpcutil.Server.wait_for_signal`, which drains in-flight calls).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import CollectorRegistry

from tether import heap, telemetry
from tether.ports import EXIT_PORT_IN_USE, PortInUse, Report, write_report
from tether.procutil import follow_parent
from tether.security import tls
from tether.telemetry import logs, metrics, tracing


def add_flags(parser: argparse.ArgumentParser, *, public: bool = False, log_levels: list[str] | None = None) -> None:
    """The flags `run` reads, declared alike on every service: --log-level (restricted to `log_levels` when
    given), telemetry's (--metrics-port, --log-format, --otlp-endpoint) and TLS's (`public`: admission's port,
    which any client may reach)."""
    parser.add_argument("--log-level", default="INFO", choices=log_levels, help="logging level (default: %(default)s)")
    parser.add_argument("--port-file", metavar="PATH",
                        help="write the ports this service listens on to PATH (JSON) once bound, again once it serves, "
                             "or the port error that stopped it: how a launcher that passes --port 0 learns the "
                             "port the kernel gave (`tether up` does for its internal services)")
    telemetry.add_flags(parser)
    tls.add_flags(parser, public=public)


def run(name: str, parser: argparse.ArgumentParser, args: argparse.Namespace,
        serve: Callable[[argparse.Namespace], Coroutine[Any, Any, None]], *, experiments: bool = True,
        fatal: tuple[type[BaseException], ...] = (OSError, ValueError)) -> None:
    """Start service `name` ("stage", "coordinator", "admission": its log and trace name) from its parsed
    `args` (a parser with `add_flags`) and run `serve(args)` to its end. With `experiments`, the parser has tether.faults' experiment
    flags and `args.fault_config` is set from them; `args.tls` is always set (None: plaintext). A bad flag
    value is a usage error (exit 2); a port in use ends it with one line and exit code EXIT_PORT_IN_USE (78: the
    launcher does not restart it), reported in --port-file too; an error of a type in `fatal` out of `serve` (a
    missing model folder) ends the process with one line, `tether NAME: error`, instead of a traceback."""
    follow_parent()
    heap.keep_freed_memory()   # a step's temporaries reuse the heap, not fresh pages (tether/heap.py)
    logs.configure(name, args.log_level, args.log_format)
    tracing.configure(name, args.otlp_endpoint)   # off unless --otlp-endpoint or OTEL_EXPORTER_OTLP_*
    if experiments:
        from tether.faults import experiment_config   # admission has no experiment flags
        args.fault_config = experiment_config(parser, args, logging.getLogger(name))
    try:
        args.tls = tls.from_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        asyncio.run(serve(args))
    except PortInUse as e:
        if args.port_file:
            write_report(args.port_file, Report({}, error=str(e), flag=e.flag, port=e.port))
        print(f"tether {name}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PORT_IN_USE) from None
    except fatal as e:
        raise SystemExit(f"tether {name}: {e}") from None


def report_ports(args: argparse.Namespace, ports: dict[str, int], ready: bool) -> None:
    """Tell the launcher (--port-file, when given) the ports bound, by flag; `ready`: every one of them serves."""
    if getattr(args, "port_file", None):
        write_report(args.port_file, Report(dict(ports), ready=ready))


def serve_metrics(name: str, registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `registry` on http://host:port/metrics (--metrics-port; 0 picks a free port), announce where, and
    return the port."""
    port = metrics.serve(registry, host, port)
    logs.announce(logging.getLogger(name), f"{name} metrics on http://{host}:{port}/metrics")
    return port
