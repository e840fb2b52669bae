"""KVAllocator: whole pages out, whole pages back, and nothing changes on a bad free."""

import numpy as np
import pytest
import torch

from mem_cache.allocator import KVAllocator

PAGE_SIZES = [1, 4, 16, 64]


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_alloc_hands_out_whole_contiguous_pages(page: int) -> None:
    alloc = KVAllocator(8 * page, page)
    slots = alloc.alloc(3 * page)
    assert slots is not None and slots.dtype == torch.int64 and len(slots) == 3 * page
    for i in range(3):
        chunk = slots[i * page : (i + 1) * page]
        assert int(chunk[0]) % page == 0
        assert torch.equal(chunk, torch.arange(int(chunk[0]), int(chunk[0]) + page))
    assert alloc.available_size() == 5 * page
    assert alloc.size == 8 * page and alloc.page_size == page


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_alloc_not_a_page_multiple_is_refused(page: int) -> None:
    alloc = KVAllocator(4 * page, page)
    with pytest.raises(ValueError):
        alloc.alloc(-page)
    if page > 1:
        with pytest.raises(ValueError):
            alloc.alloc(page + 1)
    assert alloc.available_size() == 4 * page


def test_alloc_too_much_returns_none_and_takes_nothing() -> None:
    alloc = KVAllocator(64, 16)
    assert alloc.alloc(48) is not None
    assert alloc.alloc(32) is None
    assert alloc.available_size() == 16
    assert alloc.alloc(0) is not None and alloc.available_size() == 16


def test_size_must_be_whole_pages() -> None:
    with pytest.raises(ValueError):
        KVAllocator(10, 4)


def test_double_free_raises_and_frees_nothing() -> None:
    alloc = KVAllocator(32, 4)
    a = alloc.alloc(8)
    b = alloc.alloc(8)
    alloc.free(a)
    before = alloc.available_size()
    with pytest.raises(ValueError, match="already free"):
        alloc.free(torch.cat([b, a]))  # b is valid, a is not: b must stay allocated
    assert alloc.available_size() == before
    alloc.free(b)
    assert alloc.available_size() == 32


def test_page_listed_twice_raises_and_frees_nothing() -> None:
    alloc = KVAllocator(32, 4)
    a = alloc.alloc(8)
    with pytest.raises(ValueError, match="twice"):
        alloc.free(torch.cat([a, a[:4]]))
    assert alloc.available_size() == 24


@pytest.mark.parametrize("bad", [[-1], [32], [1, 2, 3, 4], [0, 1, 2]])
def test_free_out_of_range_or_partial_page_raises(bad: list[int]) -> None:
    alloc = KVAllocator(32, 4)
    alloc.alloc(32)
    with pytest.raises(ValueError):
        alloc.free(bad)
    assert alloc.available_size() == 0


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_random_alloc_free_conserves_slots(page: int) -> None:
    rng = np.random.default_rng(page)
    alloc = KVAllocator(32 * page, page)
    held: list[torch.Tensor] = []
    for _ in range(300):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(int(rng.integers(len(held)))))
        else:
            got = alloc.alloc(int(rng.integers(0, 6)) * page)
            if got is not None:
                held.append(got)
        owned = torch.cat(held) if held else torch.zeros(0, dtype=torch.int64)
        assert alloc.available_size() + len(owned) == alloc.size
        assert len(torch.unique(owned)) == len(owned)
        assert not np.isin(owned.numpy(), alloc.free_slot_ids()).any()
