"""A dead coordinator leaks nothing: stages free idle state after their lease; a restarted coordinator serves
again and the requests it lost fail explicitly."""

from __future__ import annotations

import threading

import grpc

from tether import reference
from tether.cli.cluster import LocalCluster
from tether.client import Client, TetherError


def test_coordinator_killed_mid_generation(tmp_path, held, wait_released):
    lease = 2.0
    # admission waits 2 s, not the 30 s default, for a pipeline to continue the dropped request: it has only this one
    cluster = LocalCluster(model="tiny", stages=2, threads=1, log_dir=tmp_path,
                           extra={"stage": ["--lease", str(lease)], "admission": ["--resume-wait", "2"]}).start(timeout=180)
    try:
        rid = "lease-test-1"
        internal: list[str] = []
        first = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            with Client(cluster.target, timeout=60, retry=None) as client:
                try:
                    stream = client.stream("keep going", max_tokens=2000, ignore_eos=True, request_id=rid)
                    for _ in stream:
                        if not first.is_set():
                            internal.append(stream.internal_id)
                            first.set()
                except TetherError as e:
                    error.append(e)

        t = threading.Thread(target=run)
        t.start()
        assert first.wait(60)
        (iid,) = internal
        assert all(held(cluster, iid))
        cluster.kill("coordinator")                      # no Release will ever come
        t.join(timeout=60)
        assert not t.is_alive() and error and error[0].code == grpc.StatusCode.UNAVAILABLE
        wait_released(cluster, iid, timeout=lease + 15)   # no Release came: the lease freed it

        cluster.restart("coordinator")                   # a new coordinator: new handshake, serves again
        cluster.wait_ready(120)
        with Client(cluster.target, timeout=60, retry=None) as client:
            got = client.generate("hello again", max_tokens=4)
        assert got.token_ids == reference.generate("hello again", max_tokens=4).token_ids
    finally:
        cluster.stop()
