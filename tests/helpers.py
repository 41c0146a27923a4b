"""Small helpers that several test files share: a clock the test moves by hand, whether a process lives, what a
live cluster's stages and coordinator hold, and a model fed one request chunk by chunk."""

from __future__ import annotations

import os
import re
import time
import urllib.request

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


def stage_state(cluster: LocalCluster) -> list[tuple[int, int]]:
    """(requests held, KV tokens used) of each stage of a live cluster, from its Stats."""
    out = []
    for svc in cluster.services:
        if svc.name.startswith("stage"):
            with grpc.insecure_channel(svc.address) as ch:
                s = stage_pb2_grpc.StageStub(ch).Stats(stage_pb2.StageStatsRequest(), timeout=5)
            out.append((s.requests_held, s.kv_used_tokens))
    return out


def coordinator_running(cluster: LocalCluster) -> tuple[int, int]:
    """(running, waiting) requests of a live cluster's coordinator, from its Stats."""
    with grpc.insecure_channel(cluster.service("coordinator").address) as ch:
        s = coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=5)
    return s.running, s.waiting


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
