"""The fast SSE chunk path renders exactly what the general one does."""

from __future__ import annotations

import json

import pytest

from router.api.render import Renderer
from router.dispatch import ChoiceDelta
from router.job import Job
from worker.protocol import SamplingParams

DELTAS = [
    ChoiceDelta(0, 'he said "hi"\n\t é 世界 🎉 \\', [1], [], None),
    ChoiceDelta(2, "", [], [], "stop"),
    ChoiceDelta(1, "x", [5], [], "length"),
]


@pytest.mark.parametrize("chat", [False, True])
def test_plain_chunks_equal_general_chunks(chat):
    renderer = Renderer(Job("rid", "tiny", [[1, 2]], SamplingParams()), None, chat, None)
    assert renderer._plain
    for delta in DELTAS:
        fast = renderer.chunk(delta)
        renderer._plain = False
        general = renderer.chunk(delta)
        renderer._plain = True
        assert fast.startswith(b"data: ") and fast.endswith(b"\n\n")
        assert json.loads(fast[6:]) == json.loads(general[6:])
