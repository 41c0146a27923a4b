"""Fault specs: the kinds, and parsing ``drop=0.02,corrupt=0.05,delay_ms=50,seed=7`` into a FaultConfig.

Pure logic: no gRPC, no clock, no randomness (tether/faults/injector.py draws the faults).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from tether import settings

KINDS = ("drop", "duplicate", "reorder", "delay", "corrupt", "swap_slots", "cross_ids", "forget_kv", "crash")
PARAMS = ("seed", "delay_ms", "hold_ms")
ENV = settings.FAULTS_ENV   # "TETHER_FAULTS"
DEFAULT_DELAY_MS = 50.0
# Kinds whose faulted slots the ledger follows to an outcome (caught or slipped); see FaultLedger.
FOLLOWED = ("drop", "reorder", "corrupt", "swap_slots", "cross_ids", "forget_kv")


def _spec_error(msg: str) -> ValueError:
    return ValueError(f"{msg}; a fault spec is KIND=RATE,... with RATE a probability in [0, 1] "
                      f"(kinds: {', '.join(KINDS)}) and optional {', '.join(p + '=N' for p in PARAMS)}, "
                      f"e.g. 'drop=0.02,corrupt=0.05,delay=0.1,delay_ms=50,seed=7'")


@dataclass(frozen=True)
class FaultConfig:
    rates: Mapping[str, float] = field(default_factory=dict)   # kind -> probability per frame / reply
    seed: int = 0
    delay_ms: float = DEFAULT_DELAY_MS
    hold_ms: float | None = None      # how long a reorder-held frame waits for a successor (default 2 × delay)

    @property
    def enabled(self) -> bool:
        return any(r > 0 for r in self.rates.values())

    def rate(self, kind: str) -> float:
        return self.rates.get(kind, 0.0)

    @property
    def hold_s(self) -> float:
        return (2 * self.delay_ms if self.hold_ms is None else self.hold_ms) / 1000

    @classmethod
    def parse(cls, spec: str | None) -> FaultConfig:
        """Parse 'drop=0.02,corrupt=0.05,delay_ms=50,seed=7'; empty or None means off."""
        rates: dict[str, float] = {}
        params: dict[str, float] = {}
        for item in (spec or "").split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise _spec_error(f"fault spec item {item!r} is not KEY=VALUE")
            if key in rates or key in params:
                raise _spec_error(f"fault spec names {key!r} twice")
            if key in KINDS:
                try:
                    rate = float(value)
                except ValueError:
                    raise _spec_error(f"rate of {key!r} must be a number, got {value!r}") from None
                if not 0.0 <= rate <= 1.0:   # also refuses nan
                    raise _spec_error(f"rate of {key!r} must be in [0, 1], got {value}")
                rates[key] = rate
            elif key == "seed":
                try:
                    params[key] = int(value) if value.lstrip("+-").isdigit() else int(value, 0)   # 7, 007, 0x7
                except ValueError:
                    raise _spec_error(f"seed must be an integer, got {value!r}") from None
            elif key in PARAMS:
                try:
                    ms = float(value)
                except ValueError:
                    raise _spec_error(f"{key} must be a number of milliseconds, got {value!r}") from None
                if not (math.isfinite(ms) and ms >= 0):
                    raise _spec_error(f"{key} must be >= 0, got {value}")
                params[key] = ms
            else:
                raise _spec_error(f"unknown fault {key!r}")
        return cls(rates=rates, seed=int(params.get("seed", 0)),
                   delay_ms=params.get("delay_ms", DEFAULT_DELAY_MS), hold_ms=params.get("hold_ms"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultConfig:
        """The spec in TETHER_FAULTS (off when unset or empty)."""
        return cls.parse((os.environ if environ is None else environ).get(ENV, ""))

    def spec(self) -> str:
        """The canonical spec string (``parse(c.spec()) == c``)."""
        items = [f"{k}={self.rates[k]:g}" for k in KINDS if k in self.rates]
        items.append(f"seed={self.seed}")
        items.append(f"delay_ms={self.delay_ms:g}")
        if self.hold_ms is not None:
            items.append(f"hold_ms={self.hold_ms:g}")
        return ",".join(items)
