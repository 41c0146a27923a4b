"""The names of the numerics a model is served in, and the fingerprint that names model and numerics together.

Torch-free: admission and the coordinator check and report these without loading torch; which dtype a
machine serves in (`--dtype auto`) and the torch dtypes behind the names are tether/model/numerics.py.
"""

from __future__ import annotations

AUTO = "auto"
NAMES = ("float32", "bfloat16", "float16")
CHOICES = (AUTO, *NAMES)


def served_fingerprint(model_fingerprint: str, dtype: str) -> str:
    """The fingerprint a receipt names and admission checks: the model's and the numerics it is computed in
    (the same weights in bfloat16 and float32 give different logits, so different answers)."""
    return f"{model_fingerprint}-{dtype}"


def model_part(served: str) -> str:
    """The model's own fingerprint in a `served_fingerprint` (what admission compares with its folder's)."""
    return served.rsplit("-", 1)[0]
