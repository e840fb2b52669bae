"""Slot allocator: the free list of KV slot ids, handed out in whole pages.

A slot holds the K and V of one token in every layer (see `KVPool`). Slots are grouped into
pages of `page_size` contiguous slots; page `k` is slots `k*page_size .. (k+1)*page_size - 1`.
The allocator is the single owner of free slots: every slot is either here or owned by exactly
one of a radix-tree node, a running request, or a parked session.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

SlotIds = torch.Tensor | np.ndarray | Sequence[int]


def as_int64_array(values: SlotIds) -> np.ndarray:
    """`values` as a 1-D int64 numpy array (no copy when it already is one on the CPU)."""
    if isinstance(values, torch.Tensor):
        # Cheap attribute tests only: `values.device.type` builds a device object per call
        # (~0.3 us, a third of the `.numpy()` it guards).
        if values.dtype is not torch.int64 or values.requires_grad or not values.is_cpu:
            values = values.detach().to("cpu", torch.int64)
        values = values.numpy()
    if isinstance(values, np.ndarray):
        if values.dtype != np.int64:
            values = values.astype(np.int64)
        return values if values.ndim == 1 else values.reshape(-1)
    return np.fromiter(values, dtype=np.int64, count=len(values))


_offsets: dict[int, np.ndarray] = {}


def _page_offsets(page_size: int, n: int) -> np.ndarray:
    """`0, 1, .., page_size - 1` repeated to `n` slots (a read-only cached row, grown on need)."""
    row = _offsets.get(page_size)
    if row is None or len(row) < n:
        pages = max(n // page_size, 2 * (0 if row is None else len(row) // page_size), 256)
        row = np.tile(np.arange(page_size, dtype=np.int64), pages)
        row.flags.writeable = False
        _offsets[page_size] = row
    return row[:n]


def pages_to_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """The slot ids of `pages`, page by page (a new array)."""
    if page_size == 1:
        return pages.astype(np.int64, copy=True)
    if pages.dtype != np.int64:
        pages = pages.astype(np.int64)
    # The repeat method + a cached offset row: much cheaper than broadcasting over rows of
    # page_size, and than np.repeat (a Python wrapper around the method).
    slots = (pages * page_size).repeat(page_size)
    slots += _page_offsets(page_size, len(slots))
    return slots


def slots_to_pages(slots: np.ndarray, page_size: int) -> np.ndarray:
    """Page ids of `slots` (a new array unless `page_size` is 1); `ValueError` unless they are
    whole pages (aligned, contiguous, ascending)."""
    if page_size == 1:
        return slots
    if len(slots) % page_size:
        raise ValueError(f"{len(slots)} slots are not whole pages of {page_size}")
    if slots.dtype != np.int64:
        slots = slots.astype(np.int64)
    pages = slots[::page_size] // page_size
    if pages_to_slots(pages, page_size).tobytes() != slots.tobytes():
        raise ValueError("slots are not whole pages (contiguous, ascending, aligned)")
    return pages


class KVAllocator:
    """Free list of the slot ids `0..size-1`, in pages of `page_size` slots.

    `alloc(n)` takes whole pages (`n` a multiple of `page_size`) and returns their slot ids page
    by page, each page's slots contiguous and ascending; it returns `None`, taking nothing, when
    fewer than `n` slots are free. `free(slots)` gives whole pages back; a slot out of range,
    already free, or listed twice raises `ValueError` and nothing is freed.
    """

    def __init__(self, size: int, page_size: int = 1) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if size < 0 or size % page_size:
            raise ValueError(f"size {size} is not a non-negative multiple of page {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self._positions = np.arange(self.num_pages, dtype=np.int64)
        self._scratch = np.zeros(self.num_pages, dtype=np.int64)
        self.clear()

    def clear(self) -> None:
        """Make every slot free again (the owners must have forgotten theirs)."""
        # A stack of free page ids: pages are taken from and returned to its top. Low ids on top
        # first, so a fresh allocator hands out slots 0, 1, 2, ...
        self._free_pages = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_pages
        self._is_free = np.ones(self.num_pages, dtype=bool)

    def available_size(self) -> int:
        """Free slots, in tokens."""
        return self._num_free * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slot ids (int64, page by page), or `None` if fewer than `n` are free."""
        if n < 0 or n % self.page_size:
            raise ValueError(f"alloc({n}): not a non-negative multiple of page {self.page_size}")
        pages = self.alloc_pages(n // self.page_size)
        return None if pages is None else torch.from_numpy(pages_to_slots(pages, self.page_size))

    def free(self, slots: SlotIds) -> None:
        """Give whole pages back. Validates everything before changing anything."""
        slots = as_int64_array(slots)
        if len(slots) and (slots.min() < 0 or slots.max() >= self.size):
            raise ValueError(f"free(): slot out of range 0..{self.size - 1}")
        self.free_pages(slots_to_pages(slots, self.page_size))

    def alloc_pages(self, num: int) -> np.ndarray | None:
        """`num` free page ids, or `None` (taking nothing) if fewer are free."""
        if num > self._num_free:
            return None
        top = self._num_free
        pages = self._free_pages[top - num : top][::-1].copy()
        self._num_free = top - num
        self._is_free[pages] = False
        return pages

    def free_pages(self, pages: np.ndarray) -> None:
        """Give pages back; out of range, already free or listed twice: `ValueError`, no change."""
        if len(pages) == 0:
            return
        if pages.min() < 0 or pages.max() >= self.num_pages:
            raise ValueError(f"free(): page out of range 0..{self.num_pages - 1}")
        if self._is_free[pages].any():
            already = pages_to_slots(pages[self._is_free[pages]], self.page_size)[:8]
            raise ValueError(f"free(): slots already free: {already.tolist()}")
        # Duplicates without sorting: write each position into a scratch row indexed by page;
        # a page listed twice keeps only one of its positions.
        order = self._positions[: len(pages)]
        self._scratch[pages] = order
        if not np.array_equal(self._scratch[pages], order):
            raise ValueError("free(): a page is listed twice")
        self._is_free[pages] = True
        top = self._num_free
        self._free_pages[top : top + len(pages)] = pages[::-1]
        self._num_free = top + len(pages)

    def free_slot_ids(self) -> np.ndarray:
        """The free slot ids (a copy), for integrity checks."""
        return pages_to_slots(self._free_pages[: self._num_free], self.page_size)
