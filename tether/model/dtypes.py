"""The names of the numerics a model is served in, and the fingerprint that names model and numerics together.

Torch-free: admission and the coordinator check and report these without loading torch; which dtype a
machine serves in (`--dtype auto`) and the torch dtypes behind the names are tether/model/numerics.py.
"""

from __future__ import annotations

import xxhash

AUTO = "auto"
NAMES = ("float32", "bfloat16", "float16")
CHOICES = (AUTO, *NAMES)
# What a float32 linear multiplies (--linear-inputs): its inputs as they are, or rounded to 8 bits per group of 32
# against the GGUF file's Q4_1 / Q8_0 groups, as llama.cpp computes them (tether/model/rowq8.py). A numerics of its own:
# the rule names it, so receipts and the handshake tell it apart.
LINEAR_INPUTS = ("float32", "q8")


def served_fingerprint(model_fingerprint: str, dtype: str, kernels: str = "") -> str:
    """The fingerprint a receipt names and admission checks: the model's and the numerics it is computed in
    (the same weights in bfloat16 and float32 give different logits, so different answers), and, where given,
    8 hex digits of the kernels' digest (`RowRule.kernels`: the probe chooses them per machine, and two choices
    give a row other bits): `<model>-<dtype>-<kernels>`."""
    served = f"{model_fingerprint}-{dtype}"
    return f"{served}-{xxhash.xxh3_64_hexdigest(kernels.encode())[:8]}" if kernels else served


def model_part(served: str) -> str:
    """The model's own fingerprint in a `served_fingerprint` (what admission compares with its folder's; a
    model fingerprint is hex digits, no dash)."""
    return served.split("-", 1)[0]
