"""Load a model slice from a Hugging Face folder (config.json + *.safetensors); the folder itself (which one a name
means, its fingerprint, its tokenizer) is tether/model/folder.py, re-exported here for the stage and tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from tether.model.config import ModelConfig
from tether.model.folder import (checked_fingerprint, load_model_tokenizer, model_fingerprint, resolve_model,
                                 weight_files)
from tether.model import rowquant
from tether.model.llama import Linear, ModelSlice
from tether.model.numerics import DTYPES, resolve

__all__ = ["checked_fingerprint", "load_model_tokenizer", "load_slice", "model_fingerprint", "resolve_model"]


def _slice_key(name: str, start: int, end: int, cfg: ModelConfig) -> str | None:
    """Map a checkpoint tensor name to the slice's parameter name, or None when it is not in the slice."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers."):
        idx, rest = name[len("layers."):].split(".", 1)
        i = int(idx)
        if "rotary_emb" in rest:
            return None
        return f"layers.{i - start}.{rest}" if start <= i < end else None
    if name.startswith("embed_tokens."):
        wanted = start == 0 or (end == cfg.num_hidden_layers and cfg.tie_word_embeddings)
        return name if wanted else None
    if name.startswith("norm.") or name.startswith("lm_head."):
        return name if end == cfg.num_hidden_layers else None
    return None


def load_slice(folder: str | Path, layer_start: int = 0, layer_end: int | None = None,
               dtype: str = "float32", inputs: str = "float32") -> ModelSlice:
    """Load layers [layer_start, layer_end) (all by default) reading only the tensors the slice needs, in
    `dtype` ("auto": as tether/model/numerics.py chooses for this machine; the slice's `dtype` says which).
    The services and the reference default to settings.DTYPE; this library call says float32 unless told.
    In float32, a linear whose GGUF groups the folder keeps (tether/model/rowquant.py) gets them, for rowdot to
    read; with `inputs` "q8" they are read with 8-bit inputs (ModelSlice.use_inputs, tether/model/rowq8.py)."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    end = cfg.num_hidden_layers if layer_end is None else layer_end
    dtype = resolve(dtype, cfg)
    model = ModelSlice(cfg, layer_start, end, DTYPES[dtype])
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, rowquant.Blocks] = {}   # the GGUF groups of the slice's weights, where the folder has them
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                quant = rowquant.split_name(name)
                key = _slice_key(quant[0] if quant else name, layer_start, end, cfg)
                if key is None or (quant and dtype != "float32"):   # only fp32's kernel reads the groups
                    continue
                if quant:
                    blocks[key] = rowquant.Blocks(quant[1], st.get_tensor(name))
                else:
                    state[key] = st.get_tensor(name)
    if model.has_head and cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
        if "embed_tokens.weight" in blocks:
            blocks["lm_head.weight"] = blocks["embed_tokens.weight"]
    if not model.has_embedding:
        state.pop("embed_tokens.weight", None)
    expected = set(model.state_dict())
    missing = expected - set(state)
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensors of layers "
                         f"[{layer_start}, {end}), e.g. {sorted(missing)[:3]}")
    model.load_state_dict({k: v.to(DTYPES[dtype]) for k, v in state.items()}, strict=True)
    for name, module in model.named_modules():
        if isinstance(module, Linear) and f"{name}.weight" in blocks:
            module.blocks = blocks[f"{name}.weight"]
    if inputs != "float32":
        model.use_inputs(inputs)
    return model
