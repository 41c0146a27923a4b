"""Small helpers that several test files share: a clock the test moves by hand, whether a process lives, and a
model fed one request chunk by chunk."""

from __future__ import annotations

import os


class Clock:
    """A clock for code that takes `clock=`: it reads `t`, which only the test moves."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a zombie is dead for the tests' purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def run_chunks(slices, ids: list[int], chunks: list[int]):
    """Logits at every position of one request, fed through the model `slices` (a whole model or a pipeline
    split) chunk by chunk: what the invariance tests compare across splits and chunkings."""
    import torch

    from tether.model.llama import SlotRows

    kvs = [s.new_kv() for s in slices]
    out, pos = [], 0
    for c in chunks:
        x = torch.tensor(ids[pos:pos + c])
        for s, kv in zip(slices, kvs):
            kv.ensure(pos + c)
            x = s(x, [SlotRows(kv, pos, c)])
            kv.length = pos + c
        out.append(slices[-1].logits(x))
        pos += c
    return torch.cat(out)
