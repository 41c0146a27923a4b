"""tether/service_main.py: the start-up the three services share (flags to a running loop, errors in one line)."""

import argparse

import pytest

from tether import service_main
from tether.faults import add_experiment_flags


def _parser(experiments: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether x")
    service_main.add_flags(p)
    if experiments:
        add_experiment_flags(p, "this test's frames")
    return p


@pytest.fixture(autouse=True)
def configured(monkeypatch):
    """What run set up; the process-wide setters are stubbed, since this is the test process itself."""
    calls = []
    monkeypatch.setattr(service_main, "follow_parent", lambda: calls.append("follow_parent"))
    monkeypatch.setattr(service_main.logs, "configure", lambda *a: calls.append(("logs", *a)))
    monkeypatch.setattr(service_main.tracing, "configure", lambda *a: calls.append(("tracing", *a)))
    return calls


@pytest.mark.parametrize("experiments", [True, False])
def test_run_sets_tls_and_experiments_then_runs_serve(experiments, configured):
    p = _parser(experiments)
    seen = []

    async def serve(args):
        seen.append(args)

    service_main.run("coordinator", p, p.parse_args([]), serve, experiments=experiments)
    (args,) = seen
    assert configured == ["follow_parent", ("logs", "coordinator", "INFO", "text"), ("tracing", "coordinator", None)]
    assert args.tls is None                                    # plaintext without --tls-* flags
    assert hasattr(args, "fault_config") == experiments
    if experiments:
        assert not args.fault_config.enabled


def test_a_fatal_error_is_one_line_with_the_service_name():
    p = _parser(True)

    async def serve(args):
        raise OSError("--port 1: cannot listen")

    with pytest.raises(SystemExit, match=r"^tether stage: --port 1: cannot listen$"):
        service_main.run("stage", p, p.parse_args([]), serve)


def test_an_error_outside_fatal_keeps_its_traceback():
    p = _parser(False)

    async def serve(args):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        service_main.run("admission", p, p.parse_args([]), serve, experiments=False, fatal=(OSError,))


def test_a_bad_fault_spec_is_a_usage_error(capsys):
    p = _parser(True)

    async def serve(args):
        raise AssertionError("never started")

    with pytest.raises(SystemExit) as e:
        service_main.run("stage", p, p.parse_args(["--faults", "nonsense=1"]), serve)
    assert e.value.code == 2 and "--faults" in capsys.readouterr().err


def test_add_flags_declares_what_run_reads_with_optional_log_levels(capsys):
    p = argparse.ArgumentParser(prog="x")
    service_main.add_flags(p, public=True, log_levels=["INFO", "DEBUG"])
    args = p.parse_args([])
    assert (args.log_level, args.log_format, args.otlp_endpoint) == ("INFO", "text", None)
    assert hasattr(args, "tls_client_auth")          # the public port's extra TLS flag
    with pytest.raises(SystemExit):
        p.parse_args(["--log-level", "debug"])
    assert "invalid choice" in capsys.readouterr().err
