"""The options a bench run reads below the command line: plain values, built once from `tether bench`'s flags
(tether/loadtest/cli.py `options_of`) and handed to the runner and the chaos runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tether.loadtest import loadgen

DEFAULT_NUM_REQUESTS = 32
DEFAULT_CONCURRENCY = 8


@dataclass(frozen=True)
class Credentials:
    """AsyncClient's API key and TLS files (None: the SDK reads $TETHER_API_KEY and $TETHER_TLS_*)."""

    api_key: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def client_kwargs(self) -> dict[str, Any]:
        return dict(api_key=self.api_key, tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key)


@dataclass(frozen=True)
class BenchOptions:
    """What the levels, the baselines and the chaos runs are sized by."""

    model: str                      # the served model's name, for messages and chaos clusters
    stages: int
    stage_threads: int              # torch threads per stage process
    levels: tuple[loadgen.Level, ...]
    budget: loadgen.Budget          # per level
    seed: int                       # workload seed
    warmup: int                     # requests before the first level
    timeout_s: float                # per-request deadline
    slo: dict[str, float] | None
    audit: bool
    quiet: bool                     # no progress line
    credentials: Credentials = Credentials()
    capacity_start: float = 1.0     # --find-capacity's first rate
    baseline_requests: int = 32
    batch_size: int = 1             # the baselines' batch size and the served side's concurrency
    baseline_threads: int = 1       # torch threads of the in-process baselines
    repeats: int = 1                # baseline runs per side
    api: str = "grpc"               # the face the load goes through: grpc, or openai (the HTTP API at base_url)
    base_url: str = ""              # with api "openai": admission's OpenAI base URL (http://HOST:PORT/v1)
    llama_cpp_python: str = ""      # the interpreter that runs the llama.cpp baseline's server; "": not run
    llama_cpp_threads: int = 1      # its threads: the cluster's stages' in total
    llama_cpp_log: str = ""         # its log file
