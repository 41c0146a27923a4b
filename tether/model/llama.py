"""A Llama-architecture decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) as a slice of layers.

A ModelSlice holds layers [layer_start, layer_end) plus, on the first stage, the embedding and, on the
last, the final norm and LM head. One forward call runs a micro-batch of slots: the linear layers see all
rows at once; each slot's queries attend to that slot's own keys only. Keys live in a paged arena and
attention runs as batched tiles (tether/model/tiles.py), so that a request's logits are bitwise independent
of its batch neighbours (tether/model/invariant.py). The plain kernels that bench/batch_invariance.py
measures this against are tether/model/plain.py, which serving never imports.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tether import settings
from tether.kv.paged import BlockArena, PagedKV
from tether.model.config import ModelConfig
from tether.model import dtypes, rowlayer, rowq8, rowquant
from tether.model.invariant import KERNELS, RowRule, invariant_threads, pad_rows, padded_rows
from tether.model.numerics import name_of, row_rule
from tether.model.rowattn import RowAttentionPlan
from tether.model.tiles import AttentionPlan, Scratch

log = logging.getLogger(__name__)


@dataclass
class SlotRows:
    """Which rows of a micro-batch belong to one request, and where they sit in its context."""

    kv: PagedKV
    start: int      # position of the slot's first row
    length: int     # number of rows


class Attend(Protocol):
    """A micro-batch's attention, built once per step and used by every layer: an AttentionPlan (the paged,
    batch-invariant tiles), or the plain kernels' per-request SDPA in the benchmark baseline."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """Store the rows' keys and values, attend each slot's queries to its own keys: [rows, heads * d]."""


class Linear(nn.Linear):
    """nn.Linear whose product runs on the kernel its slice's RowRule names (`kernel`: invariant.KERNELS), on
    the weight as that kernel prepares it (oneDNN's packed layout), made at first use and again whenever the
    weight changes (a load, a kernel switch)."""

    kernel = "mkl"
    floor = 1   # the fewest rows its product runs on (RowRule.linear_floors): fewer are padded with zeros
    # (kernel, the weight it was made from, that weight's version, the prepared weight). Holding the weight
    # itself, not its address, so that a weight replaced by another at a reused address is never mistaken
    # for it; an inference tensor keeps no version (and cannot change outside inference mode).
    _prepared: tuple[str, torch.Tensor, int, Any] | None = None

    # The GGUF file's own groups this weight was rebuilt from, where the loader found them: rowdot then reads
    # those (tether/model/rowquant.py), after checking that they rebuild the weight bit for bit.
    blocks: rowquant.Blocks | None = None
    # "q8": rowdot reads the groups with its inputs rounded to 8 bits (tether/model/rowq8.py; RowRule.inputs).
    inputs = "float32"

    def prepared_weight(self) -> Any:
        """The weight as the kernel reads it (a tensor, oneDNN's packed tensor, rowdot's PackedWeight)."""
        w = self.weight
        version = -1 if w.is_inference() else w._version
        p = self._prepared
        how = f"{self.kernel}:{self.inputs}"
        if p is None or p[0] != how or p[1] is not w or p[2] != version:
            made = None
            if self.kernel == "rowdot" and self.blocks is not None:
                # the blocks serve only where they rebuild this very weight bit for bit (q8 reads them too)
                made = rowquant.prepare(w.detach(), self.blocks)
                if made is not None and self.inputs == "q8":
                    made = rowq8.pack(self.blocks, self.out_features, self.in_features)
            p = self._prepared = (how, w, version, made or KERNELS[self.kernel].prepare(w.detach()))
        return p[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < self.floor:
            return KERNELS[self.kernel].linear(pad_rows(x, self.floor), self.prepared_weight(), self.bias)[:rows]
        return KERNELS[self.kernel].linear(x, self.prepared_weight(), self.bias)

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """silu(self(x)) as the kernel computes it (fused into oneDNN's matmul, or not)."""
        rows = x.shape[0]
        if rows < self.floor:
            return KERNELS[self.kernel].gate(pad_rows(x, self.floor), self.prepared_weight(), self.bias)[:rows]
        return KERNELS[self.kernel].gate(x, self.prepared_weight(), self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary:
    """RoPE tables computed in float32 the way Hugging Face Llama computes them, once per position and
    gathered by index, so a position's values never depend on which other positions share the batch."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.cos = self.sin = torch.empty(0, head_dim)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            size = max(need, 2 * self.cos.shape[0], 256)
            freqs = torch.arange(size).float()[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                plan: Attend) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return self.o_proj(plan.attend(q, k, v, layer))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_proj.gate(x) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer, plan):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class ModelSlice(nn.Module):
    """Layers [layer_start, layer_end) of the model; the embedding if layer_start == 0; the head if last.

    Parameter names follow Hugging Face (`embed_tokens`, `layers.i`, `norm`, `lm_head`) minus the `model.`
    prefix, with layer indices local to the slice.
    """

    def __init__(self, cfg: ModelConfig, layer_start: int, layer_end: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        if not 0 <= layer_start < layer_end <= cfg.num_hidden_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside the model's "
                             f"{cfg.num_hidden_layers} layers")
        self.cfg = cfg
        self.layer_start, self.layer_end = layer_start, layer_end
        self.has_embedding = layer_start == 0
        self.has_head = layer_end == cfg.num_hidden_layers
        self.dtype = dtype
        # The rows a micro-batch runs on, as the start-up probe found for this dtype here (tether/model/
        # invariant.py): padded to a multiple of the machine's unit per thread, or, where the kernels are
        # invariant unpadded (bf16 on the EPYC), its own rows but at least a floor (smollm2 bf16 there: 2).
        self.rows: RowRule = row_rule(cfg, dtype)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if self.has_embedding else None
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(layer_end - layer_start))
        if self.has_head:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.arena: BlockArena | None = None   # paged KV of every request on this slice (made on first use)
        self.scratch = Scratch()                # attention's buffers, reused step to step (one step at a time)
        self._stack: tuple[tuple[torch.Tensor | None, ...], rowlayer.Stack] | None = None   # RowRule.layers "rowlayer"
        self._stack_modules: list[tuple[Any, ...]] | None = None     # each layer's norms and projections
        self._stack_made_of: tuple[list[Any], list[Any]] | None = None   # _stack_inputs() when the stack was made
        self.to(dtype)
        self.requires_grad_(False)
        self.use_linear_kernel(self.rows.linear, self.rows)

    def use_linear_kernel(self, kernel: str, rule: RowRule | None = None) -> None:
        """Run every linear on `kernel` (the rule's; the plain baseline sets torch's own, "mkl"), each on at
        least the rows `rule` gives its shape (none: on its own rows)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.kernel = kernel
                m.floor = rule.linear_floor(m.in_features, m.out_features) if rule is not None else 1

    def use_inputs(self, inputs: str) -> None:
        """Multiply every linear's inputs as `inputs` says (dtypes.LINEAR_INPUTS): "q8" needs float32 on rowdot
        (the GGUF groups are read there) and changes the numerics, which the rule (and so the handshake and
        every receipt's fingerprint) names."""
        if inputs not in dtypes.LINEAR_INPUTS:
            raise ValueError(f"linear inputs must be one of {', '.join(dtypes.LINEAR_INPUTS)}; got {inputs!r}")
        if inputs != "float32" and (self.dtype != torch.float32 or self.rows.linear != "rowdot"):
            raise ValueError(f"{inputs} linear inputs need float32 on our rowdot kernel (C kernels built, "
                             f"--dtype float32 or auto); this machine serves {name_of(self.dtype)} on {self.rows}: "
                             f"leave --linear-inputs at float32")
        self.rows = dataclasses.replace(self.rows, inputs=inputs)
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.inputs = inputs
        if inputs != "float32" and not any(m.blocks is not None for m in linears):
            log.warning("%s linear inputs asked for, but this slice's folder keeps no GGUF groups: its linears keep "
                        "float32's arithmetic (the rule still names %s)", inputs, inputs)
        self._stack = None

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def new_kv(self, owner: str = "") -> PagedKV:
        """Empty KV state for one request in this slice's own unbounded arena (the reference, tests and
        benchmarks; a stage worker makes its requests' KV in the bounded arena it owns)."""
        if self.arena is None:
            self.arena = self.new_arena(None)
        return PagedKV(self.arena, owner)

    @property
    def kv_bytes_per_position(self) -> int:
        """KV memory one context position takes on this slice (keys and values of every layer)."""
        c = self.cfg
        return 2 * self.num_layers * c.num_key_value_heads * c.head_dim * torch.finfo(self.dtype).bits // 8

    def kv_positions_for(self, mib: float) -> int:
        """The KV pool (positions, whole blocks) that `mib` MiB hold on this slice."""
        block = settings.ATTENTION_BLOCK
        per_block = max(1, self.kv_bytes_per_position * block)
        return int(mib * 2**20) // per_block * block

    def new_arena(self, capacity_tokens: int | None, prefault: bool = False) -> BlockArena:
        """A paged KV arena for this slice holding up to `capacity_tokens` (whole blocks of it; None:
        unbounded), its memory resident now with `prefault`. A stage worker owns one; `new_kv` keeps a default
        one."""
        block = settings.ATTENTION_BLOCK
        return BlockArena(self.num_layers, self.cfg.num_key_value_heads, self.cfg.head_dim, self.dtype, block,
                          None if capacity_tokens is None else capacity_tokens // block, prefault)

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, slots: list[SlotRows], wide: int = 0) -> torch.Tensor:
        """Run the slice. `inputs` is token ids [rows] on the first stage, hidden states [rows, hidden] after.

        Each slot's KV must come from `new_kv` (or the stage's arena) and already have room (`kv.ensure`); on
        success the caller advances `kv.length`. Rows are padded by the slice's RowRule (tether/model/
        invariant.py) and the padding dropped. A small batch runs on fewer threads (`invariant_threads`, the
        same bits); `wide` > 0 (the only micro-batch in the pipeline) runs it on that many, whatever the rows.
        """
        rows = inputs.shape[0]
        with invariant_threads(rows, self.rows, wide):
            padded = padded_rows(rows, self.rows)
            return self.run_layers(inputs, slots, padded, self.attention_plan(slots, padded))

    def attention_plan(self, slots: list[SlotRows], padded: int) -> Attend:
        """The micro-batch's attention by the rule's kernel (tiles or rowattn), built once per step and shared
        by every layer."""
        heads, kv_heads = self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        if self.rows.attention == "rowattn":
            return RowAttentionPlan.build(slots, padded, heads, kv_heads, self.scratch)
        return AttentionPlan.build(slots, padded, heads, kv_heads, self.scratch, self.rows)

    def run_layers(self, inputs: torch.Tensor, slots: list[SlotRows], padded: int, plan: Attend) -> torch.Tensor:
        """The embedding (first stage) and the layers over `inputs` padded to `padded` rows, attention by
        `plan`; the real rows of the result."""
        rows = inputs.shape[0]
        x = self.embed_tokens(pad_rows(inputs, padded)) if self.embed_tokens is not None else \
            pad_rows(inputs.to(self.dtype), padded)
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in slots])
        cos, sin = self.rotary.cos_sin(pad_rows(positions, padded), self.dtype)
        if self.rows.layers == "rowlayer" and isinstance(plan, RowAttentionPlan):   # (not the plain baseline's)
            assert padded == rows, "rowlayer runs unpadded"
            # the kernel updates x in place: never the caller's tensor
            x = x.clone(memory_format=torch.contiguous_format) if self.embed_tokens is None else x.contiguous()
            arena = plan.arena
            return self.layer_stack().run(x, arena.k, arena.v, cos, sin, plan.write_rows, plan.positions,
                                          plan.first, plan.tables, plan.context, self.scratch)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, plan)
        return x[:rows]

    def _stack_inputs(self) -> tuple[list[Any], list[Any]]:
        """What the layer stack is made from, read cheaply every step (no module attribute lookups, no prepared
        weights): the norm weights, each projection's weight, bias, kernel and inputs (objects, compared by
        identity) and each projection weight's version (values)."""
        if self._stack_modules is None:
            self._stack_modules = []
            for layer in self.layers:
                assert isinstance(layer, DecoderLayer)
                a, m = layer.self_attn, layer.mlp
                self._stack_modules.append((layer.input_layernorm, layer.post_attention_layernorm,
                                            (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                             m.down_proj)))
        objects: list[Any] = []
        versions: list[Any] = []
        for ln1, ln2, projections in self._stack_modules:
            objects += (ln1._parameters["weight"], ln2._parameters["weight"])
            for p in projections:
                w = p._parameters["weight"]
                objects += (w, p._parameters.get("bias"), p.kernel, p.inputs)
                versions.append(-1 if w.is_inference() else w._version)
        return objects, versions

    def layer_stack(self) -> rowlayer.Stack:
        """The layers as kernels/rowlayer.c reads them, made again whenever a weight's prepared form may be new (a
        load, a weight changed in place, a kernel switch). Checked every step from `_stack_inputs` (0.07 ms for
        smollm2's 17 layers, where asking every projection for its prepared weight took 0.39 ms)."""
        objects, versions = self._stack_inputs()
        if self._stack is not None and self._stack_made_of is not None and \
                len(objects) == len(self._stack_made_of[0]) and versions == self._stack_made_of[1] and \
                all(a is b for a, b in zip(objects, self._stack_made_of[0])):
            return self._stack[1]
        self._stack_made_of = (objects, versions)
        layers = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            a, m = layer.self_attn, layer.mlp
            layers.append(rowlayer.Layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                tuple(p.prepared_weight() for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj,
                                                    m.up_proj, m.down_proj)),
                tuple(p.bias for p in (a.q_proj, a.k_proj, a.v_proj))))
        # the parameters themselves (not detached views, new objects every call) and the prepared weights
        key = tuple(t for layer in layers for t in (layer.ln1, layer.ln2, *(p.data for p in layer.projections),
                                                     *layer.biases))
        if self._stack is None or len(self._stack[0]) != len(key) or any(
                a is not b for a, b in zip(self._stack[0], key)):
            c = self.cfg
            shape = rowlayer.Shape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   c.intermediate_size, settings.ATTENTION_BLOCK, c.rms_norm_eps, c.head_dim ** -0.5)
            self._stack = (key, rowlayer.Stack(shape, layers))
        return self._stack[1]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, wide: int = 0) -> torch.Tensor:
        """Final norm and LM head over some rows (the last stage only); float32 logits (`wide`: as forward)."""
        rows = hidden.shape[0]
        with invariant_threads(rows, self.rows, wide):
            if self.rows.layers == "rowlayer":   # the layers' own norm
                return self.lm_head(rowlayer.norm(hidden, self.norm.weight, self.norm.eps)).float()
            return self.lm_head(self.norm(pad_rows(hidden, padded_rows(rows, self.rows))))[:rows].float()
