"""A model's folder, without torch: which folder a model name means, its fingerprint, its tokenizer.

Admission and the coordinator need these and never the weights as tensors, so this module imports no torch
(an admission or coordinator process starts in a fraction of the time and memory a stage does); the stage's
slice is loaded by tether/model/loader.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

from tether.model import record, smollm2
from tether.model.config import ModelConfig
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


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def model_fingerprint(folder: str | Path) -> str:
    """xxh3-64 over the canonical config and every weight file's bytes: equal only for the same model."""
    folder = Path(folder)
    h = xxhash.xxh3_64()
    h.update(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True).encode())
    for f in weight_files(folder):
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


def load_model_tokenizer(folder: str | Path) -> Tokenizer:
    cfg = ModelConfig.from_folder(folder)
    return load_tokenizer(folder, cfg.eos_token_ids, cfg.bos_token_id)
