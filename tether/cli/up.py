"""`tether up`: the whole system on this machine, one process per service, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import threading

from tether import settings
from tether.cli.cluster import LocalCluster

DEMO_PROMPTS = [
    ("请用不超过50字向老人解释血糖仪读数", dict(max_tokens=48)),
    ("Explain in under 30 words why the sky is blue.", dict(max_tokens=32)),
    ("写一首关于秋天的短诗", dict(max_tokens=32, temperature=0.8, seed=7)),
    ("Summarize: tether pins every activation to the request that produced it.", dict(max_tokens=24, temperature=0.7, top_p=0.9, seed=1)),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether up",
        description="Start a local tether cluster: N stage workers, one coordinator and one admission service, "
                    "each its own process on loopback. Ctrl-C or SIGTERM stops them all.")
    p.add_argument("--model", default=settings.DEFAULT_MODEL,
                   help="preset (tiny, small, base: random weights generated from a seed) or a Hugging Face "
                        "folder with config.json, *.safetensors and tokenizer.json (default: %(default)s)")
    p.add_argument("--stages", type=int, default=2, help="stage workers; layers are split evenly (default: %(default)s)")
    p.add_argument("--port", type=int, default=settings.ADMISSION_PORT,
                   help="admission (public) port (default: %(default)s)")
    p.add_argument("--coordinator-port", type=int, default=settings.COORDINATOR_PORT,
                   help="coordinator port (default: %(default)s)")
    p.add_argument("--stage-port", type=int, default=settings.STAGE_BASE_PORT,
                   help="port of stage 0; stage i listens on this + i (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per stage (default: the machine's cores divided among the stages)")
    p.add_argument("--demo", action="store_true", help="once up, send a few prompts and print the answers")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the cluster to come up")
    return p


def run_demo(target: str) -> None:
    from tether.client import Client
    with Client(target) as client:
        for prompt, params in DEMO_PROMPTS:
            r = client.generate(prompt, **params)
            print(f"\n> {prompt}\n  {params}\n  tags: language={r.tags.get('language')} task={r.tags.get('task')} "
                  f"length_limit={r.tags.get('length_limit')}{r.tags.get('length_unit')} "
                  f"domain={r.tags.get('domain')} audience={r.tags.get('audience')}\n"
                  f"  answer ({len(r.token_ids)} tokens, {r.finish_reason}): {r.text!r}\n"
                  f"  receipt: request {r.receipt.request_id} context hash {r.receipt.context_hash:016x}", flush=True)
    print("\n(the default model's weights are random: its answers are noise; serve a real checkpoint with "
          "`tether up --model /path/to/hf-folder`)", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.stages)
    cluster = LocalCluster(model=args.model, stages=args.stages, host=args.host, admission_port=args.port,
                           coordinator_port=args.coordinator_port, stage_port=args.stage_port, threads=threads)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting tether: model {args.model}, {args.stages} stage(s), {threads} thread(s) each ...", flush=True)
    try:
        cluster.start(timeout=args.timeout)
        for svc in cluster.services:
            print(f"  {svc.name:<12} {svc.address}  (pid {svc.proc.pid})", flush=True)
        print(f"tether is up: send requests to {cluster.target}, e.g. "
              f"`tether generate --target {cluster.target} \"你好\"`. Ctrl-C stops it.", flush=True)
        if args.demo:
            run_demo(cluster.target)
        while not stop.wait(0.5):
            dead = [s for s in cluster.services if s.proc.poll() is not None]
            if dead:
                print(f"{dead[0].name} exited with {dead[0].proc.returncode}; stopping the cluster", flush=True)
                break
    except (TimeoutError, RuntimeError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"tether up: {e}")
    finally:
        print("stopping tether ...", flush=True)
        cluster.stop()
        print("stopped.", flush=True)
