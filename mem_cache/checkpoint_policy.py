"""Where a model with recurrent layers saves its state, so that the component radix cache can
resume a later request there.

A recurrent layer's state after token `p` summarises all of `tokens[:p]`; the cache keeps at most
one saved state per tree node, at the node's END, and a match can resume only exactly at a saved
state. Node ends are page-aligned, so a state is worth saving only at a page-aligned position.
The policy names those positions; the engine saves a state there (one state slot each) and hands
them to `HybridRadixCache.insert(..., states={position: slot})`:

- chunk ends: a prefill chunk is cut to end on a page boundary (`chunk_end`), and the state after
  each page-aligned chunk end is saved (a later request sharing the prompt resumes there, and a
  request paused after the chunk goes on from it);
- every `interval` tokens (a multiple of the page size; 0: off): states inside one forward, for
  long prompts whose shared prefixes end anywhere (the engine needs the state mid-forward);
- a request's end and a session turn's end: the last page-aligned position at or before the
  sequence end (with page size 1, the end itself), so that the next turn of a conversation,
  whose prompt extends this sequence, resumes there.
"""

from __future__ import annotations


class CheckpointPolicy:
    """Positions at which the engine saves recurrent states; see the module docstring."""

    def __init__(self, page_size: int, interval: int = 0) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if interval < 0 or interval % page_size:
            raise ValueError(f"interval {interval} is not a non-negative multiple of {page_size}")
        self.page_size = page_size
        self.interval = interval

    def chunk_end(self, start: int, budget: int, prompt_len: int) -> int:
        """Where a prefill chunk that starts at `start` with at most `budget` tokens ends: the
        prompt's end if it fits, else the last page boundary within the budget (the budget's
        end when no page boundary fits in it, so that every chunk makes progress)."""
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        end = min(prompt_len, start + budget)
        if end == prompt_len:
            return end
        aligned = end // self.page_size * self.page_size
        return aligned if aligned > start else end

    def points(self, start: int, end: int, *, seq_end: bool = False) -> list[int]:
        """Positions in `(start, end]` at which to save a state after running `[start, end)`:
        `end` if page-aligned, the multiples of `interval`, and with `seq_end` (the request or
        the session's turn ends at `end`) the last page-aligned position `<= end`. Ascending."""
        if end <= start:
            return []
        page = self.page_size
        found: set[int] = set()
        if end % page == 0:
            found.add(end)
        if self.interval:
            first = (start // self.interval + 1) * self.interval
            found.update(range(first, end + 1, self.interval))
        if seq_end:
            last = end // page * page
            if last > start:
                found.add(last)
        return sorted(found)
