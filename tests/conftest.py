"""Process-wide test settings.

OpenMP threads that spin while waiting stall badly when another process (the services these tests start)
takes a core of this 2-core machine; passive waiting keeps the in-process reference fast. Must be set
before torch is imported.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402 - after the environment is set

from tether.cli.cluster import LocalCluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A real 2-stage cluster on loopback (each service its own process), shared by one test module."""
    c = LocalCluster(model="tiny", stages=2, threads=1, log_dir=tmp_path_factory.mktemp("logs"))
    c.start(timeout=180)
    try:
        yield c
    finally:
        c.stop()
