"""What zero trust costs: `tether bench` throughput of a secure cluster divided by a plaintext one, side by side.

The secure cluster runs this tree with mutual TLS between every service (`LocalCluster(tls=True)`, the
certificates of `tether certs init`), TLS on the public port and an API key required (a tenants file with one
key), and keyed stamps (always on in this tree). The plaintext cluster is, by default, this tree without TLS or
keys: the ratio is then what TLS and API keys cost. With --baseline-tree DIR (e.g. `git worktree add
/tmp/before <commit before keyed stamps>`) the plaintext cluster is that tree's own `tether up`, so the ratio
also includes the keyed stamps. Both clusters run for the whole run; each repeat loads both at the same time
with the same `tether bench` level, so whatever else loads the shared machine loads both alike. The figure is
the median over repeats of secure / plaintext output-token throughput; every answer of both is audited.

    .venv/bin/python bench/security_overhead.py                                # TLS + API keys, 5 repeats
    git worktree add /tmp/before 390d395 && .venv/bin/python bench/security_overhead.py --baseline-tree /tmp/before

Figures: docs/PERFORMANCE.md, "Overheads".
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # spinning OpenMP threads starve the other processes

import grpc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import add_level_flags, bench, summarize, together  # noqa: E402
from services.admission.auth import key_digest  # noqa: E402
from tether.cli.cluster import LocalCluster, free_port, wait_serving  # noqa: E402


class TreeCluster:
    """Another tree's own `tether up` (plaintext), on free ports, ready once its admission's health serves."""

    def __init__(self, tree: Path, args: argparse.Namespace, logs: Path) -> None:
        self.tree, self.args, self.logs = tree.resolve(), args, logs
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "tether.cli.main", "up", "--model", self.args.model, "--stages",
               str(self.args.stages), "--threads", str(self.args.threads), "--port", str(self.port),
               "--coordinator-port", str(free_port()), "--stage-port", str(free_port()), "--log-dir", str(self.logs)]
        env = {**os.environ, "PYTHONPATH": str(self.tree)}   # and cwd: its own tether and services, not ours
        self.proc = subprocess.Popen(cmd, cwd=self.tree, env=env, stdout=open(self.logs / "up.log", "ab"),
                                     stderr=subprocess.STDOUT)
        def alive() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.tree}: tether up exited {self.proc.returncode} (see {self.logs})")
        with grpc.insecure_channel(self.target) as ch:
            if not wait_serving(ch, timeout, alive):
                raise TimeoutError(f"{self.tree}: not serving after {timeout} s (see {self.logs})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_level_flags(p, "simultaneous pairs")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="a checkout (with its protos generated) whose `tether up` is the plaintext side")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    logs = Path(tempfile.mkdtemp(prefix="tether-security-overhead-"))
    key = "tk_" + secrets.token_urlsafe(32)
    tenants = logs / "tenants.toml"
    tenants.write_text(f'[tenants.bench]\napi_keys_sha256 = ["{key_digest(key)}"]\n')
    secure = LocalCluster(model=args.model, stages=args.stages, threads=args.threads, log_dir=logs / "secure",
                          tls=True, extra={"admission": ["--tenants", str(tenants)]})
    plain = TreeCluster(args.baseline_tree, args, logs / "plain") if args.baseline_tree else \
        LocalCluster(model=args.model, stages=args.stages, threads=args.threads, log_dir=logs / "plain")
    pairs = []
    try:
        plain.start(timeout=300)
        secure.start(timeout=300)
        credentials = {"plain": [], "secure": ["--tls-ca", str(secure.tls_dir / "ca.pem"), "--api-key", key]}
        for r in range(args.repeats):
            result = together({side: lambda side=side, c=c, r=r: bench(c.target, args, logs / f"bench-{r}-{side}",
                                                                  ["--audit", *credentials[side]])
                               for side, c in (("plain", plain), ("secure", secure))})
            off, on = (result[s]["output_token_throughput"] for s in ("plain", "secure"))
            pairs.append(dict(plain=off, secure=on, ratio=on / off))
            print(f"repeat {r + 1}/{args.repeats}: plaintext {off:.1f} tok/s, secure {on:.1f} tok/s, "
                  f"secure/plaintext {on / off:.3f}", flush=True)
    finally:
        secure.stop()
        plain.stop()
    what = "TLS + API keys + keyed stamps" if args.baseline_tree else "TLS + API keys"
    summary = summarize(f"{what}: secure / plaintext", pairs, args)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
