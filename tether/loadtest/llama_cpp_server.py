"""The llama.cpp baseline's server: llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`) on
the model's own GGUF file, started by `tether bench --baselines` as a child process and stopped after it.

It is the peer a user would pick to serve a small GGUF model on a CPU. It runs with as many threads as the
cluster's stages have in total (prompt and decode alike: `--n_threads_batch` would take every core by default),
and it serializes requests (one at a time behind a lock in llama_cpp/server/app.py; no batching), so its
latency at a concurrency above 1 includes the queue.

llama-cpp-python is the optional `bench` extra and never a runtime dependency: it compiles llama.cpp from source,
so it may live in another virtual environment, whose interpreter `--llama-cpp-python` names.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from tether.cli.cluster import free_port
from tether.loadtest.server_process import ServerProcess

INSTALL_HINT = "pip install 'llama-cpp-python[server]==0.3.36'"

# The child asks for SIGTERM when the bench dies (Linux PR_SET_PDEATHSIG, as tether/procutil.py does for our own
# services) and then runs the server exactly as `python -m llama_cpp.server` would: even a bench killed without
# its `finally` (SIGKILL) leaves no server behind. Set by the child itself: a preexec_fn in the bench is unsafe.
LAUNCH = ("import ctypes, os, runpy, signal, sys\n"
          "try:\n"
          "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
          "except OSError:\n"
          "    pass\n"
          "if os.getppid() != int(sys.argv.pop(1)):\n"
          "    sys.exit('the bench exited before the llama.cpp server started')\n"
          "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)\n")


def gguf_of(model: str) -> Path | None:
    """The GGUF file of `model`, or None when it has none: only the default model comes from one (presets are
    random weights in Hugging Face format, and a folder's own format is not llama.cpp's)."""
    from tether.model import smollm2
    if model != smollm2.NAME:
        return None
    return smollm2.gguf_file()


def server_command(python: str, gguf: Path, threads: int, port: int, n_ctx: int, parent_pid: int) -> list[str]:
    """The server's command line: `python -m llama_cpp.server` (through LAUNCH) on `gguf`, `threads` threads for
    prompts and decode alike, a context as long as the model's, on 127.0.0.1:`port`. `--interrupt_requests
    false`: by default a new request cuts off the stream in progress (7 of 8 requests at concurrency 8 ended
    without a finish reason), so with it off requests wait their turn, as a server's users expect."""
    return [python, "-c", LAUNCH, str(parent_pid), "--model", str(gguf), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--interrupt_requests", "false",
            "--host", "127.0.0.1", "--port", str(port)]


def import_check(python: str) -> str:
    """Why `python` cannot run the server ("" when it can): it must import llama_cpp.server (the [server] extra
    brings FastAPI, uvicorn and sse-starlette)."""
    try:
        done = subprocess.run([python, "-c", "import llama_cpp.server.app"], capture_output=True, text=True,
                              timeout=120)
    except FileNotFoundError:
        return f"--llama-cpp-python {python} does not exist"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"--llama-cpp-python {python} could not run: {e}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1]
        return f"llama-cpp-python[server] is not importable by {python} ({last}); {INSTALL_HINT}"
    return ""


def skip_reason(python: str, model: str) -> str:
    """Why the llama.cpp baseline cannot run ("" when it can): the model has no GGUF, or `python` lacks
    llama-cpp-python. The model is checked first: it needs no process."""
    try:
        gguf = gguf_of(model)
    except (FileNotFoundError, ValueError, OSError) as e:
        return f"the GGUF of {model} is not available: {e}"
    if gguf is None:
        return f"model {model} has no GGUF file (only the default model, smollm2, is served from one)"
    return import_check(python)


class LlamaCppServer(ServerProcess):
    """`with LlamaCppServer(...) as s:` the server up at `s.base_url`; stopped (SIGTERM, then SIGKILL) on the way
    out, whether the body returned, raised or was interrupted (Ctrl-C)."""

    name = "the llama.cpp server"

    def __init__(self, python: str, gguf: Path, threads: int, n_ctx: int, log_path: Path,
                 timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.command = server_command(python, gguf, threads, self.port, n_ctx, os.getpid())
        self.log_path, self.timeout_s = log_path, timeout_s
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    @property
    def display_command(self) -> list[str]:
        """The command as a user would type it: what LAUNCH runs, without the launcher."""
        return [self.command[0], "-m", "llama_cpp.server", *self.command[4:]]

    def ready(self) -> bool:
        """/v1/models answers (the model is loaded before uvicorn listens)."""
        with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as r:
            return bool(json.load(r).get("data"))
