"""Value types for argparse flags that the services' and the tools' command lines share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer flag that must be at least 1 (argparse's `type=`): a worded usage error otherwise."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {text}")
    return value
