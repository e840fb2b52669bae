"""Sliding-window attention over a trimmed key list, and the window pool's bookkeeping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mem_cache.allocator import KVAllocator
from mem_cache.kv_pool import KVPool
from tests.worker.attention_kit import pass_over, random_pool
from worker.attention.registry import make_attention
from worker.window_kv import WindowKV


def windowed_reference(q, keys, values, window: int) -> torch.Tensor:
    """Each of the q_len queries (the last positions of `keys`) over its last `window` keys."""
    q_len, kv_len = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i in range(q_len):
        pos = kv_len - q_len + i
        lo = max(pos - window + 1, 0)
        scores = torch.einsum("hd,khd->hk", q[i], k[lo : pos + 1]) / q.shape[-1] ** 0.5
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo : pos + 1])
    return out


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_windowed_batch_attends_over_each_querys_window(backend):
    """A chunk past the window (band mask), a chunk inside it and a decode, in one pass; the
    batch lists only the keys from the first query's window on, as the engine builds it."""
    gen = torch.Generator().manual_seed(0)
    window, heads = 8, 4
    pool = random_pool(gen, 128, 2, 16, torch.float32)
    full = [torch.arange(0, 40), torch.arange(40, 46), torch.arange(60, 90)]
    q_lens = [12, 6, 1]
    firsts = [max(s.numel() - n - window + 1, 0) for s, n in zip(full, q_lens, strict=True)]
    seen = [s[f:] for s, f in zip(full, firsts, strict=True)]
    batch, q, k, v = pass_over(gen, seen, q_lens, heads, pool)
    batch.window = window
    if backend == "native" and batch.needs_band():  # the model sends such passes to `torch`
        backend = "torch"
    out = make_attention(backend).forward(q, k, v, 0, batch, pool)
    start = 0
    for s, n in zip(full, q_lens, strict=True):
        keys, values = pool.k_buffer[0][s], pool.v_buffer[0][s]
        want = windowed_reference(q[start : start + n], keys, values, window)
        torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n


def test_needs_band_only_where_a_query_skips_keys():
    gen = torch.Generator().manual_seed(1)
    pool = random_pool(gen, 64, 1, 8, torch.float32)
    inside, _, _, _ = pass_over(gen, [torch.arange(0, 8)], [8], 2, pool)
    inside.window = 8
    assert not inside.needs_band()  # the whole chunk fits in one window
    past, _, _, _ = pass_over(gen, [torch.arange(0, 12)], [5], 2, pool)
    past.window = 8
    assert past.needs_band()


def window_kv(full_size: int = 64, window_size: int = 32, page: int = 4) -> WindowKV:
    return WindowKV(KVPool(window_size, 1, 1, 4, pad_slot=True), full_size, page, window=8)


def test_attach_detach_conserve_window_slots():
    full = KVAllocator(64, 4)
    w = window_kv()
    slots = full.alloc(16)
    assert w.attach(slots) and w.attached() == 16
    assert not w.attach(full.alloc(20))  # 20 more do not fit in 32 - 16: nothing taken
    assert w.attached() == 16 and w.allocator.available_size() == 16
    assert w.detach(slots[:8]) == 8 and w.detach(slots[:8]) == 0  # a second detach is a no-op
    assert w.first_attached(slots) == 8 and w.intact(slots[8:]) and not w.intact(slots)
    w.check(torch.from_numpy(full.free_slot_ids()))
    with pytest.raises(AssertionError):
        w.attach(slots[8:12])  # already has window slots
    assert w.horizon(5) == 0 and w.horizon(20) == 13


def test_check_finds_a_window_slot_left_on_a_freed_full_slot():
    full = KVAllocator(64, 4)
    w = window_kv()
    slots = full.alloc(8)
    w.attach(slots)
    full.free(slots[:4])  # freed without detaching: its window slots leak
    with pytest.raises(AssertionError, match="free full slot"):
        w.check(torch.from_numpy(full.free_slot_ids()))


class WindowKVMachine(RuleBasedStateMachine):
    """Random attaches, detaches, frees by the window allocator (what the radix cache does when
    it tombstones) and moves (a refilled tombstone): the mapping both ways and the conservation
    check hold after every step, and a model of who holds what agrees."""

    def __init__(self) -> None:
        super().__init__()
        self.full = KVAllocator(64, 4)
        self.w = window_kv()
        self.owned: list[torch.Tensor] = []  # full pages someone holds
        self.beside: dict[int, int] = {}  # the model: full slot -> window slot

    @rule(pages=st.integers(1, 4))
    def attach(self, pages: int) -> None:
        slots = self.full.alloc(4 * pages)
        if slots is None:
            return
        if self.w.attach(slots):
            self.beside.update(zip(slots.tolist(), self.w.window_of[slots].tolist(), strict=True))
        self.owned.extend(slots.view(-1, 4))

    @rule(data=st.data())
    def detach(self, data) -> None:
        if self.owned:
            page = data.draw(st.sampled_from(self.owned))
            self.w.detach(page)
            for s in page.tolist():
                self.beside.pop(s, None)

    @rule(data=st.data())
    def tombstone(self, data) -> None:
        held = [p for p in self.owned if self.w.intact(p)]
        if held:
            page = data.draw(st.sampled_from(held))
            self.w.allocator.free(self.w.window_of[page])
            for s in page.tolist():
                del self.beside[s]

    @rule(data=st.data())
    def move(self, data) -> None:
        held = [p for p in self.owned if self.w.intact(p)]
        bare = [p for p in self.owned if not bool((self.w.window_of[p] >= 0).any())]
        if held and bare:
            old, new = data.draw(st.sampled_from(held)), data.draw(st.sampled_from(bare))
            self.w.move(old, new)
            for o, n in zip(old.tolist(), new.tolist(), strict=True):
                self.beside[n] = self.beside.pop(o)

    @rule(data=st.data())
    def free_full(self, data) -> None:
        if self.owned:
            page = data.draw(st.sampled_from(self.owned))
            self.owned = [p for p in self.owned if p is not page]
            self.w.detach(page)
            self.full.free(page)
            for s in page.tolist():
                self.beside.pop(s, None)

    @invariant()
    def consistent(self) -> None:
        self.w.check(torch.from_numpy(self.full.free_slot_ids()))
        mapped = {i: int(v) for i, v in enumerate(self.w.window_of[:64].tolist()) if v >= 0}
        assert mapped == self.beside


TestWindowKVMachine = WindowKVMachine.TestCase
TestWindowKVMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
