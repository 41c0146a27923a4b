"""tether/cli/cluster.py's wait_serving: the health poll `tether up`, the test clusters and the tests share."""

import grpc
import pytest

from tether.cli.cluster import free_port, wait_serving


def test_nothing_listening_is_false_after_the_timeout():
    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as ch:
        assert wait_serving(ch, 0.3) is False


def test_before_each_stops_the_wait_by_raising():
    def exited() -> None:
        raise RuntimeError("stage0 exited with 1 during start-up")

    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as ch:
        with pytest.raises(RuntimeError, match="stage0 exited"):
            wait_serving(ch, 10, before_each=exited)
