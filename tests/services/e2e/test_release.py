"""Finished and abandoned requests leave no state on any stage."""

from __future__ import annotations

import time

import grpc

from tether.client import Client
from tether.v1 import stage_pb2, stage_pb2_grpc


def _held(cluster, request_id: str) -> list[bool]:
    held = []
    for name in ("stage0", "stage1"):
        with grpc.insecure_channel(cluster.service(name).address) as ch:
            reply = stage_pb2_grpc.StageStub(ch).SyncState(stage_pb2.SyncRequest(request_ids=[request_id]), timeout=5)
            held.append(reply.states[0].held)
    return held


def _wait_released(cluster, request_id: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_held(cluster, request_id)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{request_id} still held: {_held(cluster, request_id)}")


def test_client_disconnect_releases_state_on_every_stage(cluster):
    rid = "disconnect-test-1"
    with Client(cluster.target) as client:
        stream = client.stream("a long answer please", max_tokens=1500, ignore_eos=True, request_id=rid)
        for k, _ in enumerate(stream):
            if k == 3:
                assert all(_held(cluster, rid))     # mid-generation: both stages hold it
                break                               # leaving the stream cancels the call
    _wait_released(cluster, rid)


def test_finished_request_is_released(cluster):
    rid = "finished-test-1"
    with Client(cluster.target) as client:
        client.generate("short", max_tokens=3, request_id=rid)
    _wait_released(cluster, rid)
