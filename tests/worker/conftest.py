"""Shared set-up of the worker tests."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # engine_kit, triton_kit: for the test modules
import engine_kit  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny-model steps run much faster on one thread than on several competing for the
    few cores of a CI runner; restored afterwards for other modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def step_modes(request, monkeypatch):
    """Engines from `engine_kit.make` step synchronously, then with the forward pass in its own
    thread overlapping the scheduling (`EngineConfig.overlap`): a module opts in with
    `pytestmark = pytest.mark.usefixtures("step_modes")`."""
    monkeypatch.setitem(engine_kit.MODE, "overlap", request.param)
    return request.param
