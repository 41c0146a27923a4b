"""A fork server for service processes: torch (and gRPC, protobuf, telemetry) imported once, a child forked
per service instead of a fresh interpreter paying the imports each time (a stage's ~5 CPU-s of `import torch`
on a 2-core AMD EPYC without AVX-512, 2.5 on an Intel Xeon, and ~1 CPU-s for a coordinator or admission:
most of their start-up, and a large share of `make test`'s CPU, which starts ~120 stages and ~100 others).

Off unless TETHER_FORK_SERVER=1 (`settings.FORK_SERVER_ENV`; the tests set it): a `LocalCluster` then
starts servers per launcher process (`client.shared`) and forks from them every command that runs a module
of `FORKED_MODULES` in an environment the server can honour (`client.compatible`); everything else is a
plain subprocess. One server per kind
(`PRELOADS`). A forked child is a real process (its own pid, ports, signals and exit status) running
the same `python -m` entry point; `client.ForkedProcess` answers what subprocess.Popen does.

server.py: the process that forks (single-threaded, so a fork copies no other thread's locks);
client.py: starting it and asking it for children.
"""

from __future__ import annotations

# What a server imports before it forks anything, by kind: the libraries every service imports (gRPC and its
# health and reflection services, protobuf, telemetry, the tokenizer, TLS; ~1 CPU-s), and for stages torch too
# (the cost). Nothing of tether's own, so every module that reads settings from the environment reads the
# child's. gRPC is imported, never initialised (no channel or server): a child starts its own.
SERVICE_LIBS = ("asyncio", "grpc", "grpc.aio", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection",
                "google.protobuf", "opentelemetry.sdk.trace", "prometheus_client", "jinja2", "tokenizers",
                "cryptography.x509", "xxhash")
PRELOADS = {"service": SERVICE_LIBS, "stage": ("torch", *SERVICE_LIBS)}
# The `python -m` modules that may be forked, and from which kind of server: coordinator and admission must
# never map torch (tests/services/e2e/test_process_footprint.py).
FORKED_MODULES = {"services.stage_worker": "stage", "services.coordinator": "service", "services.admission": "service"}
# Environment read while a PRELOADS list is imported (OpenMP, MKL, torch, the loader, Python itself): a command
# whose values differ from the server's runs as a plain subprocess, since a fork would keep the server's.
# (gRPC's and OpenTelemetry's are read when a child starts them, but kept equal too, to be safe.)
IMPORT_TIME_ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH",
                            "LD_", "PYTHON", "MALLOC_", "CUDA", "GRPC_", "OTEL_")
