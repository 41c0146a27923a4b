"""Finished and abandoned requests leave no state on any stage."""

from __future__ import annotations

from tether.client import Client


def test_client_disconnect_releases_state_on_every_stage(cluster, held, wait_released):
    rid = "disconnect-test-1"
    with Client(cluster.target, retry=None) as client:
        stream = client.stream("a long answer please", max_tokens=1500, ignore_eos=True, request_id=rid)
        for k, _ in enumerate(stream):
            if k == 3:
                internal = stream.internal_id       # stages key state by the id admission minted
                assert internal and internal != rid
                assert all(held(cluster, internal))  # mid-generation: both stages hold it
                break                               # leaving the stream cancels the call
    wait_released(cluster, internal)


def test_finished_request_is_released(cluster, wait_released):
    rid = "finished-test-1"
    with Client(cluster.target, retry=None) as client:
        r = client.generate("short", max_tokens=3, request_id=rid)
    assert r.receipt.request_id == rid and r.receipt.internal_id not in ("", rid)
    wait_released(cluster, r.receipt.internal_id)
