"""Shared set-up of the worker tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny-model steps run much faster on one thread than on several competing for the
    few cores of a CI runner; restored afterwards for other modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
