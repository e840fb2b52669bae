"""Shared set-up of the worker tests."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # engine_kit, triton_kit: for the test modules


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny-model steps run much faster on one thread than on several competing for the
    few cores of a CI runner; restored afterwards for other modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

