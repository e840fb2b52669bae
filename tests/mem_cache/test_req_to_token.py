"""`ReqToTokenPool`: the host's slot table and the device's copy, kept current by shipping the
log of writes with each pass (on CPU here, with `mirror=True`: the same log and the same
apply as on a GPU)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mem_cache.kv_pool import ReqToTokenPool

ROWS, WIDTH = 4, 24

writes = st.tuples(
    st.integers(0, ROWS - 1),
    st.integers(0, WIDTH - 1),
    st.lists(st.integers(0, 10_000), min_size=1, max_size=8),
)
# a pass: some writes, then whether the pass that ships them is launched or thrown away (the
# overlapping engine prepares a batch again when requests finished meanwhile)
passes = st.lists(st.tuples(st.lists(writes, max_size=5), st.booleans()), max_size=12)


def apply(table: torch.Tensor, shipped: torch.Tensor | None) -> None:
    """What `ModelRunner.run` does with a pass's writes, before the pass. On a CPU a scatter
    with repeated indices keeps the last; the test also checks there are none."""
    if shipped is not None:
        table[shipped[0], shipped[1]] = shipped[2]


@settings(max_examples=200, deadline=None)
@given(passes)
def test_the_copy_equals_the_host_table_after_every_launched_pass(steps):
    pool = ReqToTokenPool(ROWS, WIDTH, mirror=True)
    assert pool.device_table is not pool.req_to_token
    for step_writes, launched in steps:
        for row, start, values in step_writes:
            values = values[: WIDTH - start]
            pool.write(row, start, torch.tensor(values, dtype=torch.int64))
        count, shipped = pool.pending_writes()
        if not launched:
            continue  # thrown away: the next pass ships these writes again
        pool.drop_writes(count)
        if shipped is not None:  # each entry once: a GPU scatter keeps any of repeated ones
            entries = shipped[0] * WIDTH + shipped[1]
            assert entries.unique().numel() == entries.numel()
        apply(pool.device_table, shipped)
        assert torch.equal(pool.device_table, pool.req_to_token)
        assert pool.pending_writes() == (0, None)


def test_a_write_after_a_pass_was_prepared_waits_for_the_next_pass():
    pool = ReqToTokenPool(2, 8, mirror=True)
    pool.write(0, 0, torch.tensor([5, 6, 7]))
    count, shipped = pool.pending_writes()
    pool.write(0, 1, torch.tensor([9]))  # while the pass is in flight
    pool.drop_writes(count)
    apply(pool.device_table, shipped)
    assert pool.device_table[0, :3].tolist() == [5, 6, 7]  # the pass saw its snapshot
    count, shipped = pool.pending_writes()
    assert count == 1
    apply(pool.device_table, shipped)
    assert pool.device_table[0, :3].tolist() == [5, 9, 7]


def test_on_cpu_the_table_is_its_own_copy_and_nothing_is_logged():
    pool = ReqToTokenPool(2, 8)
    pool.write(1, 2, torch.tensor([3, 4]))
    assert pool.device_table is pool.req_to_token
    assert pool.pending_writes() == (0, None)
