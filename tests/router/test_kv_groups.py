"""KV groups of hybrid models: the resume rule against a reference model of vLLM's, the mirror
of vLLM's per-group events (Gemma 3's shapes, as vLLM 0.32 sends them), and the index and the
routing built on them. The same against a real vLLM serving Gemma 3: tests/vllm/."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from mem_cache.events import (
    DEVICE,
    FULL_ATTENTION,
    RECURRENT,
    SLIDING_WINDOW,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVGroup,
    block_hashes,
)
from router.backends.external.mirror import EngineMirror, EngineRemoved, EngineStored
from router.routing.core import RoutingCore
from router.routing.kv_groups import resume_blocks
from router.routing.prefix_index import IndexConfig, PrefixIndex

BS = 128
WINDOW = 512
SLIDING = [KVGroup(i, SLIDING_WINDOW, WINDOW) for i in range(5)]
FULL = KVGroup(5, FULL_ATTENTION)


# --- the rule ------------------------------------------------------------------------------------


def reference_allows(group: KVGroup, held: set[int], length: int, block_size: int) -> bool:
    """vLLM's rule, stated directly: can the group resume at `length` blocks?"""
    if length == 0:
        return True
    if group.kind == FULL_ATTENTION:
        return all(i in held for i in range(length))
    if group.kind == RECURRENT:
        return length - 1 in held
    tokens = length * block_size
    first = max(0, tokens - (group.window - 1)) // block_size  # the block of the oldest token
    return all(i in held for i in range(first, length))


groups_strategy = st.lists(
    st.tuples(
        st.sampled_from([FULL_ATTENTION, SLIDING_WINDOW, RECURRENT]),
        st.integers(1, 700),  # window, for sliding groups
        st.sets(st.integers(0, 23)),  # held block positions
    ),
    min_size=1, max_size=4,
)


@settings(max_examples=400, deadline=None)
@given(groups=groups_strategy, bound=st.integers(0, 24), block_size=st.sampled_from([16, 128]))
def test_resume_point_is_the_largest_every_group_allows(groups, bound, block_size):
    hashes = list(range(1000, 1024))  # block i has hash 1000 + i
    built = []
    for i, (kind, window, held) in enumerate(groups):
        group = KVGroup(i, kind, window if kind == SLIDING_WINDOW else None)
        built.append((group, {1000 + b for b in held}, held))
    got = resume_blocks(hashes, bound, [(g, h) for g, h, _ in built], block_size)
    expected = max(
        length for length in range(min(bound, len(hashes)) + 1)
        if all(reference_allows(g, held, length, block_size) for g, _, held in built)
    )
    assert got == expected


def test_gemma3_facts_of_the_issue():
    """Full group: blocks 0-10; windows: blocks 7-10. A resend of the 1,500-token prompt
    resumes at 1,408; a prompt sharing 1,200 tokens at 0; a 1,408-token prompt (cap 1,407) at
    0; with the window's last block evicted, at 0 though every full block is held."""
    hashes = list(range(20))
    full, window = set(range(11)), set(range(7, 11))
    groups = [(FULL, full)] + [(g, window) for g in SLIDING]
    assert resume_blocks(hashes, 1499 // BS, groups, BS) == 11
    assert resume_blocks(hashes, 1199 // BS, groups, BS) == 0  # 9 shared blocks
    assert resume_blocks(hashes, 1407 // BS, groups, BS) == 0
    evicted = [(FULL, full), (SLIDING[0], window - {10})] + [(g, window) for g in SLIDING[1:]]
    assert resume_blocks(hashes, 11, evicted, BS) == 0
    assert resume_blocks(hashes, 3, [(FULL, full), (SLIDING[0], set())], BS) == 0
    assert resume_blocks(hashes, 3, [(FULL, full), (SLIDING[0], {0, 1, 2})], BS) == 3


# --- vLLM's events, mirrored --------------------------------------------------------------------

_ids = itertools.count(10_000)


def gemma_prompt(tokens, medium="GPU"):
    """vLLM's events for a prompt computed from scratch on Gemma 3: every sliding group with
    the hashes of the last window, all tokens and a null parent; then the full group."""
    n = len(tokens) // BS
    hashes = [next(_ids) for _ in range(n)]
    body = tokens[: n * BS]
    need = -(-(WINDOW - 1) // BS)
    events = [EngineStored(hashes[max(0, n - need):], None, body, BS, medium, None, False,
                           g.index, "sliding_window", WINDOW) for g in SLIDING]
    events.append(EngineStored(hashes, None, body, BS, medium, None, False, 5,
                               "full_attention"))
    return hashes, events


def index_of(*batches, config=None) -> PrefixIndex:
    index = PrefixIndex(config)
    for worker, events in batches:
        index.add_worker(worker)
        index.apply(worker, events)
    return index


def test_mirror_maps_each_group_and_counts_copies():
    tokens = list(range(1500))
    ours = block_hashes(tokens, None, BS)
    mirror = EngineMirror(BS)
    hashes, events = gemma_prompt(tokens)
    out = mirror.apply(events)
    assert BlockStored(ours[:11], None, DEVICE, FULL) in out
    for g in SLIDING:
        assert BlockStored(ours[7:11], None, DEVICE, g) in out
    # a decode step: empty sliding events; a second copy: nothing new
    decode = EngineStored([], None, tokens[1408:1536], BS, "GPU", None, False, 0,
                          "sliding_window", WINDOW)
    assert mirror.apply([decode]) == []
    assert mirror.apply([events[0]]) == []
    # one BlockRemoved per copy: the second one removes it
    remove = EngineRemoved([hashes[10]], "GPU", 0)
    assert mirror.apply([remove]) == []
    assert mirror.apply([remove]) == [BlockRemoved(ours[10:11], DEVICE, SLIDING[0])]
    snap = mirror.snapshot()
    assert snap[0] == AllCleared()
    assert BlockStored(ours[7:10], None, DEVICE, SLIDING[0]) in snap
    assert BlockStored(ours[:11], None, DEVICE, FULL) in snap


def test_window_twins_take_the_full_groups_chain():
    """A sliding group's hashes need not be the last blocks (vLLM also keeps the window before
    a shared prefix's end): where the full group names the same hashes in the batch, their
    place comes from it, even though the sliding events come first."""
    tokens = list(range(1408))
    ours = block_hashes(tokens, None, BS)
    hashes = [next(_ids) for _ in range(11)]
    odd = [hashes[i] for i in (1, 2, 3, 4, 8, 9, 10)]  # the junction's window and the last
    events = [EngineStored(odd, None, tokens, BS, "GPU", None, False, 0, "sliding_window",
                           WINDOW),
              EngineStored(hashes, None, tokens, BS, "GPU", None, False, 5, "full_attention")]
    out = EngineMirror(BS).apply(events)
    assert BlockStored([ours[i] for i in (1, 2, 3, 4, 8, 9, 10)], None, DEVICE, SLIDING[0]) in out


def test_engine_without_groups_and_kindless_group_zero_behave_as_before():
    tokens = list(range(512))
    ours = block_hashes(tokens, None, BS)
    plain = EngineStored([1, 2, 3, 4], None, tokens, BS, "GPU", None, False)
    kindless = EngineStored([1, 2, 3, 4], None, tokens, BS, "GPU", None, False, 0)
    other = EngineStored([1, 2, 3, 4], None, tokens, BS, "GPU", None, False, 1)
    assert EngineMirror(BS).apply([plain]) == [BlockStored(ours, None, DEVICE)]
    mirror = EngineMirror(BS)
    assert mirror.apply([kindless, other]) == [BlockStored(ours, None, DEVICE)]
    assert mirror.apply([EngineRemoved([4], "GPU", 0)]) == [BlockRemoved(ours[3:], DEVICE)]
    assert mirror.apply([EngineRemoved([3], "GPU", 1)]) == []


# --- the index and routing ------------------------------------------------------------------------


def worker_events(tokens):
    return EngineMirror(BS).apply(gemma_prompt(tokens)[1])


def test_index_predicts_the_resume_point_not_the_full_match():
    a = list(range(1500))
    index = index_of(("w", worker_events(a)))
    assert index.match(block_hashes(a, None, BS), 1499 // BS, BS).device == {"w": 11}
    shared = a[:1200] + list(range(5000, 5300))
    assert index.match(block_hashes(shared, None, BS), 1499 // BS, BS).device == {}
    # the full-group-only variant over-predicts: 9 blocks it would not get
    blind = index_of(("w", worker_events(a)), config=IndexConfig(kv_groups=False))
    assert blind.match(block_hashes(shared, None, BS), 1499 // BS, BS).device == {"w": 9}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40)), min_size=1, max_size=12),
       st.lists(st.integers(0, 2), min_size=1, max_size=12))
def test_a_single_full_attention_group_matches_exactly_as_no_group(prompts, removals):
    """vLLM tags a full-attention-only model's events with group 0: same index as without."""
    tagged, plain = PrefixIndex(), PrefixIndex()
    for index in (tagged, plain):
        index.add_worker("w")
    full0 = KVGroup(0, FULL_ATTENTION)
    seen = []
    for seed, blocks in prompts:
        hashes = block_hashes([seed] * 7 + list(range(blocks * 4)), None, 4)
        seen.append(hashes)
        tagged.apply("w", [BlockStored(hashes, None, DEVICE, full0)])
        plain.apply("w", [BlockStored(hashes, None, DEVICE)])
    for r in removals:
        victim = seen[r % len(seen)][-1:]
        tagged.apply("w", [BlockRemoved(victim, DEVICE, full0)])
        plain.apply("w", [BlockRemoved(victim, DEVICE)])
    for hashes in seen:
        assert tagged.match(hashes, len(hashes) - 1, 4) == plain.match(hashes, len(hashes) - 1, 4)


def test_evicted_window_routes_to_the_engine_that_holds_the_prefix():
    """w-long holds more full-attention blocks of the request than w-short, but its window at
    the end of the shared prefix is evicted: only w-short can resume, and the router sends the
    request there (the full-group-only router sends it to w-long, which computes it all)."""
    base = list(range(1500))
    longer = base[:1408] + list(range(7000, 7300))
    request = base[:1408] + list(range(7000, 7200)) + list(range(9000, 9100))
    long_events = worker_events(longer)  # full blocks 0-12 of `longer`, windows at 9-12
    short_events = worker_events(base)  # full blocks 0-10 of `base`, windows at 7-10
    hashes = block_hashes(request, None, BS)
    choices = {}
    for groups in (True, False):
        core = RoutingCore("cost", clock=lambda: 0.0, block_size=BS)
        core.index.config.kv_groups = groups
        for worker, events in (("w-long", long_events), ("w-short", short_events)):
            core.add_worker(worker)
            core.index.apply(worker, events)
        match = core.index.match(hashes, (len(request) - 1) // BS, BS).device
        choices[groups] = (core.route("r", hashes, len(request), 8).worker_id, match)
    assert choices[True] == ("w-short", {"w-short": 11})
    assert choices[False] == ("w-long", {"w-long": 12, "w-short": 11})


def test_routing_guesses_the_groups_until_events_confirm():
    """Right after routing a prompt to a hybrid worker, a resend of it is predicted the hit
    the engine will give (its windows are guessed as the engine keeps them)."""
    core = RoutingCore("cost", clock=lambda: 0.0, block_size=BS)
    core.add_worker("w")
    core.index.apply("w", worker_events(list(range(9000, 9600))))  # the groups are known
    prompt = list(range(1500))
    hashes = block_hashes(prompt, None, BS)
    core.route("r1", hashes, len(prompt), 8)
    assert core.index.match(hashes, 1499 // BS, BS).device == {"w": 11}
    shared = prompt[:1200] + list(range(5000, 5300))
    assert core.index.match(block_hashes(shared, None, BS), 1499 // BS, BS).device == {}


def test_our_engines_batches_with_groups_are_indexed_by_the_same_code():
    """A radixray worker of a hybrid model tags its blocks with their group
    (`mem_cache.events`); through the encoded batches the core reads, the index predicts the
    same resume point as from vLLM's events, and a recurrent group needs a state exactly
    there."""
    from mem_cache.events import encode_batch

    prompt = list(range(1500))
    ours = block_hashes(prompt, None, BS)
    state = KVGroup(1, RECURRENT)
    full0 = KVGroup(0, FULL_ATTENTION)
    core = RoutingCore("cost", clock=lambda: 0.0, block_size=BS)
    core.add_worker("w")
    events = [AllCleared(), BlockStored(ours, None, DEVICE, full0),
              BlockStored(ours[5:6] + ours[10:11], None, DEVICE, state)]
    assert core.apply_events(encode_batch("w", 0, 1, events))
    assert core.index.match(ours, 1499 // BS, BS).device == {"w": 11}
    assert core.index.match(ours[:9], 1151 // BS, BS).device == {"w": 6}  # the state at 6
    assert core.apply_events(encode_batch("w", 0, 2, [BlockRemoved(ours[10:11], DEVICE, state)]))
    assert core.index.match(ours, 1499 // BS, BS).device == {"w": 6}


STATE = KVGroup(1, RECURRENT)
MODEL_GROUPS = (FULL, SLIDING[0], STATE)
_streams = [block_hashes([s] * 3 + list(range(12 * BS)), None, BS) for s in range(3)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from(MODEL_GROUPS), st.integers(0, 2),
                          st.integers(0, 11), st.integers(1, 12)), max_size=30),
       st.integers(0, 2), st.integers(0, 12))
def test_group_index_against_a_reference_model(steps, stream, limit):
    """Random stores and removals per group on one worker; the index's match equals the
    largest resume point of vLLM's rule over a plain model of what each group holds."""
    index = PrefixIndex()
    index.add_worker("w")
    model: dict[KVGroup, set[int]] = {g: set() for g in MODEL_GROUPS}
    for store, group, s, start, length in steps:
        hashes = _streams[s][start:start + length]
        if store:
            model[group] |= set(hashes)
            index.apply("w", [BlockStored(hashes, None, DEVICE, group)])
        else:
            model[group] -= set(hashes)
            index.apply("w", [BlockRemoved(hashes, DEVICE, group)])
    hashes = _streams[stream]
    positions = {g: {i for i, h in enumerate(hashes) if h in model[g]} for g in MODEL_GROUPS}
    # the groups the worker's events named; without a full-attention group, no full run binds
    seen = {group for _, group, *_ in steps}
    if seen <= {FULL}:  # full attention only: the whole run, as before (the estimate caps it)
        seen, limit = {FULL}, len(hashes)
    expected = max(n for n in range(limit + 1) if all(
        reference_allows(g, positions[g], n, BS) for g in seen))
    assert index.match(hashes, limit, BS).device.get("w", 0) == expected
