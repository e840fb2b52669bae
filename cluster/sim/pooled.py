"""The pooled bound: one cache with the whole cluster's capacity, no router, no waiting.

Every request, in arrival order, matches its prefix then inserts its prompt at once; LRU leaves
are evicted to stay within capacity. No router can place requests better than a single cache
that holds everything the cluster could, so its hit rate bounds every policy's (up to LRU's own
imperfection). It is the same `RadixCache` the simulated workers use.
"""

from __future__ import annotations

from cluster.sim.worker import cached_tokens
from cluster.sim.workloads import Workload
from mem_cache.radix_cache import RadixCache


def pooled_hit_rate(workload: Workload, capacity_tokens: int) -> float:
    """Token hit rate of one LRU cache of `capacity_tokens` over `workload`."""
    bt = workload.block_tokens
    capacity = max(1, capacity_tokens // bt)
    cache = RadixCache(None, page_size=1, block_size=1)
    hit = total = 0
    for req in workload.requests:
        matched = cache.match_prefix(req.blocks).length
        hit += cached_tokens(matched, bt, req.input_length)
        total += req.input_length
        cache.insert(req.blocks[:capacity], None)
        over = cache.total_size() - capacity
        if over > 0:
            cache.evict(over)  # the prompt just inserted is the most recent: evicted last
        cache.take_events()
    return hit / total if total else 0.0
