"""/metrics under a scrape flood, and where it listens.

A burst of concurrent scrapes reaches a service's state once per snapshot age (counted at the stage's model
thread, on a real StageServicer), the endpoint serves a bounded number of connections at once (the rest get 503
at once, and the flood holds no more threads), and every service's /metrics binds --metrics-host (loopback by
default), not its gRPC --host (real stage processes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.helpers import Clock
from tether import settings
from tether.cli.cluster import free_port
from tether.telemetry import metrics, metrics_http
from tether.v1 import stage_pb2

ROOT = Path(__file__).resolve().parents[3]
BURST = 32


def _get(url: str, timeout: float = 30.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _burst(url: str, n: int = BURST) -> list[int]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _get(url), range(n)))


def test_a_burst_of_scrapes_fetches_once_per_snapshot_age():
    clock = Clock()
    calls = []
    snapshot = metrics.CachedSnapshot(lambda: calls.append(1) or stage_pb2.StageStats(steps=len(calls)),
                                      max_age_s=1.0, clock=clock)
    registry = CollectorRegistry()
    registry.register(metrics.StageCollector(snapshot))
    server = metrics_http.start(registry, "127.0.0.1", 0, workers=BURST)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert _burst(url) == [200] * BURST
        assert len(calls) == 1, "every scrape within the snapshot's age reads the one snapshot"
        clock.t += 0.999
        assert _get(url) == 200 and len(calls) == 1
        clock.t += 0.001
        assert _burst(url) == [200] * BURST
        assert len(calls) == 2
    finally:
        server.shutdown()
        server.server_close()


def test_a_failed_fetch_is_not_cached():
    outcomes = iter([RuntimeError("loop busy"), stage_pb2.StageStats(steps=3)])

    def fetch():
        x = next(outcomes)
        if isinstance(x, Exception):
            raise x
        return x
    snapshot = metrics.CachedSnapshot(fetch, max_age_s=60.0)
    with pytest.raises(RuntimeError):
        snapshot()
    assert snapshot().steps == 3 and snapshot().steps == 3 and snapshot.fetches == 1


def test_the_endpoint_serves_a_bounded_number_of_connections():
    """While every worker is held (a collection that blocks), further scrapes are answered 503 at once, and the
    process starts no thread for them."""
    release, entered = threading.Event(), threading.Semaphore(0)

    def slow():
        entered.release()
        release.wait(30)
        return stage_pb2.StageStats()
    registry = CollectorRegistry()
    registry.register(metrics.StageCollector(slow))    # uncached: each served scrape enters
    server = metrics_http.start(registry, "127.0.0.1", 0, workers=2)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    with concurrent.futures.ThreadPoolExecutor(2) as held:
        try:
            first = [held.submit(_get, url) for _ in range(2)]
            assert entered.acquire(timeout=30) and entered.acquire(timeout=30)   # both workers are busy now
            threads = threading.active_count()
            assert _burst(url, 16) == [503] * 16
            assert threading.active_count() == threads, "a refused connection must not start a thread"
            assert server.refused == 16
        finally:
            release.set()
        assert [f.result(30) for f in first] == [200, 200]
    assert _get(url) == 200     # the workers are free again
    server.shutdown()
    server.server_close()


class _CountingExecutor(concurrent.futures.Executor):
    """The stage's step-thread executor, counting the work handed to it."""

    def __init__(self, inner: concurrent.futures.Executor) -> None:
        self.inner, self.submitted = inner, 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        return self.inner.submit(fn, *args, **kwargs)


def test_a_scrape_flood_reaches_the_stage_model_thread_once():
    """The stage's collector as main.py wires it (loop_snapshot of its Stats), on a real StageServicer: BURST
    concurrent scrapes hand the model thread one snapshot, not BURST."""
    from services.stage_worker.server import StageServicer
    from services.stage_worker.worker import StageWorker
    from tether.model.loader import load_slice, model_fingerprint, resolve_model

    folder = resolve_model("tiny")
    servicer = StageServicer(StageWorker(load_slice(folder, 0, 2), 0, 1024), model_fingerprint(folder),
                             "127.0.0.1:1")
    counting = servicer.executor = _CountingExecutor(servicer.executor)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    registry = CollectorRegistry()
    registry.register(metrics.StageCollector(metrics.loop_snapshot(
        loop, lambda: servicer.Stats(stage_pb2.StageStatsRequest(), None), max_age_s=3600)))
    server = metrics_http.start(registry, "127.0.0.1", 0, workers=BURST)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert _burst(url) == [200] * BURST
        assert counting.submitted == 1
        with urllib.request.urlopen(url, timeout=30) as r:
            assert b"tether:stage_kv_blocks_total" in r.read()
        assert counting.submitted == 1
    finally:
        server.shutdown()
        server.server_close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)


# --------------------------------------------------------------------------------------------- --metrics-host

@pytest.mark.parametrize("module", ["services.stage_worker", "services.coordinator", "services.admission"])
def test_every_service_takes_metrics_host_defaulting_to_loopback(module):
    import importlib
    parser = importlib.import_module(f"{module}.main").build_parser()
    required = ["--stages", "127.0.0.1:1"] if module == "services.coordinator" else []
    assert parser.parse_args(required).metrics_host == settings.METRICS_HOST == "127.0.0.1"
    assert parser.parse_args(required + ["--metrics-host", "0.0.0.0"]).metrics_host == "0.0.0.0"


def _reachable(host: str, port: int) -> bool:
    try:
        return _get(f"http://{host}:{port}/metrics", timeout=5) == 200
    except (urllib.error.URLError, OSError):
        return False


def test_stage_metrics_bind_metrics_host_not_the_grpc_host():
    """Two real stages serving gRPC on 127.0.0.2: one with the default --metrics-host (its /metrics answers on
    127.0.0.1 only), one with --metrics-host 127.0.0.3 (there only)."""
    import grpc

    from tether.cli.cluster import wait_serving
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    cases = [([], "127.0.0.1"), (["--metrics-host", "127.0.0.3"], "127.0.0.3")]
    procs = []
    try:
        for extra, _ in cases:
            port, mport = free_port("127.0.0.2"), free_port("127.0.0.1")
            argv = [sys.executable, "-m", "services.stage_worker", "--host", "127.0.0.2", "--port", str(port),
                    "--model", "tiny", "--threads", "1", "--metrics-port", str(mport), *extra]
            procs.append((subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE), port, mport))
        for (proc, port, mport), (_, metrics_host) in zip(procs, cases):
            def exited(proc=proc) -> None:
                if proc.poll() is not None:
                    raise AssertionError(f"the stage exited: {proc.stderr.read().decode()[-2000:]}")
            with grpc.insecure_channel(f"127.0.0.2:{port}") as channel:
                assert wait_serving(channel, 120, exited)
            assert _reachable(metrics_host, mport)
            others = {"127.0.0.1", "127.0.0.2", "127.0.0.3"} - {metrics_host}
            assert not any(_reachable(h, mport) for h in others), f"/metrics must listen on {metrics_host} only"
    finally:
        for proc, _, _ in procs:
            proc.terminate()
        for proc, _, _ in procs:
            proc.wait(30)
