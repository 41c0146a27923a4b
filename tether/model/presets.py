"""Generated models: weights drawn from a fixed seed, saved as a Hugging Face folder, loaded like any checkpoint.

Their weights are random: they exercise the whole system with no download, and their answers are noise.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any
from pathlib import Path

from tether import settings
from tether.model.chat_template import CHATML_TEMPLATE
from tether.model.config import ModelConfig
from tether.model.tokenizer import BYTE_VOCAB_SIZE, BOS_ID, EOS_ID, write_byte_tokenizer

if TYPE_CHECKING:   # torch only where a preset's weights are generated: admission and the coordinator
    import torch     # resolve a preset's folder without loading torch

# Bump when the generator changes, so old folders are not mistaken for new ones.
# 3: tokenizer_config.json carries a ChatML chat_template (conversations).
# 4: the tokenizer has ChatML's <|im_start|>/<|im_end|> as control tokens (ids 259, 260).
GENERATOR_VERSION = 4

_COMMON: dict[str, Any] = dict(vocab_size=BYTE_VOCAB_SIZE, rms_norm_eps=1e-5, rope_theta=10000.0,
               max_position_embeddings=4096, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=32, **_COMMON),
    "small": ModelConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, **_COMMON),
    "base": ModelConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=64, **_COMMON),
}
PRESET_SEED = 20261129


def tether_home() -> Path:
    return Path(os.environ.get(settings.TETHER_HOME_ENV) or Path.home() / ".cache" / "tether")


def preset_path(name: str) -> Path:
    return tether_home() / "models" / f"{name}-v{GENERATOR_VERSION}"


def generate_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in Hugging Face Llama naming, deterministic for (cfg, seed)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    std = 0.02

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": normal(cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(cfg.num_attention_heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = normal(cfg.num_key_value_heads * hd, h)
        w[p + "self_attn.v_proj.weight"] = normal(cfg.num_key_value_heads * hd, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, cfg.num_attention_heads * hd)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
        w[p + "input_layernorm.weight"] = 1.0 + normal(h)
        w[p + "post_attention_layernorm.weight"] = 1.0 + normal(h)
    w["model.norm.weight"] = 1.0 + normal(h)
    w["lm_head.weight"] = normal(cfg.vocab_size, h)
    return w


def ensure_preset(name: str) -> Path:
    """Return the folder of a preset model, generating it on first use (atomically, race-safe)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    dest = preset_path(name)
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        cfg = PRESETS[name]
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2, sort_keys=True))
        from safetensors.torch import save_file
        save_file(generate_weights(cfg, PRESET_SEED), str(tmp / "model.safetensors"))
        write_byte_tokenizer(tmp)
        # A chat template, so presets take conversations like a real instruct model (tether/model/chat_template.py).
        tcfg_path = tmp / "tokenizer_config.json"
        tcfg_path.write_text(json.dumps({**json.loads(tcfg_path.read_text()), "chat_template": CHATML_TEMPLATE}))
        from tether.model import record
        from tether.model.folder import model_fingerprint   # (folder imports this module)
        record.write(tmp, model_fingerprint(tmp))   # what every service checks the folder against when it loads
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():  # lost a race to a complete folder: fine; else real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
