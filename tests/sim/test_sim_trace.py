"""Trace loading (plain and gzipped) and the replay's time scaling and bucket spreading."""

import gzip
import json

import pytest

from cluster.sim.trace import load_trace, read_trace, replay
from cluster.sim.workloads import (
    ChatConfig,
    SharedPrefixConfig,
    generated_shared_prefix,
    multi_turn_chat,
)

ROWS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
    {"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [3]},
]


def _write(path, rows, gz):
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)


@pytest.mark.parametrize("gz", [False, True])
def test_read_trace_plain_and_gzipped(tmp_path, gz):
    path = tmp_path / ("t.jsonl.gz" if gz else "t.jsonl")
    _write(path, ROWS, gz)
    assert read_trace(path) == ROWS
    reqs = load_trace(path)
    assert [r.blocks for r in reqs] == [[0, 1], [0, 2], [3]]
    assert [r.input_length for r in reqs] == [1000, 600, 512]


def test_bad_row_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"timestamp": 1}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_trace(path)


def test_bucket_is_spread_and_speed_divides_time():
    reqs = replay(ROWS, speed=1.0)
    first_bucket = [r.arrival_s for r in reqs[:2]]
    assert 0 <= first_bucket[0] < first_bucket[1] < 3.0  # spread over the gap, in trace order
    assert reqs[2].arrival_s >= 3.0
    fast = replay(ROWS, speed=2.0)
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s / 2 for r in reqs])
    flat = replay(ROWS, spread=False)
    assert [r.arrival_s for r in flat] == [0.0, 0.0, 3.0]


def test_replay_rejects_nonpositive_speed():
    with pytest.raises(ValueError):
        replay(ROWS, speed=0)


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    w = generated_shared_prefix(SharedPrefixConfig(groups=4, prompts_per_group=3), seed=1)
    assert len(w.requests) == 12
    by_group = {}
    for r in w.requests:
        by_group.setdefault(r.extra["group"], []).append(r.blocks)
    sys_blocks = 2048 // 128
    for blocks in by_group.values():
        assert all(b[:sys_blocks] == blocks[0][:sys_blocks] for b in blocks)
        assert len({b[sys_blocks] for b in blocks}) == len(blocks)  # distinct questions
    firsts = {blocks[0][0] for blocks in by_group.values()}
    assert len(firsts) == 4


def test_chat_turn_extends_the_previous_turns_full_blocks():
    w = multi_turn_chat(ChatConfig(sessions=3, turns=4, block_tokens=128), seed=2)
    by_session = {}
    for r in w.requests:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.arrival_s)
        for prev, nxt in zip(turns, turns[1:], strict=False):
            full = prev.input_length // 128
            assert nxt.blocks[:full] == prev.blocks[:full]
            assert nxt.input_length > prev.input_length
