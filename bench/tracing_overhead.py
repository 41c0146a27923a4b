"""What tracing costs: `tether bench` throughput with every service tracing every request (sampler always_on,
exporting over OTLP/gRPC to a local receiver), divided by tracing off.

Two local clusters run side by side for the whole run, identical but for the OTel environment of the traced
one (OTEL_EXPORTER_OTLP_ENDPOINT pointing at a receiver in this process, OTEL_TRACES_SAMPLER=always_on, the
batch span processor's defaults). Each repeat sends the same `tether bench` level to both at the same time, so
that whatever else loads a shared machine loads both sides alike (bench/metrics_overhead.py explains why);
the figure is the median over repeats of on ÷ off output-token throughput. The receiver takes each export
request as bytes and counts them (a collector on another machine would decode them there): the services'
whole cost, spans, links, batching, serialization and the export calls, is in.

    .venv/bin/python bench/tracing_overhead.py                       # tiny, 2 stages, 5 repeats
    .venv/bin/python bench/tracing_overhead.py --repeats 10 --num-requests 32

Figures: docs/PERFORMANCE.md, "Overheads".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # spinning OpenMP threads starve the other processes
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402

from side_by_side import add_level_flags, bench, summarize, together  # noqa: E402
from tether.cli.cluster import LocalCluster  # noqa: E402 - after the environment is set

_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class CountingReceiver:
    """An OTLP/gRPC TraceService endpoint that answers every Export with an empty response and counts bytes."""

    def __init__(self) -> None:
        self.requests = self.bytes = 0
        self.lock = threading.Lock()

        def export(request: bytes, context) -> bytes:
            with self.lock:
                self.requests += 1
                self.bytes += len(request)
            return b""   # an empty ExportTraceServiceResponse

        handler = grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService", {
            "Export": grpc.unary_unary_rpc_method_handler(export)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_level_flags(p, "off/on pairs, loaded together")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    receiver = CountingReceiver()
    logs = Path(tempfile.mkdtemp(prefix="tether-tracing-overhead-"))
    off = LocalCluster(model=args.model, stages=args.stages, threads=args.threads, log_dir=logs / "off")
    on = LocalCluster(model=args.model, stages=args.stages, threads=args.threads, log_dir=logs / "on")
    traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_TRACES_SAMPLER": "always_on"}
    for k in (*traced, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        os.environ.pop(k, None)   # the untraced side and the bench clients: no tracing from the caller's shell
    pairs = []
    try:
        off.start(timeout=300)
        os.environ.update(traced)      # LocalCluster hands its children this process's environment
        try:
            on.start(timeout=300)
        finally:
            for k in traced:
                os.environ.pop(k, None)
        for r in range(args.repeats):
            before = receiver.requests
            result = together({side: lambda side=side, c=c, r=r: bench(c.target, args, logs / f"bench-{r}-{side}")
                               for side, c in (("off", off), ("on", on))})
            ratio = result["on"]["output_token_throughput"] / result["off"]["output_token_throughput"]
            pairs.append(dict(off=result["off"]["output_token_throughput"], on=result["on"]["output_token_throughput"],
                              ratio=ratio, exports=receiver.requests - before))
            print(f"repeat {r + 1}/{args.repeats}: off {pairs[-1]['off']:.1f} tok/s, on {pairs[-1]['on']:.1f} "
                  f"tok/s, on/off {ratio:.3f} ({pairs[-1]['exports']} exports)", flush=True)
    finally:
        on.stop()
        off.stop()
        receiver.server.stop(grace=None)
    assert receiver.requests, "the traced cluster exported nothing: is tracing on?"
    summary = summarize("tracing on / off", pairs, args, exports=receiver.requests, export_bytes=receiver.bytes)
    print(f"{receiver.requests} exports, {receiver.bytes / 2**20:.1f} MiB", flush=True)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
