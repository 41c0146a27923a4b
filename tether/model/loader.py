"""Load a model slice from a Hugging Face folder (config.json + *.safetensors) and fingerprint the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from tether.model.config import ModelConfig
from tether.model.llama import ModelSlice
from tether.model import record, smollm2
from tether.model.numerics import DTYPES, resolve
from tether.model.presets import PRESETS, ensure_preset
from tether.model.tokenizer import Tokenizer, load_tokenizer



def resolve_model(model: str) -> Path:
    """'smollm2' (the real default model), a random preset ('tiny', 'small', 'base': tests and kernel
    benchmarks) or a path to a Hugging Face folder -> the folder."""
    if model == smollm2.NAME:
        return smollm2.ensure()
    if model in PRESETS:
        return ensure_preset(model)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {model!r} is neither {smollm2.NAME}, a preset ({', '.join(PRESETS)}) "
                                f"nor a folder with config.json")
    return path


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def model_fingerprint(folder: str | Path) -> str:
    """xxh3-64 over the canonical config and every weight file's bytes: equal only for the same model."""
    folder = Path(folder)
    h = xxhash.xxh3_64()
    h.update(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True).encode())
    for f in _weight_files(folder):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def checked_fingerprint(folder: str | Path) -> str:
    """model_fingerprint(folder), after checking the folder against the record tether wrote when it made it
    (tether/model/record.py): what a service calls when it loads its model. Raises record.ModelFolderChanged
    (a ValueError) for a folder changed since."""
    folder = Path(folder)
    fingerprint = model_fingerprint(folder)
    record.check(folder, fingerprint)
    return fingerprint


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
               dtype: str = "float32") -> ModelSlice:
    """Load layers [layer_start, layer_end) (all by default) reading only the tensors the slice needs, in
    `dtype` ("auto": as tether/model/numerics.py chooses for this machine; the slice's `dtype` says which).
    The services and the reference default to settings.DTYPE; this library call says float32 unless told."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    end = cfg.num_hidden_layers if layer_end is None else layer_end
    dtype = resolve(dtype, cfg)
    model = ModelSlice(cfg, layer_start, end, DTYPES[dtype])
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                key = _slice_key(name, layer_start, end, cfg)
                if key is not None:
                    state[key] = st.get_tensor(name)
    if model.has_head and cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    if not model.has_embedding:
        state.pop("embed_tokens.weight", None)
    expected = set(model.state_dict())
    missing = expected - set(state)
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensors of layers "
                         f"[{layer_start}, {end}), e.g. {sorted(missing)[:3]}")
    model.load_state_dict({k: v.to(DTYPES[dtype]) for k, v in state.items()}, strict=True)
    return model


def load_model_tokenizer(folder: str | Path) -> Tokenizer:
    cfg = ModelConfig.from_folder(folder)
    return load_tokenizer(folder, cfg.eos_token_ids, cfg.bos_token_id)
