"""tether/heap.py: with the thresholds set, a sampling step's freed float64 temporaries are reused by the next
step instead of faulted in again (a fresh process each way: the thresholds are process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import resource, sys
import torch
from tether import heap
from tether.generation import sampler
from tether.v1 import common_pb2
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory()
else:   # every block of 64 KiB or more mmap'd and unmapped when freed: glibc's default before it adapts
    import ctypes
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)
torch.manual_seed(0)
logits = torch.randn(8, 49152) * 3   # a micro-batch of smollm2's logits, every row sampled
params = [common_pb2.SamplingParams(temperature=0.8, top_k=40 * (i % 2), seed=i) for i in range(8)]
for _ in range(3):   # a few first: glibc adapts its own thresholds to what it saw freed, the heap grows
    sampler.sample_rows(logits, params, list(range(8)))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    sampler.sample_rows(logits, params, list(range(8)))
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_freed_blocks_are_reused_without_page_faults():
    """Against a heap that returns every large block to the kernel (what glibc does until its own threshold
    adapts, and again whenever the freed top of the heap passes its trim threshold), the thresholds keep a
    step's blocks: the next steps fault almost nothing in."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's heap: Linux only")
    returned, kept = faults("return"), faults("keep")
    assert returned > 10 * 256, f"the returning heap faulted only {returned} pages in 10 steps: nothing to show"
    assert kept * 10 < returned, f"{kept} page faults with the thresholds set against {returned} without"
