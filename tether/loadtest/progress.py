"""A one-line live summary with a progress bar on stderr while a level runs.

On a terminal the line is redrawn in place; when stderr is a file or a pipe (CI logs) a line is printed at
most every `LOG_INTERVAL_S` seconds and at the end, so logs stay short.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from tether.loadtest.records import RequestRecord
from tether.loadtest.stats import percentile

BAR_WIDTH = 24
LOG_INTERVAL_S = 5.0


class Progress:
    """`update(record)` after each request; `close()` once the level is done, or use it as `async with` to
    also redraw twice a second. Fraction done is by request count when the level has one, else by time."""

    def __init__(self, label: str, total: int | None = None, duration_s: float | None = None,
                 stream: TextIO = sys.stderr, enabled: bool = True) -> None:
        self.label = label
        self.total = total
        self.duration_s = duration_s
        self.stream = stream
        self.enabled = enabled
        self.live = enabled and stream.isatty()
        self.t0 = time.perf_counter()
        self.last_print = 0.0
        self.done = self.failed = self.tokens = 0
        self.ttfts: list[float] = []

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        if rec.ok:
            self.tokens += rec.output_tokens
            if rec.ttft is not None:
                self.ttfts.append(rec.ttft)
        else:
            self.failed += 1
        self._emit(final=False)

    async def _tick(self, interval_s: float = 0.5) -> None:
        while True:   # redraw without new results too, so elapsed time moves while requests are slow
            await asyncio.sleep(interval_s)
            self._emit(final=False)

    async def __aenter__(self) -> "Progress":
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._ticker.cancel()
        self.close()

    def close(self) -> None:
        self._emit(final=True)
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        if self.total:
            frac, count = self.done / self.total, f"{self.done}/{self.total} req"
        else:
            frac, count = elapsed / self.duration_s if self.duration_s else 0.0, f"{self.done} req"
        frac = min(1.0, frac)
        filled = round(frac * BAR_WIDTH)
        ttft = f"{percentile(self.ttfts, 50) * 1000:.0f} ms" if self.ttfts else "-"
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return (f"{self.label:<18} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {count:>11}  "
                f"err {self.failed:<3} {rate:7.1f} tok/s  TTFT p50 {ttft:>8}  {elapsed:6.1f}s")

    def _emit(self, final: bool) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.live:
            self.stream.write("\r" + self.line())
        elif final or now - self.last_print >= LOG_INTERVAL_S:
            self.stream.write(self.line() + "\n")
            self.last_print = now
        else:
            return
        self.stream.flush()
