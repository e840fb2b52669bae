"""Every change of KV ownership on a worker, one method per kind, each asserting what it assumes.

A slot has exactly one owner at any time: the allocator's free list,
the radix tree, a running request's tail, or a parked session. Regions of a running request's
row (see `worker.request`):

    [0, prefix_len)            tree (locked through req.node)
    [prefix_len, alloc_len)    the request's tail: pages it allocated, or session pages it took
    [alloc_len, ...)           nothing

`check()` verifies conservation: free + tree + request tails + session-owned == size.
With `radix=None` (cache disabled) nothing is ever matched or inserted: every slot a request
used goes back to the free list when it ends.

A model with sliding-window layers has `window` (`worker.window_kv`): every slot allocated here
gets a window slot beside it, freed with it, or earlier by `slide` once its owner's queries have
moved past it (only the request's own: the tree's window KV goes when the tree tombstones it).
Its prefix cache is the component cache (`mem_cache.hybrid_cache.HybridRadixCache`, group 0 the
full layers, group 1 the window layers): a match resumes only where the window behind it is
intact, an insert hands the tree the window slots beside the full ones it takes, and a window
pool that runs short tombstones the tree's least recently used window KV. A model with recurrent
layers has `states` (`worker.state_slots`): each running request and parked session holds one
state slot, and its component cache (group 1 the recurrent states) keeps copies of states saved
at checkpoints: where a finished chunk or a request's end is page-aligned (`cache`), and at a
dropped session's end when that is aligned. A match resumes only at a saved state, which the
request copies into its own slot; a short state pool evicts the tree's least recently used.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from mem_cache.allocator import KVAllocator
from mem_cache.events import RECURRENT, SLIDING_WINDOW, KVGroup
from mem_cache.host_cache import HostKVPool, PoolCopier
from mem_cache.hybrid_cache import HybridMatch, HybridRadixCache
from mem_cache.hybrid_node import HybridNode
from mem_cache.kv_pool import KVPool, ReqToTokenPool
from mem_cache.radix_cache import RadixCache
from worker.request import Request, common_prefix_len
from worker.sessions import ParkedSession, SessionTable
from worker.state_slots import StateSlots
from worker.window_kv import WindowKV


class KVMemory:
    """The allocator, the radix cache, the request rows and the parked sessions of one engine."""

    def __init__(
        self,
        allocator: KVAllocator,
        radix: RadixCache | HybridRadixCache | None,
        rows: ReqToTokenPool,
        sessions: SessionTable,
        window: WindowKV | None = None,
        states: StateSlots | None = None,
    ) -> None:
        hybrid = isinstance(radix, HybridRadixCache)
        assert radix is None or hybrid == (window is not None or states is not None), (
            "a hybrid model needs the component cache, a full-attention one the plain tree"
        )
        self.window = window
        self.states = states
        self.allocator = allocator
        self.radix = radix
        self.rows = rows
        self.sessions = sessions
        self.page_size = allocator.page_size

    # --- requests ----------------------------------------------------------------------------

    def admit(self, req: Request) -> bool:
        """Give a waiting request a row and its cached prefix (session KV or a radix match).

        A full hit still leaves the last token to compute: the match covers at most
        `len(tokens) - 1`. Returns False (nothing taken) when no row is free.
        """
        assert req.row is None and req.node is None and req.alloc_len == 0, "admit twice"
        row = self.rows.alloc()
        if row is None:
            return False
        req.row = row
        parked = self.sessions.pop(req.session_id) if req.session_id else None
        if parked is not None and parked.namespace == req.namespace:
            self._restore(req, parked)
        else:
            if parked is not None:
                self.drop_session(parked)
            self._match(req)
        if self.states is not None and req.state_slot is None and not self._take_state(req):
            self.release(req)
            return False
        if req.cached_tokens is None:
            req.cached_tokens = req.num_computed
        return True

    def _take_state(self, req: Request) -> bool:
        """A zeroed state slot for a request that starts from its first token, evicting the
        tree's states and dropping parked sessions for it if need be; False when none."""
        assert req.num_computed == 0
        slot = self._new_state()
        while slot is None:
            if not self.drop_oldest_session():
                return False
            slot = self._new_state()
        req.state_slot = slot
        return True

    def _new_state(self) -> int | None:
        """A zeroed state slot, evicting one of the tree's if need be; None when none."""
        slot = self.states.alloc()
        if slot is None and self.radix is not None and self.radix.evict_states(1):
            slot = self.states.alloc()
        return slot

    def _match(self, req: Request) -> None:
        if self.radix is None:
            return
        if self.states is not None and not self._take_state(req):
            return  # no state slot: `admit` gives up
        m = self.radix.match_prefix(req.tokens[: len(req.tokens) - 1], req.namespace)
        if m.host_length:  # evicted to the host tier: copy it back rather than recompute
            m = self.radix.load_back(m)
        assert m.length % self.page_size == 0 and m.length < len(req.tokens)
        full = _full_slots(m)
        self.rows.write(req.row, 0, full)
        self.radix.lock(m.node)
        req.node = m.node
        req.prefix_len = req.alloc_len = req.num_computed = req.window_start = m.length
        if self.window is not None:
            assert self.window.intact(full[self.window.horizon(m.length) :]), "window gone"
        if self.states is not None and m.length:
            assert m.state is not None, "a recurrent match must end at a saved state"
            self.states.conv[req.state_slot] = self.states.conv[m.state]

    def alloc(self, req: Request, upto: int) -> bool:
        """Grow the request's tail so that tokens[:upto] have slots (whole pages), evicting
        unlocked cache leaves if needed. Returns False, taking nothing, when there is no room."""
        assert req.row is not None and upto <= self.rows.max_context
        need = -(-upto // self.page_size) * self.page_size - req.alloc_len
        if need <= 0:
            return True
        slots = self.allocator.alloc(need)
        if slots is None:
            self.evict(need - self.allocator.available_size())
            slots = self.allocator.alloc(need)
        if slots is None or not self._attach(slots):
            return False
        self.rows.write(req.row, req.alloc_len, slots)
        req.alloc_len += need
        return True

    def alloc_decodes(self, reqs: list[Request]) -> bool:
        """A slot for each request's next token (a decode step: at most one new page each), all
        from one allocator call. False, taking nothing, when the free list is short: the caller
        then goes request by request (`alloc`), evicting or retracting."""
        p = self.page_size
        needing = [r for r in reqs if r.num_computed + 1 > r.alloc_len]
        if not needing:
            return True
        slots = self.allocator.alloc(p * len(needing))
        if slots is None or not self._attach(slots):
            return False
        pages = slots.view(len(needing), p)
        for req, page in zip(needing, pages, strict=True):
            assert req.row is not None and req.alloc_len + p <= self.rows.max_context
            self.rows.write(req.row, req.alloc_len, page)
            req.alloc_len += p
        return True

    def _attach(self, slots: torch.Tensor) -> bool:
        """Window slots for freshly allocated `slots`, tombstoning the tree's least recently
        used window KV if need be; False (and `slots` freed) when short."""
        if self.window is None or self.window.attach(slots):
            return True
        if self.radix is not None:
            short = slots.numel() - self.window.allocator.available_size()
            self.radix.evict_window(1, short)
            if self.window.attach(slots):
                return True
        self.allocator.free(slots)
        return False

    def slide(self, req: Request) -> None:
        """Free the window KV of the request's own pages that none of its queries can see any
        more (positions below the window behind its next token).

        KV regions freed here: window slots of [window_start, horizon) of the request's tail,
        whole pages; their full slots stay the request's."""
        if self.window is None or req.row is None:
            return
        p = self.page_size
        upto = min(self.window.horizon(req.num_computed) // p * p, req.alloc_len)
        start = max(req.window_start, req.prefix_len)
        if upto > start:
            self.window.detach(self.rows.req_to_token[req.row, start:upto])
            req.window_start = upto

    def cache(self, req: Request) -> None:
        """Hand the page-aligned computed prefix of a running request to the tree, so that other
        requests can share it (finished chunks, a finished prompt). Duplicates are freed and the
        row then points at the tree's copy; the lock moves down to the new end."""
        if self.radix is None or req.row is None:
            return
        row = self.rows.req_to_token[req.row]
        aligned = req.num_computed // self.page_size * self.page_size
        if aligned <= req.prefix_len:
            return
        saved = None
        if self.states is not None and aligned == req.num_computed:  # a checkpoint
            saved = self._new_state()
            if saved is not None:
                self.states.conv[saved] = self.states.conv[req.state_slot]
        node = self._insert(req.tokens[:aligned], row[:aligned], req.prefix_len, req.namespace,
                            saved)  # fmt: skip
        if node is None:  # the plain tree: find the inserted path again
            m = self.radix.match_prefix(req.tokens[:aligned], req.namespace)
            assert m.length == aligned, "inserted tokens not found again"
            full, node = m.indices, m.node
        else:  # (a component cache's match may stop short, where a state is saved)
            full = self.radix.slots(node)
        self.rows.write(req.row, 0, full)
        self.radix.lock(node)
        self.radix.unlock(req.node)
        req.node = node
        req.prefix_len = aligned

    def release(self, req: Request) -> None:
        """A request ends (finish, abort) or is retracted: its computed prefix goes to the tree
        (when caching), its tail [prefix_len, alloc_len) to the free list, its lock and row go.

        KV regions freed here: tail pages past the cached prefix, including the partial last
        page and slots allocated for tokens never computed."""
        if req.row is None:
            return
        self.cache(req)
        row = self.rows.req_to_token[req.row]
        self._free(row[req.prefix_len : req.alloc_len])
        if self.radix is not None:
            self.radix.unlock(req.node)
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None
        self.rows.free(req.row)
        req.row, req.node = None, None
        req.prefix_len = req.alloc_len = req.num_computed = req.window_start = 0

    # --- sessions ----------------------------------------------------------------------------

    def park(self, req: Request, ttl_s: float) -> None:
        """A session turn ends: its KV moves from the request to the session (the lock on the
        tree prefix and the tail pages that hold computed tokens), so the next turn can
        continue from it."""
        assert req.session_id is not None and req.row is not None
        old = self.sessions.pop(req.session_id)
        if old is not None:
            self.drop_session(old)
        row = self.rows.req_to_token[req.row]
        kept = -(-req.num_computed // self.page_size) * self.page_size
        # KV regions freed here: whole pages [kept, alloc_len) allocated for tokens never
        # computed, if any
        self._free(row[kept : req.alloc_len])
        self.sessions.put(
            ParkedSession(
                session_id=req.session_id,
                namespace=req.namespace,
                tokens=req.tokens[: req.num_computed],
                slots=row[:kept].clone(),
                prefix_len=req.prefix_len,
                node=req.node,
                ttl_s=ttl_s,
                expires_at=time.monotonic() + ttl_s,
                state_slot=req.state_slot,
            )
        )
        req.state_slot = None
        self.rows.free(req.row)
        req.row, req.node = None, None
        req.prefix_len = req.alloc_len = req.num_computed = req.window_start = 0

    def _restore(self, req: Request, parked: ParkedSession) -> None:
        """The next turn takes over the parked KV it shares with its prompt (page-aligned, at
        most len(tokens) - 1); the orphaned session pages past that point are freed. When the
        shared part ends inside the tree prefix, the session is dropped and the radix match
        takes over."""
        common = common_prefix_len(parked.tokens, req.tokens[: len(req.tokens) - 1])
        reuse = common // self.page_size * self.page_size
        window_gone = self.window is not None and not self.window.intact(
            parked.slots[self.window.horizon(reuse) : reuse]
        )
        # a recurrent state stands after all of the session's tokens: resume there or nowhere
        state_gone = parked.state_slot is not None and reuse != len(parked.tokens)
        if (reuse < parked.prefix_len or (self.radix is None and reuse == 0) or window_gone
                or state_gone):  # fmt: skip
            self.drop_session(parked)
            self._match(req)
            return
        self.rows.write(req.row, 0, parked.slots[:reuse])
        # KV regions freed here: session-owned pages [reuse, alloc_len) the new prompt no
        # longer shares (the orphaned tail); [prefix_len, reuse) becomes the request's tail.
        self._free(parked.slots[reuse:])
        req.node = parked.node
        req.prefix_len = parked.prefix_len
        req.alloc_len = req.num_computed = reuse
        req.state_slot = parked.state_slot
        if self.window is not None:
            own = parked.slots[parked.prefix_len : reuse]
            req.window_start = parked.prefix_len + self.window.first_attached(own)

    def drop_session(self, parked: ParkedSession) -> None:
        """Release a session's KV (close, TTL, pressure, a turn that diverged): its computed
        pages go to the tree when caching, the rest to the free list, and its lock goes.

        KV regions freed here: session-owned [prefix_len, alloc_len) minus what the tree
        takes; the tree prefix [0, prefix_len) only loses its lock."""
        assert parked.session_id not in self.sessions, "drop a session still in the table"
        prefix_len = parked.prefix_len
        if self.radix is not None:
            aligned = len(parked.tokens) // self.page_size * self.page_size
            state = parked.state_slot
            if aligned > prefix_len:
                # the session's state goes to the tree where it stands at the aligned end
                saved = state if aligned == len(parked.tokens) else None
                self._insert(parked.tokens[:aligned], parked.slots[:aligned], prefix_len,
                             parked.namespace, saved)  # fmt: skip
                state = None if saved is not None else state
                prefix_len = aligned
            self.radix.unlock(parked.node)
            parked = dataclasses.replace(parked, state_slot=state)
        self._free(parked.slots[prefix_len:])
        if parked.state_slot is not None:
            self.states.free(parked.state_slot)

    def drop_oldest_session(self) -> bool:
        sid = self.sessions.oldest()
        if sid is None:
            return False
        self.drop_session(self.sessions.pop(sid))
        return True

    # --- tree and free list ------------------------------------------------------------------

    def _insert(
        self,
        tokens: list[int],
        slots: torch.Tensor,
        owned_from: int,
        namespace: str | None,
        state: int | None = None,
    ) -> HybridNode | None:
        """Insert tokens[:n] (n page-aligned) whose slots [owned_from, n) the caller owns; the
        tree keeps the new ones and the caller's duplicates of already-cached tokens are freed.
        `state` (recurrent models): a state slot of the caller's holding the state after all of
        `tokens`, for the tree to keep (freed if it holds one there already). Returns the
        component cache's node that ends at n (None from the plain tree)."""
        n = len(tokens)
        assert n % self.page_size == 0 and slots.numel() >= n
        if isinstance(self.radix, HybridRadixCache):
            return self._insert_hybrid(tokens, slots[:n], owned_from, namespace, state)
        already = self.radix.insert(tokens, slots[:n], namespace)
        assert already >= owned_from, "the caller's tree prefix vanished while it was locked"
        # KV regions freed here: the caller's own copies [owned_from, already) of tokens that
        # someone else cached meanwhile; the tree now owns [already, n).
        self._free(slots[owned_from:already])
        return None

    def _insert_hybrid(
        self,
        tokens: list[int],
        slots: torch.Tensor,
        owned_from: int,
        namespace: str | None,
        state: int | None,
    ) -> HybridNode:
        """`_insert` into the component cache: the window slots beside `slots` go with them,
        from the first position after the last one without (the caller let those go).

        KV regions freed here: the caller's full copies of tokens the tree already held, and
        the window slots the tree did not take; a window slot the tree took for a tombstone it
        refilled now sits beside the tree's own full copy (`WindowKV.move`); a state the tree
        did not take."""
        windows = None
        if self.window is not None:
            window = self.window.window_of[slots]
            gone = torch.nonzero(window < 0)
            start = int(gone[-1, 0]) + 1 if gone.numel() else 0
            windows = {1: (start, window[start:])}
        states = {len(tokens): state} if state is not None else None
        res = self.radix.insert(tokens, slots, windows=windows, states=states,
                                namespace=namespace)  # fmt: skip
        assert res.prefix_len >= owned_from, "the caller's prefix vanished while locked"
        for ids in res.unused_windows.values():
            if len(ids):
                self.window.allocator.free(ids)  # detaches them from their full slots
        for slot in res.unused_states:
            self.states.free(slot)
        unused = torch.from_numpy(res.unused_full)
        if unused.numel():
            if self.window is not None:
                dup = torch.isin(slots, unused)
                self.window.move(slots[dup], self.radix.slots(res.node)[dup])
            self._free(unused)
        return res.node

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` from unlocked cache leaves (LRU) if possible."""
        if self.radix is None or num_tokens <= 0:
            return 0
        return self.radix.evict(num_tokens)

    def _free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        assert slots.numel() % self.page_size == 0, "free of a partial page"
        if self.window is not None:
            self.window.detach(slots)
        self.allocator.free(slots.to("cpu") if slots.device.type != "cpu" else slots)

    # --- accounting --------------------------------------------------------------------------

    def check(self, running: list[Request]) -> None:
        """Slot conservation and per-request region invariants; raises AssertionError."""
        p = self.page_size
        tails = 0
        for req in running:
            assert req.row is not None, f"{req.request_id}: running without a row"
            assert req.prefix_len % p == 0 and req.alloc_len % p == 0, "unaligned region"
            assert req.prefix_len <= req.num_computed <= req.alloc_len, "regions out of order"
            tails += req.tail_len
            if self.window is not None:
                self._check_window(req)
        for parked in self.sessions.values():
            assert parked.prefix_len % p == 0 and parked.alloc_len % p == 0
            assert parked.prefix_len <= parked.alloc_len
        tree = self.radix.total_size() if self.radix else 0
        if self.radix is not None:
            self.radix.check_integrity()
        owned = self.sessions.owned_tokens()
        free = self.allocator.available_size()
        assert free + tree + tails + owned == self.allocator.size, (
            f"slot conservation: free {free} + tree {tree} + request tails {tails} + "
            f"sessions {owned} != {self.allocator.size}"
        )
        if self.window is not None:
            self.window.check(torch.from_numpy(self.allocator.free_slot_ids()))
        if self.states is not None:
            held = [r.state_slot for r in running] + [s.state_slot for s in self.sessions.values()]
            assert None not in held, "a running request or session without its state"
            self.states.check(held, self.radix.total_size(1) if self.radix is not None else 0)

    def _check_window(self, req: Request) -> None:
        """A running request's window KV: all of it from the horizon of its computed tokens
        to its allocated end; of its own pages (from `prefix_len`; the tree's go when the tree
        tombstones them) none below `window_start`, and no more than the window plus what it
        allocated ahead and one page."""
        w, row = self.window, self.rows.req_to_token[req.row]
        own = max(req.prefix_len, req.window_start)
        gone = w.window_of[row[req.prefix_len : own]]
        assert bool((gone < 0).all()), f"{req.request_id}: window KV below window_start"
        assert w.intact(row[w.horizon(req.num_computed) : req.alloc_len]), (
            f"{req.request_id}: window KV missing inside its window"
        )
        held = req.alloc_len - own
        ahead = req.alloc_len - req.num_computed
        assert held <= w.window + ahead + self.page_size, (
            f"{req.request_id}: {held} window slots, window {w.window} + {ahead} ahead"
        )


def _full_slots(m) -> torch.Tensor:
    """The full-attention slots of a match of either cache."""
    return m.full if isinstance(m, HybridMatch) else m.indices


def make_hybrid_cache(
    allocator: KVAllocator, window: WindowKV | None, states: StateSlots | None, block_size: int
) -> HybridRadixCache:
    """The component cache of a hybrid model: group 0 its full-attention layers over
    `allocator`, group 1 its window layers over `window`'s allocator, or its recurrent states
    over `states`' (no host tier yet)."""
    if window is not None:
        second, alloc = KVGroup(1, SLIDING_WINDOW, window.window), window.allocator
    else:
        second, alloc = KVGroup(1, RECURRENT), states.allocator
    return HybridRadixCache([KVGroup(0), second], [allocator, alloc], allocator.page_size,
                            block_size)  # fmt: skip


def make_radix_cache(
    allocator: KVAllocator,
    kv_pool: KVPool,
    block_size: int,
    host_kv_tokens: int = 0,
    host_policy: str = "write_through",
) -> RadixCache:
    """The radix cache over `allocator`, with a host tier of `host_kv_tokens` slots when that
    is > 0 (ValueError for an unknown `host_policy`). A host hit shorter than one block is
    recomputed rather than loaded back."""
    page = allocator.page_size
    host_tokens = host_kv_tokens // page * page
    if host_tokens <= 0:
        return RadixCache(allocator, page, block_size)
    host_pool = HostKVPool(
        host_tokens, kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype
    )
    return RadixCache(
        allocator,
        page,
        block_size,
        host_allocator=KVAllocator(host_tokens, page),
        write_policy=host_policy,
        copier=PoolCopier(kv_pool, host_pool),
        load_back_min=block_size,
    )
