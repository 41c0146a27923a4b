"""A real cluster on loopback: each service its own process, talking gRPC, started like `tether up`."""

from __future__ import annotations

import time

import grpc
import pytest

from tether.cli.cluster import LocalCluster
from tether.v1 import stage_pb2, stage_pb2_grpc




def _held(cluster: LocalCluster, request_id: str) -> list[bool]:
    """Whether each stage holds state for the request (SyncState, straight to the stages)."""
    out = []
    for svc in cluster.services:
        if svc.name.startswith("stage"):
            with grpc.insecure_channel(svc.address) as ch:
                reply = stage_pb2_grpc.StageStub(ch).SyncState(
                    stage_pb2.SyncRequest(request_ids=[request_id]), timeout=5)
            out.append(reply.states[0].held)
    return out


def _wait_released(cluster: LocalCluster, request_id: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_held(cluster, request_id)):
        if time.monotonic() > deadline:
            raise AssertionError(f"{request_id} still held after {timeout:.0f}s: {_held(cluster, request_id)}")
        time.sleep(0.1)


@pytest.fixture
def held():
    return _held


@pytest.fixture
def wait_released():
    return _wait_released
