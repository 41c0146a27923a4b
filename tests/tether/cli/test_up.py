"""`tether up` as a user runs it: prints where things listen, answers, and stops every child on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from tether import settings
from tether.cli.cluster import free_port
from tests.helpers import alive

TETHER = [sys.executable, "-m", "tether.cli.main"]


def test_up_generate_and_clean_stop():
    ports = [free_port() for _ in range(4)]
    up = subprocess.Popen(TETHER + ["up", "--model", "tiny", "--port", str(ports[0]), "--coordinator-port", str(ports[1]),
                                    "--stage-port", str(ports[2]), "--stages", "2", "--threads", "1",
                                    "--http-port", str(ports[3])],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, settings.FORK_SERVER_ENV: "0"})   # as users run it: plain processes
    pids, lines = [], []
    try:
        deadline = time.monotonic() + 180
        for line in up.stdout:                      # read until the cluster says it is up
            lines.append(line)
            if m := re.search(r"\(pid (\d+)\)", line):
                pids.append(int(m.group(1)))
            if "tether is up" in line or time.monotonic() > deadline:
                break
        assert len(pids) == 4, "".join(lines)
        base_url = f"http://127.0.0.1:{ports[3]}/v1"
        assert f"OpenAI-compatible API: base URL {base_url}" in up.stdout.readline()   # printed, and served:
        with urllib.request.urlopen(f"{base_url}/models", timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == "tiny"
        target = f"127.0.0.1:{ports[0]}"
        out = subprocess.run(TETHER + ["generate", "--target", target, "--max-tokens", "5", "--json", "你好"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert len(result["token_ids"]) == result["receipt"]["output_tokens"] <= 5
        assert result["tags"]["language"] == "zh"
        bad = subprocess.run(TETHER + ["generate", "--target", target, "--temperature", "9", "hi"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "temperature" in bad.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "a child outlived tether up"
