"""Small helpers that several test files share: a clock the test moves by hand, whether a process lives, a
cluster started for a block, what a live cluster's stages and coordinator hold, the reference's answer, a frame
answered as the driver does, and a model fed one request chunk by chunk."""

from __future__ import annotations

import contextlib
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from tether.cli.cluster import LocalCluster
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc


class Clock:
    """A clock for code that takes `clock=`: it reads `t`, which only the test moves."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a zombie is dead for the tests' purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def started(tmp_path_factory, timeout: float = 180, **options: Any) -> Iterator[LocalCluster]:
    """A LocalCluster started (within `timeout` s) for the block and stopped when it ends, however it ends: a
    test module's own cluster is `with started(tmp_path_factory, extra=...) as c: yield c`. `options` are
    LocalCluster's; unless they say otherwise, the tiny model on 2 stages of 1 thread each, logging to a fresh
    folder (the `cluster` fixture's settings, tests/conftest.py)."""
    options = {"model": "tiny", "stages": 2, "threads": 1, **options}
    if "log_dir" not in options:
        options["log_dir"] = tmp_path_factory.mktemp("logs")
    cluster = LocalCluster(**options)
    try:
        cluster.start(timeout=timeout)   # a start that fails stops what it had started too
        yield cluster
    finally:
        cluster.stop()


def tenants_file(tmp_path_factory, text: str) -> Path:
    """Admission's tenants file (`--tenants FILE`) holding `text`, in a fresh folder."""
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(text)
    return path


def stage_stats(cluster: LocalCluster) -> list[stage_pb2.StageStats]:
    """The Stats of each stage of a live (plaintext) cluster, in the cluster's order."""
    out = []
    for svc in cluster.services:
        if svc.name.startswith("stage"):
            with grpc.insecure_channel(svc.address) as ch:
                out.append(stage_pb2_grpc.StageStub(ch).Stats(stage_pb2.StageStatsRequest(), timeout=5))
    return out


def coordinator_stats(cluster: LocalCluster) -> coordinator_pb2.StatsReply:
    """The Stats of a live (plaintext) cluster's coordinator."""
    with grpc.insecure_channel(cluster.service("coordinator").address) as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=5)


def stage_state(cluster: LocalCluster) -> list[tuple[int, int]]:
    """(requests held, KV tokens used) of each stage of a live cluster, from its Stats."""
    return [(s.requests_held, s.kv_used_tokens) for s in stage_stats(cluster)]


def coordinator_running(cluster: LocalCluster) -> tuple[int, int]:
    """(running, waiting) requests of a live cluster's coordinator, from its Stats."""
    s = coordinator_stats(cluster)
    return s.running, s.waiting


def exact_ids(prompt: str, max_tokens: int) -> list[int]:
    """The token ids the tiny model's reference generates for `prompt`, EOS ignored: what a cluster serving
    "tiny" must answer, token for token."""
    from tether import reference   # imports torch: only where a test asks

    return reference.generate(prompt, "tiny", max_tokens=max_tokens, ignore_eos=True).token_ids


def answer_frame(sched, batch: list, token: int = 66) -> None:
    """What the coordinator's driver does when every echo of a frame of `batch` matches: free the frame slot,
    confirm each request's stamp with the scheduler (`Scheduler.confirmed`: the ledger caches its new full
    blocks) and append `token` to those that sampled (a prefill chunk samples nothing)."""
    from services.stage_worker.worker import echo

    sched.frame_done()
    for r in batch:
        assert r.echo_matches(echo(r.sent))
        samples = r.samples
        r.frame_over()
        sched.confirmed(r)
        if samples:
            r.seq.append(token)


def run_chunks(slices, ids: list[int], chunks: list[int]):
    """Logits at every position of one request, fed through the model `slices` (a whole model or a pipeline
    split) chunk by chunk: what the invariance tests compare across splits and chunkings."""
    import torch

    from tether.model.llama import SlotRows

    kvs = [s.new_kv() for s in slices]
    out, pos = [], 0
    for c in chunks:
        x = torch.tensor(ids[pos:pos + c])
        for s, kv in zip(slices, kvs):
            kv.ensure(pos + c)
            x = s(x, [SlotRows(kv, pos, c)])
            kv.length = pos + c
        out.append(slices[-1].logits(x))
        pos += c
    return torch.cat(out)


def wait_admission_routes_every_pipeline(cluster: LocalCluster, timeout: float = 30.0) -> None:
    """Until admission's /metrics (the cluster runs with metrics on) shows every pipeline up: admission is SERVING
    with its first pipeline and learns of the others from their load reports, a moment later."""
    url = cluster.service("admission").metrics_url
    assert url is not None, "wait_admission_routes_every_pipeline needs a cluster with metrics=True"
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=5) as r:
            up = re.findall(r'^tether:pipeline_up\{[^}]*\} (\S+)$', r.read().decode(), re.M)
        if len(up) == cluster.pipelines and all(float(v) == 1.0 for v in up):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"admission routes to {up} of {cluster.pipelines} pipelines after {timeout:.0f} s")
        time.sleep(0.05)


def second_dtype(model: str = "tiny") -> str:
    """A dtype besides float32 that this machine serves `model` in exactly (bf16 where its kernels are
    invariant here, else fp16): what a pipeline that mixes numerics is made of. Skips where there is none."""
    import pytest

    from tether.model import numerics
    from tether.model.config import ModelConfig
    from tether.model.loader import resolve_model

    cfg = ModelConfig.from_folder(resolve_model(model))
    for name in ("bfloat16", "float16"):
        if numerics.servable_rule(cfg, numerics.DTYPES[name]) is not None:
            return name
    pytest.skip("no dtype besides float32 has batch-invariant kernels on this CPU")
    raise AssertionError("unreachable")
