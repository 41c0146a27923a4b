"""A real cluster on loopback: each service its own process, talking gRPC, started like `tether up`."""

from __future__ import annotations

import pytest

from tether.cli.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(model="tiny", stages=2, threads=1, log_dir=tmp_path_factory.mktemp("logs"))
    c.start(timeout=180)
    try:
        yield c
    finally:
        c.stop()
