"""The record a model folder tether made carries of itself, and its check when a service loads the folder.

When tether makes a folder (the converted default model, tether/model/smollm2.py; a generated preset,
tether/model/presets.py) it writes RECORD_NAME beside the files: the model fingerprint (config and weights,
loader.model_fingerprint) and the SHA-256 of every other file (tokenizer, chat template, generation config).
Every service checks the folder against it at start-up (loader.checked_fingerprint), so a folder whose
weights, tokenizer or template changed after it was made, or that gained or lost a file, is refused with an
error that says so, instead of being served. A folder of the user's own (a Hugging Face download) has no record
and is loaded as it is. The record sits in the folder it describes: it catches damage and edits that do not
know about it, not an attacker who can rewrite the folder and the record together (SECURITY.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RECORD_NAME = "tether-model.json"
RECORD_VERSION = 1


class ModelFolderChanged(ValueError):
    """The folder no longer matches the record written when tether made it."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _other_files(folder: Path) -> dict[str, str]:
    """Every file of the folder that the fingerprint does not cover -> its SHA-256."""
    return {p.name: _sha256(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name != RECORD_NAME and p.suffix != ".safetensors"}


def write(folder: Path, fingerprint: str) -> None:
    """Record `folder` as it is now (call it on the finished folder, before it is moved into place)."""
    record = {"version": RECORD_VERSION, "fingerprint": fingerprint, "files": _other_files(folder)}
    (folder / RECORD_NAME).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def has_record(folder: Path) -> bool:
    return (folder / RECORD_NAME).is_file()


def check(folder: Path, fingerprint: str) -> None:
    """Raise ModelFolderChanged unless `folder` (whose model fingerprint is `fingerprint`, just computed) is what
    its record says; a folder without a record passes (not made by tether)."""
    path = folder / RECORD_NAME
    if not path.is_file():
        return
    hint = "it was modified or damaged after tether made it; delete the folder and make it again " \
           "(`python -m tether.model` for the default model; a preset is regenerated on next use)"
    try:
        record = json.loads(path.read_text())
        recorded, files = record["fingerprint"], dict(record["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise ModelFolderChanged(f"model folder {folder}: its record {RECORD_NAME} is unreadable ({e}): {hint}") \
            from None
    if fingerprint != recorded:
        raise ModelFolderChanged(f"model folder {folder}: its config or weights (fingerprint {fingerprint}) are not "
                                 f"the ones recorded when it was made ({recorded}): {hint}")
    now = _other_files(folder)
    changed = sorted(name for name in set(now) | set(files) if now.get(name) != files.get(name))
    if changed:
        what = ", ".join(f"{n} ({'added' if n not in files else 'missing' if n not in now else 'changed'})"
                         for n in changed)
        raise ModelFolderChanged(f"model folder {folder}: {what} since it was made: {hint}")
