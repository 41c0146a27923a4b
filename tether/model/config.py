"""Model hyper-parameters, read from a Hugging Face config.json (Llama, Qwen2, Mistral families)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tether import settings


@dataclass(frozen=True)
class Family:
    """What tether needs to know of a supported architecture beyond config.json's numbers: the defaults its
    config may leave out."""

    model_type: str                  # config.json's "model_type", written back by to_hf_dict
    attention_bias: bool = False     # q/k/v projections have biases unless the config says otherwise (Qwen2)
    sliding_window: bool = False     # uses sliding-window attention unless the config says otherwise (Mistral)


# The architectures tether serves (config.json's "architectures"[0]): one row per family, nothing elsewhere
# tests an architecture's name.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "Qwen2ForCausalLM": Family("qwen2", attention_bias=True),
    "MistralForCausalLM": Family("mistral", sliding_window=True),
}
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"   # a config.json without "architectures"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False     # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = DEFAULT_ARCHITECTURE
    torch_dtype: str = "float32"

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        arch = (cfg.get("architectures") or [DEFAULT_ARCHITECTURE])[0]
        family = FAMILIES.get(arch)
        if family is None:
            raise ValueError(f"unsupported architecture {arch!r}; tether serves {', '.join(sorted(FAMILIES))}")
        # transformers >= 5 writes RoPE settings into "rope_parameters"; older checkpoints keep them top level.
        rope = cfg.get("rope_parameters") or {}
        for scaling in (cfg.get("rope_scaling"), rope):
            if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling/rope_parameters {scaling!r}: tether implements "
                                 f"plain RoPE only")
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        window = cfg.get("sliding_window")
        uses_window = cfg.get("use_sliding_window", family.sliding_window)
        if uses_window and window and window < cfg.get("max_position_embeddings", 2048):
            raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported: tether "
                             f"would attend to keys the model masks out")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family.attention_bias)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not a model folder: it has no config.json")
        return cls.from_hf_dict(json.loads(path.read_text()))

    def to_hf_dict(self) -> dict:
        d = asdict(self)
        eos = d.pop("eos_token_ids")
        arch = d.pop("architecture")
        d["eos_token_id"] = list(eos) if len(eos) != 1 else eos[0]
        d["architectures"] = [arch]
        d["model_type"] = FAMILIES[arch].model_type
        d["hidden_act"] = "silu"
        return d


def even_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layer ranges of `stages` contiguous slices as equal as possible (earlier stages take the remainder)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def layer_weights(cfg: ModelConfig) -> int:
    """Elements of one decoder layer's seven weight matrices (q, k, v, o; gate, up, down); norms left out."""
    attention = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return attention + 3 * cfg.hidden_size * cfg.intermediate_size


def head_cost(cfg: ModelConfig) -> float:
    """What the last stage's LM head costs, in decoder layers: the head's weight bytes over a layer's, times
    settings.HEAD_COST_PER_LAYER_BYTE (the head's one long product reads its bytes faster than a layer's seven
    short ones and its attention). smollm2: 8.0 layers of bytes, 4.0 of time (sampling, not counted, adds
    less at the batch sizes served)."""
    return settings.HEAD_COST_PER_LAYER_BYTE * cfg.vocab_size * cfg.hidden_size / layer_weights(cfg)


def balanced_split(num_layers: int, stages: int, head_layers: float = 0.0) -> list[tuple[int, int]]:
    """Layer ranges of `stages` contiguous slices whose slowest stage is as fast as it can be, the last one
    also carrying `head_layers` of work (`head_cost`): the last stage takes k layers, the others an even split
    of the rest, k chosen for the smallest slowest stage, then the smallest spread, then the smallest k. With
    no head cost it is `even_split`. Under load a pipeline runs at its slowest stage's pace."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    if stages == 1:
        return [(0, num_layers)]

    def rank(k: int) -> tuple[float, float, int]:   # the slowest stage, then the spread, then k
        costs = [float(e - s) for s, e in even_split(num_layers - k, stages - 1)] + [k + head_layers]
        return max(costs), max(costs) - min(costs), k

    k = min(range(1, num_layers - stages + 2), key=rank)
    return even_split(num_layers - k, stages - 1) + [(num_layers - k, num_layers)]


def parse_layers(spec: str, num_layers: int, head_layers: float = 0.0) -> tuple[int, int]:
    """'START:END' (END exclusive; either side may be empty) or 'I/N' (slice I of the balanced split into N,
    `balanced_split` with the head's cost)."""
    try:
        if "/" in spec:
            i, n = (int(x) for x in spec.split("/"))
            if not 0 <= i < n:
                raise ValueError
            return balanced_split(num_layers, n, head_layers)[i]
        a, b = spec.split(":")
        start, end = int(a or 0), int(b or num_layers)
    except ValueError:
        raise ValueError(f"--layers must be START:END or I/N, got {spec!r}") from None
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"--layers {spec}: the model has layers 0..{num_layers}")
    return start, end
