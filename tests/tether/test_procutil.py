"""Services started by a launcher die with it, even when the launcher is SIGKILLed (no orphans)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers import alive

CHILD = ("from tether.procutil import follow_parent; follow_parent(); print('ready', flush=True); "
         "import time; time.sleep(120)")
LAUNCHER = f"""
import os, subprocess, sys
env = dict(os.environ, TETHER_PARENT_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"   # past follow_parent()
print(child.pid, flush=True)
child.wait()
"""


def test_child_dies_when_its_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())      # printed once the child has asked to die with it
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 15
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "the service outlived its launcher"


def test_a_service_whose_launcher_is_already_gone_exits():
    env = dict(os.environ, TETHER_PARENT_PID="1")   # not our parent: as if the launcher died first
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "launcher exited" in out.stderr
