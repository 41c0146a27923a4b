"""`tether up`'s flags become the services' own: what service_extra() adds to each command."""

from __future__ import annotations

import pytest

from services.admission.main import build_parser as admission_parser
from tether.cli.up import build_parser, service_extra


def test_tenants_reach_admission_only_as_an_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "tenants.toml").write_text("[defaults]\nrequests_per_s = 5\n")
    monkeypatch.chdir(tmp_path)
    extra = service_extra(build_parser().parse_args(["--tenants", "tenants.toml"]))
    assert set(extra) == {"admission"}
    assert extra["admission"] == ["--tenants", str(tmp_path / "tenants.toml")]   # children run in the repo
    assert admission_parser().parse_args(extra["admission"]).tenants == str(tmp_path / "tenants.toml")


def test_tenants_and_log_format_together(tmp_path):
    (tmp_path / "t.toml").write_text("")
    extra = service_extra(build_parser().parse_args(["--tenants", str(tmp_path / "t.toml"), "--log-format", "json"]))
    assert extra["stage"] == extra["coordinator"] == ["--log-format", "json"]
    assert extra["admission"] == ["--log-format", "json", "--tenants", str(tmp_path / "t.toml")]


def test_a_missing_tenants_file_stops_before_anything_starts(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        service_extra(build_parser().parse_args(["--tenants", str(tmp_path / "nope.toml")]))
    assert service_extra(build_parser().parse_args([])) == {}


def test_linear_inputs_reach_the_stages_only():
    from services.stage_worker.main import build_parser as stage_parser   # imports torch: only this test pays
    extra = service_extra(build_parser().parse_args(["--linear-inputs", "q8", "--log-format", "json"]))
    assert extra["stage"] == ["--log-format", "json", "--linear-inputs", "q8"]
    assert extra["coordinator"] == extra["admission"] == ["--log-format", "json"]
    assert stage_parser().parse_args(["--model", "tiny", *extra["stage"]]).linear_inputs == "q8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--linear-inputs", "int4"])
