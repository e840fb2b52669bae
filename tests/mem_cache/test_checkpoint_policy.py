"""The recurrent-state checkpoint policy: where the engine saves states."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mem_cache.checkpoint_policy import CheckpointPolicy


@given(page=st.sampled_from([1, 2, 16]), intervals=st.integers(0, 4), start=st.integers(0, 100),
       length=st.integers(0, 100), seq_end=st.booleans())
def test_points_are_the_documented_positions(page, intervals, start, length, seq_end):
    policy = CheckpointPolicy(page, intervals * page * 2)
    end = start + length
    points = policy.points(start, end, seq_end=seq_end)
    assert points == sorted(set(points))
    assert all(start < p <= end for p in points)
    assert all(p % page == 0 for p in points), "a state is saved only where a node can end"
    if end > start and end % page == 0:
        assert end in points, "a page-aligned chunk end is a checkpoint"
    if seq_end and end // page * page > start:
        assert end // page * page in points, "the last page end of a request is a checkpoint"
    if policy.interval:
        for p in range(start + 1, end + 1):
            if p % policy.interval == 0:
                assert p in points
    extra = [p for p in points if p != end and not (policy.interval and p % policy.interval == 0)]
    assert extra in ([], [end // page * page]) and (not extra or seq_end)


@given(page=st.sampled_from([1, 4, 16]), start=st.integers(0, 200), budget=st.integers(1, 64),
       more=st.integers(0, 300))
def test_chunks_end_on_page_boundaries_and_always_progress(page, start, budget, more):
    policy = CheckpointPolicy(page)
    prompt_len = start + 1 + more
    end = policy.chunk_end(start, budget, prompt_len)
    assert start < end <= min(prompt_len, start + budget)
    if end != prompt_len and end % page:
        assert start + budget - start < page or end // page * page <= start  # no boundary fits
    if prompt_len <= start + budget:
        assert end == prompt_len


def test_a_prompt_in_chunks_leaves_a_checkpoint_at_every_chunk_end():
    policy = CheckpointPolicy(16)
    pos, ends = 0, []
    while pos < 100:
        end = policy.chunk_end(pos, 40, 100)
        ends += policy.points(pos, end, seq_end=end == 100)
        pos = end
    assert ends == [32, 64, 96]  # 100 is not a page end: the request's last page end is 96


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        CheckpointPolicy(0)
    with pytest.raises(ValueError):
        CheckpointPolicy(16, interval=24)
    with pytest.raises(ValueError):
        CheckpointPolicy(16).chunk_end(0, 0, 10)
