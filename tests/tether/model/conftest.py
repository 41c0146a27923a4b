"""Fixtures the model tests share."""

import pytest
import torch


@pytest.fixture(params=[1, 2])
def threads(request):
    """Run the test at 1 and at 2 torch threads (the invariant kernels must give the same bits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
