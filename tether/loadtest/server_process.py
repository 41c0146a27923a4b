"""A baseline server as a child process for as long as a `with` block: started with its log in a file, ready
once its own check says so, stopped (SIGTERM, then SIGKILL) on the way out whether the body returned, raised
or was interrupted. llama-cpp-python's server (llama_cpp_server.py) and llama.cpp's llama-server
(bench/llama_server.py) are two of them."""

from __future__ import annotations

import subprocess
import time
import urllib.error
from pathlib import Path
from typing import Any


class ServerProcess:
    """Subclasses set `command`, `log_path`, `timeout_s` and `name`, and say when the server is `ready()`."""

    command: list[str]
    log_path: Path
    timeout_s: float
    name = "the server"
    stop_grace_s = 10.0
    popen_options: dict[str, Any] = {}

    proc: subprocess.Popen | None = None

    def launch_command(self) -> list[str]:
        """What is executed (the command, or a launcher around it)."""
        return self.command

    def ready(self) -> bool:
        """Whether the server answers yet (raise URLError/OSError/ValueError while it does not)."""
        raise NotImplementedError

    def __enter__(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.launch_command(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, **self.popen_options)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        """Until `ready()`, or the process exits (RuntimeError), or `timeout_s` passes (TimeoutError)."""
        assert self.proc is not None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}: {self.log_tail()}")
            try:
                if self.ready():
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not answer within {self.timeout_s:g} s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 5) -> str:
        text = self.log_text()
        return (" | ".join(text.strip().splitlines()[-lines:]) or "(no log)") + f" (log: {self.log_path})"
