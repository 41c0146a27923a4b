"""The experiment-only command-line flags every service that injects faults shares: ``--faults`` and
``--unsafe-disable-stamp-checks``, and their start-up warnings."""

from __future__ import annotations

import argparse
import logging
import os

from tether import settings
from tether.faults.spec import KINDS, FaultConfig


def add_experiment_flags(parser: argparse.ArgumentParser, where: str) -> None:
    """`--faults` and `--unsafe-disable-stamp-checks`, the same on every service that has them."""
    parser.add_argument(
        "--faults", default=os.environ.get(settings.FAULTS_ENV, ""), metavar="SPEC",
        help=f"inject faults into {where}, e.g. 'drop=0.02,corrupt=0.05,delay=0.1,delay_ms=50,seed=7'; kinds: "
             f"{', '.join(KINDS)} (rates are probabilities per frame). Default: ${settings.FAULTS_ENV}, off "
             f"when empty. For chaos tests only")
    parser.add_argument(
        "--unsafe-disable-stamp-checks", action="store_true",
        help="EXPERIMENT ONLY, NEVER IN SERVING: turn off the integrity checks (stamps, digests, sequence, "
             "echoes), so that faults reach the answers. It exists only to reproduce the wrong answers those "
             "checks prevent (run it with --faults)")


def experiment_config(parser: argparse.ArgumentParser, args: argparse.Namespace, log: logging.Logger) -> FaultConfig:
    """The parsed `--faults` (a bad spec is a usage error), with loud warnings for anything switched on."""
    try:
        config = FaultConfig.parse(args.faults)
    except ValueError as e:
        parser.error(f"--faults: {e}")
    if args.unsafe_disable_stamp_checks:
        log.warning("!" * 100)
        log.warning("STAMP CHECKS ARE DISABLED (--unsafe-disable-stamp-checks): this service CAN DELIVER ANOTHER "
                    "REQUEST'S OR GARBLED TOKENS. Experiment only: never serve traffic like this.")
        log.warning("!" * 100)
    if config.enabled:
        log.warning("fault injection ON: %s", config.spec())
    return config
