"""Which numerics this machine serves a model in: `--dtype auto` resolved, once per process.

bfloat16 where the CPU computes it natively and a start-up probe on the model's own shapes finds every op
class row-count- and thread-invariant without padding; float32 with the padding of tether/model/invariant.py
otherwise. What we found on an AMD EPYC with avx512_bf16 (torch 2.13, oneDNN): bf16 `F.linear` gives the
same row bits for every row count and thread count, where fp32 MKL changes them at M = 2, 4, ...; on a CPU
without native bf16 dot products bf16 was 4-14x slower than fp32. Machines differ, so the machine decides:
`choose_dtype` is the pure rule, `cpu_flags` and `probe` its inputs, `resolve` the cached whole.

Every process that must agree makes the same choice the same way (the stages, `tether.reference`); the
stage handshake refuses a pipeline whose stages chose differently (services/stage_worker/server.py).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from tether.model.config import ModelConfig
from tether.model.dtypes import AUTO, CHOICES, NAMES, model_part, served_fingerprint  # noqa: F401 - re-exported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert tuple(DTYPES) == NAMES
# CPU flags (x86 /proc/cpuinfo "flags", aarch64 "Features") that mean native bf16 dot products.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# Row counts the probe compares against the rows of one larger batch: 1 and the small counts where fp32 MKL
# changes paths, odd counts (vector tails), and counts past a 16-row kernel block. Few, to keep start-up cheap.
PROBE_ROWS = (1, 2, 3, 5, 8, 17, 48)


def name_of(dtype: torch.dtype) -> str:
    """The --dtype (and handshake) name of a torch dtype."""
    return next(name for name, t in DTYPES.items() if t == dtype)


def choose_dtype(flags: Iterable[str], bf16_invariant: Callable[[], bool]) -> str:
    """The `auto` rule: bfloat16 when the CPU has native bf16 and the probe (called only then) finds the
    unpadded bf16 kernels invariant; float32 (padded) otherwise."""
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


def _rows_invariant(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, threads: tuple[int, ...]) -> bool:
    """Does every prefix of `x`'s rows give the rows of the whole batch, on every thread count?"""
    whole = op(x)
    for t in threads:
        torch.set_num_threads(t)
        for m in PROBE_ROWS:
            if m <= x.shape[0] and not torch.equal(op(x[:m]), whole[:m]):
                return False
        if not torch.equal(op(x), whole):
            return False
    return True


def _attention_invariant(cfg: ModelConfig, dtype: torch.dtype, threads: tuple[int, ...], block: int) -> bool:
    """The tiles' batched matmuls and softmax pieces (tether/model/tiles.py) over unpadded tile heights: a
    tile's rows are the same whatever the tile's height and however many (tile, block) pairs share the batch."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    d, kvh, pairs = cfg.head_dim, cfg.num_key_value_heads, 5
    height = group * block
    g = torch.Generator().manual_seed(0)
    q = torch.randn(pairs, kvh, height, d, generator=g).to(dtype)
    keys = torch.randn(pairs, kvh, block, d, generator=g).to(dtype)
    values = torch.randn(pairs, kvh, block, d, generator=g).to(dtype)

    def piece(qq: torch.Tensor) -> torch.Tensor:
        n = qq.shape[0]
        s = torch.matmul(qq * d ** -0.5, keys[:n].mT)
        p = (s - s.amax(-1, keepdim=True)).clamp_(min=-87.0).exp_()
        return torch.matmul(p, values[:n]) / p.sum(-1, keepdim=True)

    whole = piece(q)
    for t in threads:
        torch.set_num_threads(t)
        for n in (1, pairs):
            for count in PROBE_ROWS:
                if count <= block and not torch.equal(piece(q[:n, :, :group * count]), whole[:n, :, :group * count]):
                    return False
    return True


def probe(cfg: ModelConfig, dtype: torch.dtype, block: int = 64) -> bool:
    """Every op class of the model's forward, on its own shapes and random values, unpadded: each linear
    (attention projections, MLP, LM head), RMSNorm, RoPE, SiLU-and-mul and the attention pieces give the same
    row bits for every row count and on 1 or all threads."""
    from tether.model.llama import RMSNorm, rotate_half   # the serving code's own ops (llama imports us)

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
    def linear(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: F.linear(x, w)

    checks: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = [
        (linear(rand(o, i)), rand(rows, i)) for i, o in sorted(linears)]
    checks += [
        (norm, rand(rows, h) * 20),
        (lambda x: x * cos[:x.shape[0]] + rotate_half(x) * sin[:x.shape[0]], rand(rows, cfg.num_attention_heads, d)),
        (lambda x: F.silu(x) * x.flip(-1), rand(rows, cfg.intermediate_size) * 20),
    ]
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            if not all(_rows_invariant(op, x, threads) for op, x in checks):
                return False
            torch.set_num_threads(1)
            return _attention_invariant(cfg, dtype, threads, block)
    finally:
        torch.set_num_threads(before)


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=16)
def _probed(cfg: ModelConfig, dtype: torch.dtype, threads: int) -> bool:
    return probe(cfg, dtype)


def unpadded_invariant(cfg: ModelConfig, dtype: torch.dtype) -> bool:
    """Whether `dtype`'s kernels may run unpadded for this model here: bf16 on a CPU with native bf16 whose
    probe passed (cached per process, model shapes and thread count). fp32 and fp16 are always padded."""
    if dtype != torch.bfloat16 or BF16_FLAGS.isdisjoint(cpu_flags()):
        return False
    with _LOCK:
        return _probed(cfg, dtype, torch.get_num_threads())


def resolve(requested: str, cfg: ModelConfig) -> str:
    """`requested` (a --dtype value) as the dtype this process serves `cfg` in."""
    if requested != AUTO:
        if requested not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(CHOICES)}; got {requested!r}")
        return requested
    return choose_dtype(cpu_flags(), lambda: unpadded_invariant(cfg, torch.bfloat16))
