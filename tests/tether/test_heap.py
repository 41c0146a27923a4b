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
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's heap: Linux only")
    default, kept = faults("default"), faults("keep")
    assert default > 10 * 256, f"the default heap faulted only {default} pages in 10 steps: nothing to show"
    assert kept * 10 < default, f"{kept} page faults with the thresholds set against {default} without"
