"""Activation tensors on the wire: dtype, shape and raw bytes (never a list of floats, never pickle)."""

from __future__ import annotations

import torch

from tether.v1 import stage_pb2

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


class BadTensor(ValueError):
    """A tensor on the wire that does not decode to what it claims, or holds NaN/Inf."""


def encode(t: torch.Tensor) -> stage_pb2.Tensor:
    t = t.contiguous()
    name = _NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"dtype {t.dtype} cannot go on the wire")
    # view as bytes without a copy through numpy (bfloat16 has no numpy dtype)
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return stage_pb2.Tensor(dtype=name, shape=list(t.shape), data=raw)


def decode(msg: stage_pb2.Tensor, *, rows: int, width: int, dtype: str) -> torch.Tensor:
    """Decode and validate: the dtype must be `dtype`, the shape [rows, width], the values finite."""
    if msg.dtype != dtype:
        raise BadTensor(f"dtype {msg.dtype!r}, expected {dtype!r}")
    if list(msg.shape) != [rows, width]:
        raise BadTensor(f"shape {list(msg.shape)}, expected [{rows}, {width}]")
    tdtype = WIRE_DTYPES[dtype]
    itemsize = torch.empty((), dtype=tdtype).element_size()
    if len(msg.data) != rows * width * itemsize:
        raise BadTensor(f"{len(msg.data)} bytes for shape [{rows}, {width}] of {dtype}")
    t = torch.frombuffer(bytearray(msg.data), dtype=tdtype).view(rows, width) if rows else torch.empty(0, width, dtype=tdtype)
    if not torch.isfinite(t).all():
        raise BadTensor("holds NaN or Inf")
    return t
