"""Which numerics this machine serves a model in: `--dtype auto` resolved, once per process.

float32 where our own C kernels build and the probe passes them as whole layers in one call (rowdot linears,
rowattn attention, rowlayer: one fixed-order chain per output, unpadded, exact fp32; on an AMD EPYC without
AVX-512 a decode step 3x faster than MKL padded to 4, then 2x again in one call; where the model's folder keeps
its GGUF groups the linears read those, tether/model/rowquant.py); else bfloat16 where the CPU computes it
natively and a start-up probe on the model's own shapes finds every op class row-count- and thread-invariant
without padding, from some small floor of rows on; else float32 on whatever of our kernels pass, padded
elsewhere. What we found on an AMD EPYC with avx512_bf16 (torch 2.13, oneDNN): bf16 `F.linear` gives the same
row bits for every row count >= 2 and thread count, where fp32 MKL changes them at M = 2, 4, ...; but a 1-row
product over K = 1536 (smollm2's down_proj) differs on ~10% of rows, so that product runs on at least 2 rows
(`probe_floors` returns each linear shape's floor apart from the rest's). On a CPU without native bf16 dot
products bf16 was 4-14x slower than fp32. Machines differ, so the machine decides: `choose_dtype` is the pure
rule, `cpu_flags` and `probe_floors` its inputs, `resolve` the cached whole.

How a dtype pads differs between machines too (MKL: 4 rows per thread on the EPYC, 16 on an Intel Xeon, where
oneDNN's fp32 linears need no padding from 2 rows): `choose_rule` picks the kernels and rows on 1 thread, so
every process on a machine picks the same whatever its thread count, `with_thread_cap` caps the threads where
more change bits, and `row_rule` is what a ModelSlice runs by (tether/model/invariant.py's RowRule).

Every process that must agree makes the same choice the same way (the stages, `tether.reference`); the
stage handshake refuses a pipeline whose stages chose differently (services/stage_worker/server.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import xxhash

from tether import settings
from tether.model import native, probe_cache, rowattn, rowlayer
from tether.model.config import ModelConfig
from tether.model.invariant import KERNELS, RowRule, threads_for
from tether.model.dtypes import AUTO, CHOICES, NAMES

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert tuple(DTYPES) == NAMES
# CPU flags (x86 /proc/cpuinfo "flags", aarch64 "Features") that mean native bf16 dot products.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# Row counts the probe compares against the rows of one larger batch: 1 and the small counts where fp32 MKL
# changes paths, odd counts (vector tails), and counts past a 16-row kernel block. Few, to keep start-up cheap.
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 17, 48)
# The most rows a micro-batch, or one linear's product, may be padded to where only the smallest row counts
# differ (`probe_floors`): bf16 oneDNN gives a 1-row product over K = 1536 (smollm2's down_proj) other bits
# than every M >= 2 for ~10% of rows, so that product runs on 2 rows. A floor above this means the dtype pads
# like fp32.
MAX_FLOOR = 4
# Unpadded, the linears (the LM head aside: it only ever sees a step's sampled rows) are also checked on one
# long batch (a long prefill's micro-batch) against windows of LONG_WINDOWS rows: the 48 rows above missed
# that on an Intel Xeon with AMX, bf16 products of 262 rows give other bits than of 50.
UNPADDED_LONG = 512
LONG_WINDOWS = (17, 48, 100, 256)
# Row counts every unfused SiLU is swept over (each thread's chunk of the tensor must end on a whole vector):
# on an AMD EPYC without AVX-512, tiny's [M, 688] on 2 threads differed at odd M >= 55.
SILU_ROWS = 160
# Rows per thread a padded rule may pad to, tried smallest first (each costs that many rows at batch 1).
UNITS = (4, 8, 16, 32, 64)
# MKL padded to at most this unit is kept over oneDNN's unpadded fp32 linears. smollm2's seven linears of a
# layer at 1 thread: on an AMD EPYC without AVX-512, MKL 1,067 us at 1 row (plain), 1,190 at 4 rows, oneDNN
# 2,833 at 2 rows (its floor; 693 at 1); on an Intel Xeon (AVX-512, AMX), MKL 561 at 1 row, 1,454 at 16 (its
# unit), oneDNN 1,030 at 2. Fewer padded rows was not the faster kernel.
MKL_UNIT_BEFORE_ONEDNN = 4
# bf16 linears tried in turn, the first whose probe passes chosen: oneDNN on weights packed once (F.linear
# reorders a bf16 weight on every call; on an AMD EPYC with avx512_bf16, the same bits at 0.6x the time),
# then F.linear itself.
BF16_KERNELS = ("onednn", "mkl")
# A padded rule is checked on windows of k units (k in PADDED_SPANS) against the rows of a batch of
# PADDED_WHOLE units computed on 1 thread; the LM head, whose products are the largest and which only ever sees
# a step's sampled rows, on the first HEAD_SPANS and the first 2 windows of each; the other linears also on
# one batch of PADDED_LONG units (a long prompt's prefill) against windows of PADDED_WHOLE.
PADDED_SPANS = (1, 2, 3, 4, 5, 8)
PADDED_WHOLE = 8
HEAD_SPANS = (1, 2, 3)
ATTENTIONS = ("tiles", "rowattn")   # RowRule.attention
LAYERS = ("modules", "rowlayer")    # RowRule.layers
PADDED_LONG = 32

def name_of(dtype: torch.dtype) -> str:
    """The --dtype (and handshake) name of a torch dtype."""
    return next(name for name, t in DTYPES.items() if t == dtype)


def choose_dtype(flags: Iterable[str], bf16_invariant: Callable[[], bool],
                 fp32_layers: Callable[[], bool] = lambda: False) -> str:
    """The `auto` rule: float32 when our own kernels run whole layers here (`fp32_layers`, asked first: exact
    fp32, and on the AMD EPYC with avx512_bf16 faster than bf16 at 1 and 8 rows, docs/PERFORMANCE.md); else
    bfloat16 when the CPU has native bf16 and the probe (called only then) finds the unpadded bf16 kernels
    invariant; float32 (padded) otherwise."""
    if fp32_layers():
        return "float32"
    if BF16_FLAGS.isdisjoint(flags):
        return "float32"
    return "bfloat16" if bf16_invariant() else "float32"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _failing_rows(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, threads: tuple[int, ...],
                  dim: int = 0, windows: int | None = None) -> set[int]:
    """The row counts m of PROBE_ROWS at which some window of m rows of `x` (along `dim`; every window, or the
    first `windows`: not just the first, as a 1-row product can differ on a few rows only) does not give the
    whole batch's rows, on some thread count. Empty: `op` is row-count- and thread-invariant on `x`.

    Along dim 0 (a micro-batch's rows) m rows are checked only on the threads serving runs them on
    (`invariant_threads`: at most one per 4 rows), which keeps the LM head's many 1-row products cheap."""
    whole, rows, failing = op(x), x.shape[dim], set()
    for t in threads:
        torch.set_num_threads(t)
        for m in PROBE_ROWS:
            if m > rows or m in failing or (dim == 0 and threads_for(m, RowRule(None), t) < t):
                continue
            starts = range(0, rows - m + 1, m)[:windows]
            if not all(torch.equal(op(x.narrow(dim, s, m)), whole.narrow(dim, s, m)) for s in starts):
                failing.add(m)
        if not torch.equal(op(x), whole):
            failing.add(rows)
    return failing


def floor_of(failing: Iterable[int]) -> int | None:
    """The fewest rows to pad a micro-batch to so that it never runs at a failing row count: the smallest of
    PROBE_ROWS above every failing count, if at most MAX_FLOOR; None: the dtype must pad like fp32."""
    top = max(failing, default=0)
    return next((m for m in PROBE_ROWS if m > top and m <= MAX_FLOOR), None)


def _attention_piece(keys: torch.Tensor, values: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The tiles' batched-matmul and softmax pieces (tether/model/tiles.py) over (tile, block) pairs: `piece(q,
    at)` attends q's pairs to the pairs of keys/values from `at` on."""
    d = keys.shape[-1]

    def piece(qq: torch.Tensor, at: int = 0) -> torch.Tensor:
        kk, vv = keys[at:at + qq.shape[0]], values[at:at + qq.shape[0]]
        s = torch.matmul(qq * d ** -0.5, kk.mT)
        p = (s - s.amax(-1, keepdim=True)).clamp_(min=-87.0).exp_()
        return torch.matmul(p, vv) / p.sum(-1, keepdim=True)
    return piece


def _rope(heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """RoPE as the slice applies it, its tables riding along as two extra columns of heads, so that a window
    of rows gets its own rows' tables."""
    from tether.model.llama import rotate_half   # the serving code's own op (llama imports us)

    def rope(x: torch.Tensor) -> torch.Tensor:
        x, c, s = x[:, :heads], x[:, heads:heads + 1], x[:, heads + 1:]
        return x * c + rotate_half(x) * s
    return rope


def _attention_failing(cfg: ModelConfig, dtype: torch.dtype, threads: tuple[int, ...], block: int) -> set[int]:
    """The tiles' batched matmuls and softmax pieces (tether/model/tiles.py) over unpadded tile heights: a
    tile's rows are the same whatever the tile's height and however many (tile, block) pairs share the batch.
    Returns the failing tile heights in positions (`_failing_rows`), plus `block` where pairs interfere; any
    makes the dtype pad."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    d, kvh, pairs = cfg.head_dim, cfg.num_key_value_heads, 5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(pairs, kvh, group * block, d, generator=g).to(dtype)
    keys = torch.randn(pairs, kvh, block, d, generator=g).to(dtype)
    values = torch.randn(pairs, kvh, block, d, generator=g).to(dtype)
    piece = _attention_piece(keys, values)

    # a tile of `count` positions has group * count rows: windows of its heads' rows, as positions
    by_position = q.view(pairs, kvh, block, group, d)
    failing = _failing_rows(lambda qq: piece(qq.flatten(2, 3)).unflatten(2, (-1, group)), by_position, threads, 2, 8)
    whole = piece(q)
    for t in threads:   # each pair alone, as in the batch of all
        torch.set_num_threads(t)
        if not all(torch.equal(piece(q[n:n + 1], n), whole[n:n + 1]) for n in range(pairs)):
            failing.add(block)
    return failing


Floors = tuple[int, tuple[tuple[int, int, int], ...]]


def probe_floors(cfg: ModelConfig, dtype: torch.dtype, block: int = 64,
                 kernel: str = "mkl", attention: bool = True) -> Floors | None:
    """Every op class of the model's forward, on its own shapes and random values, unpadded: each linear
    (attention projections, MLP, LM head), RMSNorm, RoPE, SiLU-and-mul and the attention pieces, on 1 or all
    threads. Returns the floor (`floor_of`) from which every op but the linears gives the same row bits (1
    where all do) and each linear shape whose own floor is higher, as (in, out, rows): a micro-batch runs on at
    least the first, such a product on at least its own (RowRule.linear_floors). None where the dtype must be
    padded like fp32. `kernel`: the linears' (invariant.KERNELS: "mkl" is F.linear), on weights it prepares,
    whose gate projection is checked with its SiLU; without `attention` the tiles are not checked (the caller
    pads them)."""
    from tether.model.llama import RMSNorm   # the serving code's own op (llama imports us)

    before = torch.get_num_threads()
    threads = tuple(sorted({1, before}))
    g = torch.Generator().manual_seed(0)
    rows = max(PROBE_ROWS)
    h, d = cfg.hidden_size, cfg.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    linears = {(h, cfg.num_attention_heads * d), (h, cfg.num_key_value_heads * d), (cfg.num_attention_heads * d, h),
               (h, cfg.intermediate_size), (cfg.intermediate_size, h), (h, cfg.vocab_size)}
    norm = RMSNorm(h, cfg.rms_norm_eps).to(dtype).requires_grad_(False)
    cos, sin = rand(rows, 1, d), rand(rows, 1, d)
    rope = _rope(cfg.num_attention_heads)

    run = KERNELS[kernel]
    def linear(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        prepared = run.prepare(w)
        return lambda x: run.linear(x, prepared, None)

    gate_w = run.prepare(rand(cfg.intermediate_size, h) * 20)
    def gate(x: torch.Tensor) -> torch.Tensor:   # the gate projection and its SiLU, as the slice computes them
        return run.gate(x, gate_w, None)

    # each check keyed by the linear shape whose floor it sets (None: the micro-batch's own floor)
    gate_shape = (h, cfg.intermediate_size)
    checks: list[tuple[tuple[int, int] | None, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = [
        ((i, o), linear(rand(o, i)), rand(rows, i)) for i, o in sorted(linears)]
    checks += [
        (None, norm, rand(rows, h) * 20),
        (None, rope, torch.cat([rand(rows, cfg.num_attention_heads, d), cos, sin], 1)),
        (gate_shape, gate, rand(rows, h)),
    ]
    try:
        with torch.inference_mode():
            failing: dict[tuple[int, int] | None, set[int]] = {None: set()}
            for key, op, x in checks:
                torch.set_num_threads(1)
                found = failing.setdefault(key, set())
                found |= _failing_rows(op, x, threads)
                if floor_of(found) is None:
                    return None
            if not KERNELS[kernel].fused_silu and not _silu_holds(cfg, dtype, range(1, SILU_ROWS + 1), threads):
                return None
            long_ops = [(linear(rand(o, i)), i) for i, o in sorted(linears) if o != cfg.vocab_size] + [(gate, h)]
            for op, i in long_ops:
                x = rand(UNPADDED_LONG, i)
                torch.set_num_threads(1)
                whole = op(x)
                for t in threads:
                    torch.set_num_threads(t)
                    if _window_differs(op, x, whole, LONG_WINDOWS):
                        return None
            torch.set_num_threads(1)
            # tile heights are never floored (tiles.py pads them only where the micro-batch pads); without
            # `attention` the caller pads tile heights and checks them (`_tiles_hold`)
            if attention and _attention_failing(cfg, dtype, threads, block):
                return None
            base = floor_of(failing.pop(None))
            own: dict[tuple[int, int], int] = {}
            for key, found in failing.items():
                n = floor_of(found)
                assert key is not None and n is not None   # every set was checked above
                own[key] = n
            assert base is not None
            # where every linear needs more rows than the rest, the micro-batch runs on them (one pad, not seven)
            base = max(base, min(own.values()))
            return base, tuple(sorted((i, o, n) for (i, o), n in own.items() if n > base))
    finally:
        torch.set_num_threads(before)


def _silu_holds(cfg: ModelConfig, dtype: torch.dtype, counts: Iterable[int], threads: Iterable[int]) -> bool:
    """Whether ATen's SiLU (unfused, as KERNELS["mkl"].gate runs it) gives the first rows of [m, intermediate]
    the bits of a taller batch's for every m in `counts`, on each thread count: its vector loop leaves each
    thread's chunk a scalar tail, so bits follow where the chunks end (cheap: elementwise, every count)."""
    g = torch.Generator().manual_seed(7)
    counts = list(counts)
    x = (torch.randn(max(counts) + 1, cfg.intermediate_size, generator=g) * 4).to(dtype)
    torch.set_num_threads(1)
    whole = F.silu(x)
    for t in threads:
        torch.set_num_threads(t)
        if not all(torch.equal(F.silu(x[:m]), whole[:m]) for m in counts):
            return False
    return True


def _window_differs(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, whole: torch.Tensor,
                    sizes: Iterable[int], dim: int = 0, windows: int | None = None) -> bool:
    """Whether some window of m rows of `x` (m in `sizes`, along `dim`; every window or the first `windows`)
    gives other bits than the same rows of `whole` (op over all of x, computed beforehand)."""
    rows = x.shape[dim]
    for m in sizes:
        for s in range(0, rows - m + 1, m)[:windows]:
            if not torch.equal(op(x.narrow(dim, s, m)), whole.narrow(dim, s, m)):
                return True
    return False


def _padded_checks(cfg: ModelConfig, dtype: torch.dtype, unit: int, threads: int,
                   check: Callable[[ModelConfig, torch.dtype, int, int], bool] | None = None) -> bool:
    """`check` (every op class padded, `_padded_holds`, by default) with torch's thread count restored."""
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            return (check or _padded_holds)(cfg, dtype, unit, threads)
    finally:
        torch.set_num_threads(before)


def _padded_holds(cfg: ModelConfig, dtype: torch.dtype, unit: int, threads: int) -> bool:
    """Whether every op class of the forward, with rows padded to multiples of unit * threads and run on
    `threads` threads, gives the rows the bits of one batch computed on 1 thread: each linear (the LM head on
    fewer, smaller windows), RMSNorm, RoPE, SiLU-and-mul, and the attention tiles' batched matmuls over tile
    heights that are multiples of the unit (tether/model/tiles.py)."""
    from tether.model.llama import RMSNorm   # the serving code's own op (llama imports us)

    g = torch.Generator().manual_seed(unit * 100 + threads)
    step, h, d = unit * threads, cfg.hidden_size, cfg.head_dim
    heads, kvh = cfg.num_attention_heads, cfg.num_key_value_heads

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    def differs(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, spans: Iterable[int],
                dim: int = 0, windows: int | None = None) -> bool:
        torch.set_num_threads(1)
        whole = op(x)
        torch.set_num_threads(threads)
        return _window_differs(op, x, whole, [k * step for k in spans], dim, windows)

    rows = PADDED_WHOLE * step
    for i, o in sorted({(h, heads * d), (h, kvh * d), (heads * d, h), (h, cfg.intermediate_size),
                        (cfg.intermediate_size, h)}):
        w = rand(o, i)
        def linear(x: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:
            return F.linear(x, w)
        if differs(linear, rand(rows, i), PADDED_SPANS) or differs(linear, rand(PADDED_LONG * step, i), [PADDED_WHOLE]):
            return False
    head = rand(cfg.vocab_size, h)
    if differs(lambda x: F.linear(x, head), rand(max(HEAD_SPANS) * step, h), HEAD_SPANS, windows=2):
        return False
    norm = RMSNorm(h, cfg.rms_norm_eps).to(dtype).requires_grad_(False)
    if (differs(norm, rand(rows, h) * 20, PADDED_SPANS)
            or differs(_rope(heads), rand(rows, heads + 2, d), PADDED_SPANS)
            or differs(lambda x: F.silu(x) * x.flip(-1), rand(rows, cfg.intermediate_size) * 20, PADDED_SPANS)
            or not _silu_holds(cfg, dtype, range(step, SILU_ROWS + 1, step), (threads,))):
        return False
    return _tiles_hold(cfg, dtype, unit, threads)


def _tiles_hold(cfg: ModelConfig, dtype: torch.dtype, unit: int, threads: int) -> bool:
    """Whether the attention tiles' batched matmuls and softmax pieces, over tile heights that are multiples of
    unit * threads, give each tile row the bits of the tallest tile computed on 1 thread, and each (tile,
    block) pair alone the bits it has among others."""
    g = torch.Generator().manual_seed(unit * 100 + threads + 1)
    step, d = unit * threads, cfg.head_dim
    heads, kvh = cfg.num_attention_heads, cfg.num_key_value_heads

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    # tile rows along dim 2, up to the tallest tile (a block of positions of every grouped head)
    block, pairs = settings.ATTENTION_BLOCK, 5
    height = max(step, -(-heads // kvh * block // step) * step)
    q = rand(pairs, kvh, height, d) * 20
    piece = _attention_piece(rand(pairs, kvh, block, d) * 20, rand(pairs, kvh, block, d) * 20)

    torch.set_num_threads(1)
    whole = piece(q)
    torch.set_num_threads(threads)
    if _window_differs(piece, q, whole, [k * step for k in range(1, height // step + 1)], dim=2, windows=2):
        return False
    return all(torch.equal(piece(q[n:n + 1], n), whole[n:n + 1]) for n in range(pairs))


def padded_probe(cfg: ModelConfig, dtype: torch.dtype) -> RowRule | None:
    """MKL padded: the smallest of UNITS whose padded row counts give every op class the same row bits on 1
    thread; None where no unit is invariant."""
    unit = next((u for u in UNITS if _padded_checks(cfg, dtype, u, 1)), None)
    return None if unit is None else RowRule(unit)


def onednn_probe(cfg: ModelConfig, dtype: torch.dtype) -> RowRule | None:
    """fp32 linears through oneDNN (invariant.onednn_linear) unpadded from a floor (`unpadded_fp32_probe`). On an
    Intel Xeon MKL's fp32 rows change below 16 rows, oneDNN's only at 1: a decode step alone runs as 2 rows, not
    16. None where oneDNN is absent or not invariant."""
    if not torch.backends.mkldnn.is_available():
        return None
    return unpadded_fp32_probe(cfg, dtype, "onednn")


def rowdot_probe(cfg: ModelConfig, dtype: torch.dtype) -> RowRule | None:
    """fp32 linears on our own kernel (tether/model/rowdot.py), where it runs: invariant by construction, which
    the probe checks like any other kernel's; with our row-at-a-time attention (tether/model/rowattn.py) where
    its own check passes (then no tiles pad), else the tiles. None where it cannot be built here or a check
    fails."""
    rule = unpadded_fp32_probe(cfg, dtype, "rowdot")
    if rule is None:
        return None
    threads = tuple(sorted({1, torch.get_num_threads()}))
    if not rowattn.holds(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, settings.ATTENTION_BLOCK,
                         threads):
        return rule
    rule = dataclasses.replace(rule, tile_unit=None, attention="rowattn")
    if _layers_hold(cfg, threads):
        return dataclasses.replace(rule, layers="rowlayer")
    return rule


def _layers_hold(cfg: ModelConfig, threads: tuple[int, ...]) -> bool:
    """Whether whole layers in one call (tether/model/rowlayer.py) give every row the same bits however the
    rows are windowed and on each of `threads`."""
    return rowlayer.holds(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                          cfg.head_dim, settings.ATTENTION_BLOCK, threads)


def unpadded_fp32_probe(cfg: ModelConfig, dtype: torch.dtype, kernel: str) -> RowRule | None:
    """fp32 linears on `kernel` unpadded from a floor, where `probe_floors` finds every op class but the tiles
    invariant so on 1 thread, with the tiles' heights padded by the smallest unit that holds for them (MKL's
    batched matmuls). None where the kernel does not run here or is not invariant."""
    if dtype != torch.float32:
        return None
    floors = _on_threads(1, lambda: _floors_if_runs(cfg, dtype, kernel=kernel, attention=False))
    if floors is None:
        return None
    unit = next((u for u in UNITS if _padded_checks(cfg, dtype, u, 1, _tiles_hold)), None)
    return None if unit is None else RowRule(None, floors[0], linear=kernel, tile_unit=unit,
                                             linear_floors=floors[1])


def _floors_if_runs(cfg: ModelConfig, dtype: torch.dtype, kernel: str, attention: bool = True) -> Floors | None:
    """`probe_floors`, or None where the kernel does not run here at all (a oneDNN build that cannot pack
    this dtype's weights raises): a kernel that cannot run is not invariant, and another is tried."""
    try:
        return probe_floors(cfg, dtype, kernel=kernel, attention=attention)
    except (RuntimeError, OSError) as e:
        log.warning("%s linears do not run here for %s (%s): not chosen", kernel, name_of(dtype), e)
        return None


def _on_threads(threads: int, run: Callable[[], Any]) -> Any:
    """`run()` with torch on `threads` threads, then the count restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def choose_rule(cfg: ModelConfig, dtype: torch.dtype) -> RowRule | None:
    """The kernels and rows `dtype` runs this model on here, chosen on 1 thread, so that every process on the
    machine chooses the same whatever its thread count (a row's bits depend on the rule): bf16 unpadded from
    `probe_floors`' floors where the CPU has native bf16 and the probe passes (on the first of BF16_KERNELS
    that does); else, in fp32, our own rowdot kernel where it runs and every row count from 1 gives the same bits
    (`rowdot_probe`: nothing padded but the tiles; on an AMD EPYC without AVX-512 its 15 smollm2 layers'
    linears took 12 ms at 1 row and 29 at 8 against MKL's 36 and 47 padded, docs/PERFORMANCE.md); else MKL
    padded (`padded_probe`) where its unit is at most MKL_UNIT_BEFORE_ONEDNN, oneDNN's
    fp32 linears (`onednn_probe`) where MKL pads more or is not invariant; None where no kernels are invariant. Chosen by the probes' answers, not by timing them,
    so that two processes probing at once cannot choose differently."""
    if dtype == torch.bfloat16 and not BF16_FLAGS.isdisjoint(cpu_flags()):
        for kernel in BF16_KERNELS if torch.backends.mkldnn.is_available() else ("mkl",):
            floors = _on_threads(1, functools.partial(_floors_if_runs, cfg, dtype, kernel=kernel))
            if floors is not None:
                return RowRule(None, floors[0], linear=kernel, linear_floors=floors[1])
    own = rowdot_probe(cfg, dtype)
    if own is not None and own.floor == 1 and not own.linear_floors:   # pads nothing but the tiles
        return own
    fast, padded = onednn_probe(cfg, dtype), padded_probe(cfg, dtype)
    if fast is None or (padded is not None and padded.unit is not None and padded.unit <= MKL_UNIT_BEFORE_ONEDNN):
        return padded
    return fast


def holds_on(cfg: ModelConfig, dtype: torch.dtype, rule: RowRule, threads: int) -> bool:
    """Whether `rule`'s kernels give the 1-thread bits on `threads` threads too, on every op class it checks."""
    if rule.unit is not None:
        return _padded_checks(cfg, dtype, rule.unit, threads)
    tiles = rule.attention == "tiles"
    floors = _on_threads(threads, lambda: probe_floors(cfg, dtype, kernel=rule.linear,
                                                       attention=tiles and rule.tile_unit is None))
    if floors is None or floors[0] > rule.floor or any(n > max(rule.floor, rule.linear_floor(i, o))
                                                       for i, o, n in floors[1]):
        return False
    if rule.layers == "rowlayer" and not _layers_hold(cfg, (1, threads)):
        return False
    if not tiles:
        return rowattn.holds(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             settings.ATTENTION_BLOCK, (1, threads))
    return rule.tile_unit is None or _padded_checks(cfg, dtype, rule.tile_unit, threads, _tiles_hold)


def with_thread_cap(cfg: ModelConfig, dtype: torch.dtype, rule: RowRule) -> RowRule:
    """`rule` capped at the most threads, up to torch's count, on which it still gives 1-thread bits (a cap of
    1: the forward keeps to 1 thread; no cap where all hold)."""
    most, threads = 1, torch.get_num_threads()
    while most < threads and holds_on(cfg, dtype, rule, most + 1):
        most += 1
    return dataclasses.replace(rule, threads=None if most == threads else most)


_LOCK = threading.Lock()


# The code an answer kept on disk depends on: the probe and the serving ops it checks. Any edit to these files
# makes a new key, so an answer found by other code is never read (no version number to forget to bump).
_PROBED_CODE = ("numerics.py", "llama.py", "tiles.py", "invariant.py", "native.py", "rowdot.py", "rowattn.py",
                "rowlayer.py", "rowquant.py", "kernels/rowdot.c", "kernels/rowdot512.c", "kernels/rowquant.c",
                "kernels/rowattn.c", "kernels/rowlayer.c", "kernels/vecmath.h", "kernels/rows.h")


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    here = Path(__file__).parent
    return xxhash.xxh3_64_hexdigest(b"".join((here / name).read_bytes() for name in _PROBED_CODE))


def _is_rule(value: object) -> bool:
    """A rule as kept on disk (`dataclasses.asdict`), or None (no invariant kernels)."""
    if value is None:
        return True
    if not isinstance(value, dict) or set(value) != {f.name for f in dataclasses.fields(RowRule)}:
        return False
    unit, floor, threads, linear, tile = (value[k] for k in ("unit", "floor", "threads", "linear", "tile_unit"))
    floors = value["linear_floors"]
    if not isinstance(floors, (list, tuple)) or not all(
            isinstance(f, (list, tuple)) and len(f) == 3 and all(type(n) is int and n >= 1 for n in f) and f[2] <= MAX_FLOOR
            for f in floors):
        return False
    return ((unit is None or unit in UNITS) and type(floor) is int and 1 <= floor <= MAX_FLOOR
            and value["attention"] in ATTENTIONS and value["layers"] in LAYERS
            and value["inputs"] == "float32"   # what the probes find; q8 is asked for after (ModelSlice.use_inputs)
            and (threads is None or (type(threads) is int and threads >= 1)) and linear in KERNELS
            and (tile is None or tile in UNITS) and all(type(v) is int for v in (unit, tile) if v is not None))


@functools.lru_cache(maxsize=16)
def _found(cfg: ModelConfig, dtype: torch.dtype, threads: int) -> RowRule | None:
    def compute() -> dict[str, Any] | None:
        rule = choose_rule(cfg, dtype)
        return None if rule is None else dataclasses.asdict(with_thread_cap(cfg, dtype, rule))
    # whether our C kernels run here is part of the key: an answer that names them is never read where they
    # cannot be built, or are turned off
    code = _code_digest() + ("+native" if native.available() is None else "")
    answer = probe_cache.cached(probe_cache.key(code, cfg, dtype, threads), compute, _is_rule)
    return None if answer is None else RowRule(**answer)


def servable_rule(cfg: ModelConfig, dtype: torch.dtype) -> RowRule | None:
    """`choose_rule` with this process's thread cap (`with_thread_cap`), cached per process and on disk per
    machine (tether/model/probe_cache.py); None where `dtype` has no invariant kernels here."""
    with _LOCK:
        return _found(cfg, dtype, torch.get_num_threads())


def row_rule(cfg: ModelConfig, dtype: torch.dtype) -> RowRule:
    """`servable_rule`, or a clear error where the dtype has no invariant kernels here."""
    rule = servable_rule(cfg, dtype)
    if rule is None:
        raise ValueError(f"{name_of(dtype)} has no batch-invariant kernels on this CPU (torch {torch.__version__}): "
                         f"a row's bits change with the row count however its rows are padded (to a multiple of "
                         f"any of {', '.join(map(str, UNITS))} per thread), so it cannot give exact answers here; "
                         f"use --dtype auto or float32")
    return rule


def unpadded_floor(cfg: ModelConfig, dtype: torch.dtype) -> int | None:
    """The fewest rows bf16's own kernels run a micro-batch of this model on unpadded here (`probe_floors`'
    first, where the CPU has native bf16; a linear may pad its own product further, RowRule.linear_floors), or
    None: bf16 pads or is refused, and other dtypes are not asked."""
    rule = servable_rule(cfg, dtype) if dtype == torch.bfloat16 else None
    return rule.floor if rule is not None and not rule.padded else None


def unpadded_invariant(cfg: ModelConfig, dtype: torch.dtype) -> bool:
    """Whether `dtype`'s kernels may run unpadded (to at most `unpadded_floor` rows) for this model here."""
    return unpadded_floor(cfg, dtype) is not None


def resolve(requested: str, cfg: ModelConfig) -> str:
    """`requested` (a --dtype value) as the dtype this process serves `cfg` in."""
    if requested != AUTO:
        if requested not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(CHOICES)}; got {requested!r}")
        return requested
    return choose_dtype(cpu_flags(), lambda: unpadded_invariant(cfg, torch.bfloat16), lambda: fp32_layers(cfg))


def fp32_layers(cfg: ModelConfig) -> bool:
    """Whether float32 runs this model's layers in one call of our own kernels here (rowlayer)."""
    rule = servable_rule(cfg, torch.float32)
    return rule is not None and rule.layers == "rowlayer"
