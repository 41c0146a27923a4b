"""free_port draws below the kernel's ephemeral range, where no outgoing connection can take the port between
the draw and the child's bind, and never hands out the same port twice in one process."""

from __future__ import annotations

import socket

from tether.cli import cluster
from tether.cli.cluster import FREE_PORT_FLOOR, ephemeral_floor, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    top = ephemeral_floor()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(FREE_PORT_FLOOR <= p < top for p in ports)
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_someone_listens_on_is_never_drawn(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the only candidate below the range is the taken port: the draw must fall back, not return it
        monkeypatch.setattr(cluster, "FREE_PORT_FLOOR", port)
        monkeypatch.setattr(cluster, "ephemeral_floor", lambda: port + 1001)
        monkeypatch.setattr(cluster._random, "randrange", lambda a, b: port)
        assert free_port() != port


def test_the_range_is_read_from_the_kernel(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ephemeral_floor(str(f)) == 40000
    assert ephemeral_floor(str(tmp_path / "missing")) == 32768
