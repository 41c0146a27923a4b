"""tether.ports: a port's holder named from /proc, a bind failure worded as the configuration error it is, the
launcher's reservation, and the report a service writes for its launcher."""

from __future__ import annotations

import os
import socket

import pytest

from tether import ports


def test_a_listening_port_names_its_holder_and_the_flag():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ports.in_use("127.0.0.1", port)
        who = ports.holder(port)
        assert who is not None and who.startswith(f"pid {os.getpid()}, ") and who.endswith(", listening"), who
        err = ports.bind_error("127.0.0.1", port, "--stage-port", RuntimeError("gRPC failed"))
        assert isinstance(err, ports.PortInUse) and err.port == port and err.flag == "--stage-port"
        assert str(err) == f"port {port} on 127.0.0.1 is in use (by {who}) — pass --stage-port or free it"
        with pytest.raises(ports.PortInUse):
            ports.reserve("127.0.0.1", port, "--port")


def test_a_port_held_by_a_connection_is_named_as_one():
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
        port = client.getsockname()[1]   # the kernel's pick, from the ephemeral range
        assert ports.in_use("127.0.0.1", port)
        assert (ports.holder(port) or "").endswith("an outgoing connection")


def test_a_free_port_is_not_in_use_and_a_reservation_holds_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert not ports.in_use("127.0.0.1", port)
    held = ports.reserve("127.0.0.1", port, "--port")
    try:
        assert ports.in_use("127.0.0.1", port)   # nobody, an outgoing connection included, can take it now
        err = ports.bind_error("127.0.0.1", port, "--port", OSError(98, "in use"))
        assert isinstance(err, ports.PortInUse)
    finally:
        held.close()
    err = ports.bind_error("127.0.0.1", port, "--port", OSError(99, "Cannot assign requested address"))
    assert not isinstance(err, ports.PortInUse) and "Cannot assign requested address" in str(err)


def test_a_port_a_stopped_server_left_in_time_wait_can_be_reserved_again():
    """A cluster stopped a moment ago leaves its public ports' closed connections in TIME_WAIT for a minute: a
    new `tether up` must not call them in use (its services bind with SO_REUSEADDR and would serve), and its
    reservation must still keep a second launcher off."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()   # the server's end closes first: it waits out TIME_WAIT on `port`
        client.recv(1)
        client.close()
    assert not ports.in_use("127.0.0.1", port)
    held = ports.reserve("127.0.0.1", port, "--http-port")
    try:
        assert ports.in_use("127.0.0.1", port)
        with pytest.raises(ports.PortInUse):
            ports.reserve("127.0.0.1", port, "--http-port")
    finally:
        held.close()


def test_a_report_is_written_whole_and_read_back(tmp_path):
    path = tmp_path / "stage0.json"
    assert ports.read_report(path) is None
    ports.write_report(path, ports.Report({"--port": 41234, "--metrics-port": 41235}, ready=True))
    assert ports.read_report(path) == ports.Report({"--port": 41234, "--metrics-port": 41235}, ready=True)
    ports.write_report(path, ports.Report({}, error="port 1 on h is in use — pass --port or free it", flag="--port",
                                          port=1))
    report = ports.read_report(path)
    assert report is not None and report.error and report.flag == "--port" and not report.ready
    assert [p.name for p in tmp_path.iterdir()] == ["stage0.json"]   # no temporary file left beside it
