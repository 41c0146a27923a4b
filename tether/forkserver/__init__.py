"""A fork server for stage processes: torch imported once, a child forked per stage instead of a fresh
interpreter paying the import each time (~5 CPU-s on a 2-core AMD EPYC, 2.5 on an Intel Xeon: most of a
stage's start-up, and most of `make test`'s CPU, which starts ~120 stages).

Off unless TETHER_FORK_SERVER=1 (`settings.FORK_SERVER_ENV`; the tests set it): a `LocalCluster` then
starts one server per launcher process (`client.shared`) and forks from it every command that runs a module
of `FORKED_MODULES` in an environment the server can honour (`client.compatible`); everything else is a
plain subprocess. A forked child is a real process (its own pid, ports, signals and exit status) running
the same `python -m` entry point; `client.ForkedProcess` answers what subprocess.Popen does.

server.py: the process that forks (single-threaded, so a fork copies no other thread's locks);
client.py: starting it and asking it for children.
"""

from __future__ import annotations

# Imported by the server before it forks anything: torch (the cost) and what torch brings. Nothing of
# tether's own, so every module that reads settings from the environment reads the child's.
PRELOAD = ("torch",)
# The `python -m` modules that may be forked: only stages load torch (coordinator and admission must not
# map it: tests/services/e2e/test_process_footprint.py).
FORKED_MODULES = frozenset({"services.stage_worker"})
# Environment read while PRELOAD is imported (OpenMP, MKL, torch, the loader, Python itself): a command
# whose values differ from the server's runs as a plain subprocess, since a fork would keep the server's.
IMPORT_TIME_ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH",
                            "LD_", "PYTHON", "MALLOC_", "CUDA")
