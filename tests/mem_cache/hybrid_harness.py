"""A harness around `HybridRadixCache` that plays the engine: requests that match, lock, allocate
the KV of every group, save recurrent states where the checkpoint policy says, insert (all at
once or chunk by chunk), abort; and the checks the tests make after every step:

- `check_integrity()`;
- slot conservation per allocator: free + tree + requests == size (states: free + tree + requests);
- KV content: every slot records the token prefix whose KV it holds (a state slot, the prefix it
  summarises); a match must return slots whose content is exactly the query's prefixes, and
  host copies move the content (a dict-backed copier per group);
- the match rule against a brute-force reference over per-token presence;
- events: the replayed stream of each (group, medium) equals the blocks the tree holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from mem_cache.allocator import KVAllocator
from mem_cache.checkpoint_policy import CheckpointPolicy
from mem_cache.events import (
    DEVICE,
    HOST,
    RECURRENT,
    SLIDING_WINDOW,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVGroup,
)
from mem_cache.host_cache import KVCopier
from mem_cache.hybrid_cache import HybridMatch, HybridRadixCache
from mem_cache.hybrid_node import NO_STATE, HybridNode
from mem_cache.radix_node import descendants, path_below


class DictCopier(KVCopier):
    """Moves the recorded content of one group's slots between its device and host maps."""

    def __init__(self, device: dict, host: dict) -> None:
        self.device, self.host = device, host

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> object:
        for d, h in zip(device_slots.tolist(), host_slots.tolist(), strict=True):
            self.host[h] = self.device[d]

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> object:
        for h, d in zip(host_slots.tolist(), device_slots.tolist(), strict=True):
            self.device[d] = self.host[h]

    def done(self, ticket: object) -> bool:
        return True

    def wait(self, ticket: object) -> None:
        return None


@dataclass(eq=False)
class Request:
    tokens: list[int]
    node: HybridNode
    done: int  # tokens whose KV the tree holds for it (its locked node's end)
    full: dict[int, int] = field(default_factory=dict)  # position -> own full slot
    windows: list[dict[int, int]] = field(default_factory=list)  # per window group
    states: dict[int, int] = field(default_factory=dict)  # position -> own checkpoint slot
    working: int = NO_STATE  # the request's running state slot
    computed: int = 0  # tokens whose KV the request has (in the tree or its own)


class Harness:
    def __init__(
        self,
        windows: tuple[int, ...] = (4,),
        recurrent: bool = False,
        page: int = 2,
        block: int = 2,
        device: int = 24,
        host: int | None = None,
        states: int = 8,
        policy: str = "write_through",
        interval: int = 0,
    ) -> None:
        groups = [KVGroup(0)]
        groups += [KVGroup(1 + i, SLIDING_WINDOW, w) for i, w in enumerate(windows)]
        if recurrent:
            groups.append(KVGroup(len(groups), RECURRENT))
        self.groups = groups
        self.page, self.block = page, block
        self.allocs = [KVAllocator(states if g.kind == RECURRENT else device,
                                   1 if g.kind == RECURRENT else page) for g in groups]
        self.content: list[dict[int, tuple]] = [{} for _ in groups]
        self.host_content: list[dict[int, tuple]] = [{} for _ in groups]
        host_allocs = None
        copiers = None
        if host is not None:
            host_allocs = [KVAllocator(states * 2 if g.kind == RECURRENT else host,
                                       1 if g.kind == RECURRENT else page) for g in groups]
            copiers = {g.index: DictCopier(self.content[c], self.host_content[c])
                       for c, g in enumerate(groups)}
        self.cache = HybridRadixCache(groups, self.allocs, page, block, host_allocs, policy,
                                      copiers)
        self.policy = CheckpointPolicy(page, interval)
        self.windows = windows
        self.keep = [max(w, page) + page for w in windows]  # window KV a request keeps
        self.recurrent = len(groups) - 1 if recurrent else None
        self.requests: list[Request] = []
        self.stored: dict[tuple[int, str], set[int]] = {}
        self.stats: Counter = Counter()  # what the matches met

    # --- allocation ---------------------------------------------------------------------------

    def _alloc(self, c: int, n: int) -> list[int] | None:
        if n == 0:
            return []
        alloc = self.allocs[c]
        ids = alloc.alloc(n)
        if ids is None:
            short = n - alloc.available_size()
            if c == 0:
                self.cache.evict(short)
            elif c == self.recurrent:
                self.cache.evict_states(short)
            else:
                self.cache.evict_window(self.groups[c].index, short)
            ids = alloc.alloc(n)
        return None if ids is None else ids.tolist()

    def _free(self, c: int, ids: list[int]) -> None:
        if ids:
            for s in ids:
                self.content[c].pop(s, None)
            self.allocs[c].free(ids)

    # --- requests -----------------------------------------------------------------------------

    def start(self, tokens: list[int], load: bool = False, upto: int | None = None
              ) -> Request | None:
        """Match, (load back), lock, and compute the prompt up to `upto` (all of it by
        default): allocate its KV of every group and its checkpoint states. None (everything
        given back) when memory is short."""
        m = self.cache.match_prefix(tokens)
        self.check_match(tokens, m)
        if load and m.host_length:
            m = self.cache.load_back(m)
            self.check_match(tokens, m)
            self.stats["loaded back"] += not m.host_length
        self.cache.lock(m.node)
        req = Request(tokens, m.node, m.length, windows=[{} for _ in self.windows],
                      computed=m.length)
        if not self.advance(req, len(tokens) if upto is None else max(upto, m.length)):
            self.abort(req)
            return None
        return req

    def advance(self, req: Request, end: int) -> bool:
        """Compute the request's next tokens up to `end` (a prefill chunk)."""
        ok = self._compute(req, req.computed, end)
        req.computed = end
        return ok

    def _compute(self, req: Request, start: int, end: int) -> bool:
        tokens = req.tokens
        full = self._alloc(0, end - start)
        if full is None:
            return False
        for k, s in enumerate(full):
            req.full[start + k] = s
            self.content[0][s] = tuple(tokens[: start + k + 1])
        for i in range(len(self.windows)):
            ids = self._alloc(1 + i, end - start)
            if ids is None:
                return False
            for k, s in enumerate(ids):
                req.windows[i][start + k] = s
                self.content[1 + i][s] = tuple(tokens[: start + k + 1])
            # the engine keeps only the window (+ a page) of window KV per request
            cut = (end - self.keep[i]) // self.page * self.page
            old = [p for p in req.windows[i] if p < cut]
            self._free(1 + i, [req.windows[i].pop(p) for p in old])
        if self.recurrent is not None:
            if req.working == NO_STATE:
                got = self._alloc(self.recurrent, 1)
                if got is None:
                    return False
                req.working = got[0]
            for pos in self.policy.points(start, end, seq_end=end == len(tokens)):
                got = self._alloc(self.recurrent, 1)
                if got is None:
                    continue  # no room for this checkpoint: the tree just gets fewer
                req.states[pos] = got[0]
                self.content[self.recurrent][got[0]] = tuple(tokens[:pos])
        return True

    def insert(self, req: Request, upto: int) -> None:
        """Insert `tokens[:upto]` (page-aligned) with the request's KV; the tree's ids replace
        the request's for what the tree now holds, duplicates are freed."""
        cache, tokens = self.cache, req.tokens
        full_tree = cache.slots(req.node).tolist()
        full_ids = full_tree + [req.full[p] for p in range(len(full_tree), upto)]
        windows = {}
        for i in range(len(self.windows)):
            own = sorted(p for p in req.windows[i] if p < upto)
            start = own[0] if own else upto
            t_start, t_ids = cache.slots(req.node, self.groups[1 + i].index)
            ids = [req.windows[i][p] for p in own]
            if t_start < start and start <= req.node.end:  # the tree's window before ours
                ids = t_ids.tolist()[: start - t_start] + ids
                start = t_start
            windows[self.groups[1 + i].index] = (start, ids)
        states = {p: s for p, s in req.states.items() if p <= upto}
        res = cache.insert(tokens[:upto], full_ids, windows, states)
        assert res.node.end == upto
        # what the tree took is no longer the request's; what it did not take is freed
        unused_full = set(res.unused_full.tolist())
        own = [req.full.pop(p) for p in sorted(req.full) if p < upto]
        self._free(0, [s for s in own if s in unused_full])
        for i in range(len(self.windows)):
            unused = set(res.unused_windows[self.groups[1 + i].index].tolist())
            own = [req.windows[i].pop(p) for p in sorted(req.windows[i]) if p < upto]
            self._free(1 + i, [s for s in own if s in unused])
        own = [req.states.pop(p) for p in list(states)]
        if self.recurrent is not None:
            self._free(self.recurrent, [s for s in own if s in res.unused_states])
        cache.lock(res.node)
        cache.unlock(req.node)
        req.node, req.done = res.node, upto

    def finish(self, req: Request) -> None:
        self.insert(req, len(req.tokens) // self.page * self.page)
        self.abort(req)

    def abort(self, req: Request) -> None:
        """Give back everything the request still owns and its lock (an abort mid-prefill, or the
        end of a finished request)."""
        self._free(0, [req.full[p] for p in sorted(req.full)])
        for i in range(len(self.windows)):
            self._free(1 + i, [req.windows[i][p] for p in sorted(req.windows[i])])
        if self.recurrent is not None:
            own = list(req.states.values()) + ([req.working] if req.working != NO_STATE else [])
            self._free(self.recurrent, own)
        req.full.clear()
        req.states.clear()
        req.working = NO_STATE
        for w in req.windows:
            w.clear()
        self.cache.unlock(req.node)

    # --- checks -------------------------------------------------------------------------------

    def held_by_requests(self, c: int) -> int:
        n = 0
        for r in self.requests:
            if c == 0:
                n += len(r.full)
            elif c == self.recurrent:
                n += len(r.states) + (r.working != NO_STATE)
            else:
                n += len(r.windows[c - 1])
        return n

    def check(self) -> None:
        cache = self.cache
        cache.check_integrity()
        for c, g in enumerate(self.groups):
            alloc = self.allocs[c]
            held = cache.total_size(g.index) + self.held_by_requests(c)
            assert alloc.available_size() + held == alloc.size, f"group {g.index}: slots leaked"
        self.check_events()

    def check_events(self) -> None:
        for ev in self.cache.take_events():
            if isinstance(ev, AllCleared):
                self.stored.clear()
                continue
            key = (ev.group.index, ev.medium)  # type: ignore[union-attr]
            held = self.stored.setdefault(key, set())
            if isinstance(ev, BlockStored):
                assert not held & set(ev.hashes), "events: a block stored twice"
                held.update(ev.hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.hashes) <= held, "events: a block removed that was not stored"
                held.difference_update(ev.hashes)
        cache = self.cache
        nodes = descendants(cache.root)
        for c, g in enumerate(self.groups):
            for medium, holds in ((DEVICE, cache.holds), (HOST, cache.host.holds)):
                want = {h for n in nodes if holds(n, c) for h in cache.blocks(n, c)}
                assert self.stored.get((g.index, medium), set()) == want, (
                    f"events: group {g.index} on {medium} mirror the tree wrongly"
                )

    def reference_resume(self, tokens: list[int]) -> tuple[int, int]:
        """Brute force over per-token presence along the tree's path of `tokens`: the longest
        device resume point, and the longest one counting host copies."""
        cache = self.cache
        n = len(tokens) // self.page * self.page
        node, pos = cache.root, 0
        full, host_full = [], []
        wins = [[] for _ in self.windows]
        host_wins = [[] for _ in self.windows]
        state_at, host_state_at = {0}, {0}
        while pos < n:
            child = _child(cache, node, tokens, pos)
            if child is None:
                break
            k = 0
            toks = child.tokens().tolist()
            while k < len(toks) and pos + k < n and toks[k] == tokens[pos + k]:
                k += 1
            k = k // self.page * self.page
            if k == 0:
                break
            dev = not child.evicted
            full += [dev] * k
            host_full += [True] * k
            for i in range(len(self.windows)):
                wins[i] += [dev and child.windows[i] is not None] * k
                hw = child.windows[i] is not None if dev else child.host_windows[i] is not None
                host_wins[i] += [hw] * k
            if k == len(child):
                if dev and child.state != NO_STATE:
                    state_at.add(child.end)
                if (child.state if dev else child.host_state) != NO_STATE:
                    host_state_at.add(child.end)
            if k < len(child):
                break
            pos += k
            node = child

        def best(full, wins, states):
            top = 0
            for p in range(0, len(full) + 1, self.page):
                if not all(full[:p]):
                    break
                ok = all(all(w[max(0, p - self.windows[i]) : p]) for i, w in enumerate(wins))
                if ok and (self.recurrent is None or p in states):
                    top = p
            return top

        return best(full, wins, state_at), best(host_full, host_wins, host_state_at)

    def check_match(self, tokens: list[int], m: HybridMatch) -> None:
        self.stats["hit"] += m.length > 0
        self.stats["cut back"] += m.full_length > m.length
        self.stats["host hit"] += m.host_length > 0
        want, want_host = self.reference_resume(tokens)
        assert m.length == want, f"match rule: resume point {m.length}, reference {want}"
        assert m.node.end == m.length
        assert m.length + m.host_length == max(want, want_host), "match rule: host resume point"
        assert [self.content[0][s] for s in m.full.tolist()] == [
            tuple(tokens[: p + 1]) for p in range(m.length)
        ], "content: full slots hold other tokens' KV"
        for i, w in enumerate(self.windows):
            start, ids = m.windows[self.groups[1 + i].index]
            assert start == max(0, m.length - w) // self.page * self.page
            assert [self.content[1 + i][s] for s in ids.tolist()] == [
                tuple(tokens[: p + 1]) for p in range(start, m.length)
            ], "content: window slots hold other tokens' KV"
        if self.recurrent is not None and m.length:
            assert self.content[self.recurrent][m.state] == tuple(tokens[: m.length]), (
                "content: the state is not the prefix's"
            )
        if m.node is not self.cache.root:
            assert path_below(self.cache.root, m.node)[-1] is m.node


def _child(cache: HybridRadixCache, node: HybridNode, tokens: list[int], pos: int):
    first = np.asarray(tokens[pos : pos + cache.page_size], dtype=np.int64).tobytes()
    if len(first) < cache.page_size * 8:
        return None
    return node.children.get((None, first) if node is cache.root else first)
