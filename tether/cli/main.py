"""`tether`: run the cluster, talk to it, or run one service as a container would."""

from __future__ import annotations

import argparse
import sys


def _service(module: str):
    def run(argv: list[str]) -> None:
        mod = __import__(f"services.{module}.main", fromlist=["main"])
        mod.main(argv)
    return run


COMMANDS = {
    "up": ("start the local cluster (stages, coordinator, admission) as processes", "tether.cli.up"),
    "generate": ("send one prompt (or --system/--user) to a running cluster and print the answer",
                 "tether.cli.generate"),
    "chat": ("talk to a running cluster: an interactive conversation, replies streamed", "tether.cli.chat"),
    "tag": ("show the intent tags admission would give a prompt (no generation)", "tether.cli.generate"),
    "keys": ("make an API key for a tenant (the lines for admission's --tenants FILE)", "tether.cli.keys"),
    "bench": ("load-test a cluster: throughput, latency, fidelity audit, baselines", "tether.loadtest.cli"),
    "drain": ("take one pipeline out of service: its coordinator finishes or hands back what it holds",
              "tether.cli.drain"),
    "certs": ("make a local CA and a certificate per service (`tether certs init DIR`, for --tls)",
              "tether.cli.certs"),
    "stage": ("run one stage worker (as a container would)", None),
    "coordinator": ("run the coordinator (as a container would)", None),
    "admission": ("run the admission front door (as a container would)", None),
}
SERVICE_MODULES = {"stage": "stage_worker", "coordinator": "coordinator", "admission": "admission"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether",
        description="tether: pipeline-parallel LLM serving over gRPC; every activation stays tethered to the "
                    "request that produced it. Run `tether COMMAND --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:<12} {help_}" for name, (help_, _) in COMMANDS.items()))
    p.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="one of: " + ", ".join(COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return
    ns = build_parser().parse_args(argv[:1])
    rest = argv[1:]
    if ns.command in SERVICE_MODULES:
        _service(SERVICE_MODULES[ns.command])(rest)
        return
    name = COMMANDS[ns.command][1]
    assert name is not None   # only the service commands, handled above, have no module of their own
    module = __import__(name, fromlist=["main"])
    if ns.command == "tag":
        module.tag_main(rest)
    else:
        module.main(rest)


if __name__ == "__main__":
    main()
