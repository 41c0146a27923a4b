"""`tether up`: the whole system on this machine, one process per service, until Ctrl-C or SIGTERM.

A child that dies is restarted like a container under a restart policy (tether/cli/supervisor.py): the
protocol recovers a restarted stage (the coordinator re-handshakes and replays in-flight requests), so
taking the whole cluster down for one dead process would throw that recovery away.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether import settings
from tether.model import dtypes
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc
from tether.cli.cluster import LocalCluster, linear_inputs_flags
from tether.cli.supervisor import GaveUp, RestartPolicy, RollingRestart, Supervisor

# The demo on the default model (a real instruct model): questions as conversations, rendered by admission with
# the model's chat template. Greedy unless a seed is given, so a run shows the same answers every time.
DEMO_CHATS: list[tuple[list[tuple[str, str]], dict[str, Any]]] = [
    ([("user", "What is the capital of France?")], dict(max_tokens=32)),
    ([("user", "Explain in under 30 words why the sky is blue.")], dict(max_tokens=64)),
    ([("user", "Give me three tips for staying focused while studying.")],
     dict(max_tokens=96, temperature=0.7, top_p=0.9, seed=7)),
    # SmolLM2-135M's Chinese is weak (its training data is mostly English): this one is here for the tags.
    ([("user", "请用不超过50字向老人解释血糖仪读数")], dict(max_tokens=64)),
]
# One multi-turn exchange: the first reply is fed back as the assistant's turn, then a follow-up.
DEMO_FOLLOW_UP = ("What is the capital of France?", "What is the most famous tower there?")
# Raw prompts for a model without a chat template.
DEMO_PROMPTS: list[tuple[str, dict[str, Any]]] = [
    ("请用不超过50字向老人解释血糖仪读数", dict(max_tokens=48)),
    ("Explain in under 30 words why the sky is blue.", dict(max_tokens=32)),
    ("Summarize: tether pins every activation to the request that produced it.",
     dict(max_tokens=24, temperature=0.7, top_p=0.9, seed=1)),
]


POLL_S = 0.2   # how often the launcher looks for dead children (and for due restarts)


def coordinator_serving(cluster: LocalCluster, name: str) -> bool:
    """Whether coordinator `name` serves and admission routes to it again: its gRPC health is SERVING (its
    pipeline has handshaken) and an admission watches its load (the first report of a Watch says serving)."""
    with cluster.channel(name) as ch:
        try:
            if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5).status \
                    != health_pb2.HealthCheckResponse.SERVING:
                return False
            stats = coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=0.5)
            return stats.watchers > 0
        except grpc.RpcError:
            return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether up",
        description="Start a local tether cluster: N stage workers, one coordinator and one admission service, "
                    "each its own process on loopback. Ctrl-C or SIGTERM stops them all.",
        epilog=f"restart policy: {RestartPolicy().describe()}. Requests in flight when a stage dies resume "
               f"once it is back (within the coordinator's {settings.RECOVERY_WINDOW_S:g} s recovery window); "
               "after that they fail with UNAVAILABLE. --max-restarts sets the crashes allowed per child, "
               "--no-restart stops the cluster at the first death. SIGHUP (kill -HUP <pid of tether up>) restarts the "
               f"pipelines one after another without failing a request: each coordinator is drained (up to "
               f"{settings.DRAIN_S:g} s; what it still holds then is continued by admission on another pipeline), "
               "started again, and the next one only once it serves.")
    p.add_argument("--model", default=settings.DEFAULT_MODEL,
                   help="smollm2 (the default: SmolLM2-135M-Instruct, a real instruct model, fetched and converted once), a "
                        "random-weight preset for tests and kernel benchmarks (tiny, small, base) or a Hugging Face "
                        "folder with config.json, *.safetensors and tokenizer.json (default: %(default)s)")
    p.add_argument("--stages", type=int, default=2,
                   help="stage workers per pipeline; the layers are split so that each stage costs about the same: the "
                        "last stage, which also runs the LM head and sampling, holds fewer layers where the head is "
                        "large (smollm2 on 2 stages: 17 + 13 of 30) (default: %(default)s)")
    p.add_argument("--pipelines", type=int, default=1,
                   help="independent pipelines (their own stages and coordinator each) behind the one admission, "
                        "which routes every request to one of them (default: %(default)s)")
    p.add_argument("--port", type=int, default=settings.ADMISSION_PORT,
                   help="admission's public gRPC port, fixed and reserved before anything starts: in use, the "
                        "start fails at once and says by whom (default: %(default)s)")
    p.add_argument("--http-port", type=int, default=settings.HTTP_PORT,
                   help="admission's OpenAI-compatible HTTP API port (base URL http://HOST:PORT/v1) "
                        "(default: %(default)s)")
    p.add_argument("--no-http", action="store_true", help="serve admission's gRPC port only, no HTTP API")
    p.add_argument("--coordinator-port", type=int, default=None, metavar="PORT",
                   help="pipeline k's coordinator listens on PORT + k (default: a port the kernel gives it, which "
                        "it reports to this launcher: internal ports can never collide)")
    p.add_argument("--stage-port", type=int, default=None, metavar="PORT",
                   help="stage i of pipeline k listens on PORT + k * stages + i (default: a port the kernel gives "
                        "it, reported to this launcher)")
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per stage (default: the machine's cores divided among all stages)")
    p.add_argument("--linear-inputs", default=settings.LINEAR_INPUTS, choices=dtypes.LINEAR_INPUTS,
                   help="what the stages' float32 linears multiply: their inputs as they are, or q8: rounded to 8 "
                        "bits per group against the model's GGUF Q4_1 / Q8_0 groups, as llama.cpp computes (faster; other "
                        "answers than float32's) (default: %(default)s)")
    p.add_argument("--demo", action="store_true", help="once up, send a few prompts and print the answers")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the cluster to come up")
    p.add_argument("--max-restarts", type=int, default=settings.SUPERVISE_MAX_RESTARTS, metavar="N",
                   help=f"restart a dead child at most N times within {settings.SUPERVISE_WINDOW_S:g} s; one more "
                        "crash stops the cluster with that child's exit code and log (default: %(default)s)")
    p.add_argument("--no-restart", action="store_true",
                   help="never restart: the first child to exit stops the cluster (same as --max-restarts 0)")
    p.add_argument("--metrics", action="store_true",
                   help=f"every service serves Prometheus metrics: admission on :{settings.ADMISSION_METRICS_PORT}"
                        f"/metrics, the coordinator on :{settings.COORDINATOR_METRICS_PORT}, stage i on "
                        f":{settings.STAGE_METRICS_BASE_PORT}+i (the ports docker-compose.yml and deploy/k8s use)")
    p.add_argument("--log-format", choices=settings.LOG_FORMATS, default=settings.LOG_FORMAT,
                   help="every service's log format: text, or json (one object per line, with the request id on "
                        "lines about a request) (default: %(default)s)")
    p.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                   help="write each service's output to DIR/NAME.log instead of this terminal; a child that "
                        "makes the launcher give up then has its last log lines shown")
    p.add_argument("--tls", action="store_true",
                   help="mutual TLS between the services and per-method authorization, TLS on the public port: "
                        "certificates from --tls-dir, made there (or in LOG_DIR/tls, else a temporary folder) by "
                        "`tether certs init` when missing. Without it every port is plaintext and unauthenticated")
    p.add_argument("--tls-dir", type=Path, default=None, metavar="DIR",
                   help="the `tether certs init` folder to take certificates from (implies --tls)")
    p.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                   help="admission's tenants file: per-tenant rate limits and, once it lists API keys "
                        "(`tether keys new`), every call needs one (the demo then sends $TETHER_API_KEY)")
    return p


def log_format_extra(fmt: str) -> dict[str, list[str]]:
    """LocalCluster `extra`: every service gets --log-format unless it is the default (commands stay short)."""
    if fmt == settings.LOG_FORMAT:
        return {}
    return {role: ["--log-format", fmt] for role in ("stage", "coordinator", "admission")}


def service_extra(args: argparse.Namespace) -> dict[str, list[str]]:
    """The flags `tether up` adds to the services' commands: --log-format, the stages' --linear-inputs,
    admission's --tenants."""
    extra = log_format_extra(args.log_format)
    if inputs := linear_inputs_flags(args.linear_inputs):
        extra["stage"] = extra.get("stage", []) + inputs
    if args.tenants is not None:
        if not args.tenants.is_file():
            raise SystemExit(f"tether up: --tenants {args.tenants}: no such file")
        extra["admission"] = extra.get("admission", []) + ["--tenants", str(args.tenants.resolve())]
    return extra


def _show(asked: str, params: dict, r) -> None:
    print(f"\n> {asked}\n  {params}\n  tags: language={r.tags.get('language')} task={r.tags.get('task')} "
          f"length_limit={r.tags.get('length_limit')}{r.tags.get('length_unit')} "
          f"domain={r.tags.get('domain')} audience={r.tags.get('audience')}\n"
          f"  answer ({len(r.token_ids)} tokens, {r.finish_reason}): {r.text!r}\n"
          f"  receipt: request {r.receipt.internal_id} context hash {r.receipt.context_hash:016x}", flush=True)


def _client(target: str, tls_dir: Path | None):
    """The SDK client of the demo; over TLS (verifying the cluster's CA) when the cluster runs it."""
    from tether.client import Client
    if tls_dir is None:
        return Client(target, timeout=300)
    return Client(target, timeout=300, tls_ca=str(tls_dir / "ca.pem"))


def run_demo(target: str, model: str = settings.DEFAULT_MODEL, tls_dir: Path | None = None) -> None:
    """A few answers, with their tags: conversations on a model with a chat template, raw prompts on one without;
    a random-weight preset's are noise, and the demo says so."""
    from tether.model.chat_template import load_chat_template
    from tether.model.loader import resolve_model
    from tether.model.presets import PRESETS

    with _client(target, tls_dir) as client:
        if load_chat_template(resolve_model(model)) is None:
            for prompt, params in DEMO_PROMPTS:
                _show(prompt, params, client.generate(prompt, **params))
        else:
            for messages, params in DEMO_CHATS:
                _show(messages[-1][1], params, client.chat(messages, **params))
            first, follow_up = DEMO_FOLLOW_UP
            reply = client.chat([("user", first)], max_tokens=32)
            conversation = [("user", first), ("assistant", reply.text), ("user", follow_up)]
            r = client.chat(conversation, max_tokens=48)
            print(f"\n> a conversation: {first!r} -> {reply.text!r}, then {follow_up!r}", flush=True)
            _show(follow_up, dict(max_tokens=48), r)
    if model in PRESETS:   # a random-weight preset (with a chat template or not): say so, or its output looks broken
        print(f"\n({model} has random weights: its answers are noise. The default model, "
              f"{settings.DEFAULT_MODEL}, answers for real: `tether up --demo`)", flush=True)
    elif model == settings.DEFAULT_MODEL:
        print("\n(SmolLM2-135M-Instruct is small: its English answers are short and sometimes wrong, and its Chinese "
              "is weak — the Chinese prompt is here to show the tags)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    if args.pipelines < 1 or args.stages < 1:
        parser.error("--pipelines and --stages must be >= 1")
    policy = RestartPolicy(max_restarts=0 if args.no_restart else args.max_restarts)
    threads = args.threads or max(1, (os.cpu_count() or 1) // (args.stages * args.pipelines))
    cluster = LocalCluster(model=args.model, stages=args.stages, pipelines=args.pipelines, host=args.host,
                           admission_port=args.port,
                           coordinator_port=args.coordinator_port, stage_port=args.stage_port, threads=threads,
                           log_dir=args.log_dir, metrics=args.metrics, extra=service_extra(args),
                           tls=args.tls or args.tls_dir is not None, tls_dir=args.tls_dir,
                           http=not args.no_http, http_port=args.http_port)
    stop, roll = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: roll.set())   # a rolling restart of the pipelines (e.g. new code)
    print(f"starting tether: model {args.model}, {args.pipelines} pipeline(s) of {args.stages} stage(s), "
          f"{threads} thread(s) each ...", flush=True)
    # Supervised from the start: a child that came up and then died while the others still start is restarted
    # like any later crash; only one that never came up fails the start. From this (the spawning) thread:
    # children die with it (PR_SET_PDEATHSIG, tether/procutil.py).
    supervisor = Supervisor(cluster, policy, time.monotonic(), say=lambda m: print(m, flush=True))
    try:
        cluster.start(timeout=args.timeout, supervisor=supervisor)
        for svc in cluster.services:
            metrics = f"  metrics {svc.metrics_url}" if svc.metrics_url else ""
            pid = svc.proc.pid if svc.proc is not None else "?"
            print(f"  {svc.name:<15} {svc.address}  (pid {pid}){metrics}", flush=True)
        print(f"tether is up: send requests to {cluster.target}, e.g. "
              f"`tether generate --target {cluster.target} \"The capital of France is\"`. Ctrl-C stops it.", flush=True)
        if cluster.base_url:
            name = os.path.basename(os.path.normpath(args.model)) or args.model   # admission's model id
            print(f"OpenAI-compatible API: base URL {cluster.base_url} (model {name!r}), e.g. "
                  f"`curl {cluster.base_url}/chat/completions -H 'content-type: application/json' "
                  f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'`",
                  flush=True)
        if cluster.tls and cluster.tls_dir is not None:   # start() made or read the folder
            print(f"TLS: certificates in {cluster.tls_dir}; clients verify the server with its CA "
                  f"(`tether generate --tls-ca {cluster.tls_dir / 'ca.pem'} ...`); operator.pem/.key may call Stats "
                  f"on the internal services and drain a coordinator (`tether drain --tls-dir {cluster.tls_dir}`)", flush=True)
        if args.demo:
            run_demo(cluster.target, args.model, cluster.tls_dir if cluster.tls else None)
        rolling: RollingRestart | None = None
        while not stop.wait(POLL_S):
            now = time.monotonic()
            if roll.is_set() and rolling is None:
                roll.clear()
                rolling = RollingRestart(cluster, supervisor, lambda name: coordinator_serving(cluster, name),
                                         say=lambda m: print(m, flush=True))
            if rolling is not None:
                rolling.poll(now)
                if rolling.done:
                    print("rolling restart: done", flush=True)
                    rolling = None
            supervisor.poll(now)
    except GaveUp as e:
        print(f"tether up: {e}", file=sys.stderr, flush=True)   # the cause first, then the shutdown
        exit_code = 1
    except (TimeoutError, RuntimeError, ValueError, OSError) as e:
        raise SystemExit(f"tether up: {e}") from None
    else:
        exit_code = 0
    finally:
        spawned = any(s.proc is not None for s in cluster.services)   # none: a public port was in use
        if spawned:
            print("stopping tether ...", flush=True)
        cluster.stop()
        if spawned:
            print("stopped.", flush=True)
    if exit_code:
        raise SystemExit(exit_code)
