"""Process-wide test settings.

OpenMP threads that spin while waiting stall badly when another process (the services these tests start)
takes a core of this 2-core machine; passive waiting keeps the in-process reference fast. Must be set
before torch is imported.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Stages forked from a fork server that imported torch once (tether/forkserver/): a fresh interpreter's import
# is most of a stage's start-up, and the suite starts ~120 stages. Inherited by the CLIs the tests run;
# tests/tether/cli/test_up.py turns it off to keep the plain subprocess path covered.
os.environ.setdefault("TETHER_FORK_SERVER", "1")
# A stage's KV pool is mapped as it is used, not made resident at start (--kv-prefault, ~0.4 s a GiB per stage):
# no test soaks, and the suite starts ~120 stages. bench/soak.py runs with it, as `tether up` does.
os.environ.setdefault("TETHER_KV_PREFAULT", "0")

import pytest  # noqa: E402 - after the environment is set

from tether.cli.cluster import LocalCluster  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real 2-stage cluster on loopback (each service its own process), shared by every test module of this
    process (one per xdist worker): starting one costs seconds of CPU, paid once instead of once per module.
    A test using it must leave it as it found it (no kill, restart or flag of its own: start a LocalCluster for
    that) and read its counters as differences (Stats before and after), never as totals."""
    c = LocalCluster(model="tiny", stages=2, threads=1, log_dir=tmp_path_factory.mktemp("logs"))
    c.start(timeout=180)
    try:
        yield c
    finally:
        c.stop()


# The longest files, started first: under `make test` (pytest-xdist, a whole file per worker) a long file
# collected last keeps one worker busy while the others have finished. Longest first, as measured by
# `--durations=0` (seconds per file summed over its tests, setup and teardown included; re-measured
# 2026-12-05, when the stage worker's fault and hostile-peer files had grown to the longest).
SLOW_FILES_FIRST = (
    "tests/services/stage_worker/test_hostile.py",
    "tests/services/stage_worker/test_stage_faults.py",
    "tests/tether/loadtest/test_bench_e2e.py",
    "tests/tether/model/test_smollm2.py",
    "tests/services/e2e/test_generate.py",
    "tests/services/e2e/test_chaos.py",
    "tests/services/e2e/test_handshake.py",
    "tests/services/stage_worker/test_stamp_properties.py",
    "tests/tether/cli/test_up_supervise.py",
    "tests/tether/loadtest/test_chaos_bench.py",
    "tests/tether/test_forkserver.py",
    "tests/services/e2e/test_default_model_e2e.py",
    "tests/services/e2e/test_errors.py",
    "tests/services/openai/test_openai_api.py",
    "tests/services/e2e/test_limits.py",
    "tests/services/e2e/test_prefix_and_pressure.py",
    "tests/services/admission/test_tagger_linear.py",
    "tests/tether/loadtest/test_report.py",
    "tests/services/e2e/test_chat.py",
    "tests/services/e2e/test_failover.py",
    "tests/tether/model/test_invariant_threads.py",
    "tests/tether/model/test_smollm2_invariance.py",
    "tests/tether/model/test_probe_cache.py",
    "tests/tether/model/test_numerics.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FILES_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))   # stable
