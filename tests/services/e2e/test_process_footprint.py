"""Admission and the coordinator never load torch: they read a model's folder, tokenizer and chat template only
(tether/model/folder.py), so they start in a fraction of a stage's time and memory. Checked on the live
processes of a real cluster after it answered (a lazy import on the request path would show), and on a fresh
import of each service's entry point."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tether.client import Client


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@pytest.mark.parametrize("name", ["admission", "coordinator"])
def test_a_serving_admission_and_coordinator_hold_no_torch(cluster, name):
    with Client(cluster.target) as client:
        assert client.generate("footprint", max_tokens=4).token_ids
    proc = cluster.service(name).proc
    assert proc is not None and proc.poll() is None
    assert "libtorch" not in _maps(proc.pid), f"{name} loaded torch"
    stage = cluster.service("stage0").proc
    assert stage is not None and "libtorch" in _maps(stage.pid)   # the check sees torch where it is loaded


@pytest.mark.parametrize("module", ["services.admission.main", "services.coordinator.main"])
def test_the_entry_points_import_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
