"""The `native` backend: torch ops that read the paged KV pool in place through the slot table.

The engine's default. It gives what the reference `torch` backend gives, with less work:

- Decode: every sequence that decodes one token is attended in one call. Its K/V rows are
  gathered once per layer, straight into head-major order `[B, KVH, Kmax, D]`, into a
  workspace that lives as long as the backend (a fresh multi-MB tensor per layer costs more in
  page faults than the copy itself). The query heads of each KV head's group stand side by
  side as that head's "queries" (`[B, KVH, G, D]`), so one SDPA with a key-length mask covers
  the batch without repeating K/V per query head. The slot table is built once per pass.
- Decode over a shared prefix (CPU, cascade attention): sequences whose first `MIN_SHARED`+
  slots are the same (the radix cache gave them one prefix) form a group; the group's queries
  attend to that prefix together, its KV gathered once per layer instead of once per member,
  and each sequence attends to the rest of its keys; the two results are merged exactly by
  their log-sum-exp. With 8 sequences over a 1k-token system prompt this reads an eighth of
  the KV a per-sequence gather reads.
- Over a bfloat16 or float32 pool, where `worker.kernels.decode_attention` builds, every decode
  batch goes through that C kernel instead: the same groups as segments of key slots read from the
  pool in place (and each sequence's own keys as one more), one online softmax per query
  across its segments (no gather, mask or merge), several times faster than torch's path
  (docs/engine.md).
- Prefill on CPU over a float32 pool, or a bfloat16 one where the CPU has AVX512-BF16: each
  chunk of up to the most queries at which it beats torch's path on this core (`kernel_queries`,
  timed at first use) goes through `worker.kernels.prefill_attention`, causal over its cached
  prefix and itself with the keys read from the pool in place (no gather, mask or merge). With
  AMX torch's flash attention multiplies bf16 in its tiles and wins from a few dozen queries on;
  without, the kernel wins at every size measured.
- A chunk of up to `SEGMENT_QUERIES` queries over a cached prefix, where the decode kernel
  scores and weighs in AMX tiles (`DecodeKernel.amx`), goes through that kernel as segments:
  each query a sequence of its own, all of them one segment over the prefix (AMX tiles of 16
  queries), then each query one segment over the chunk's keys up to itself (the causal part).
  It beats torch's path on short chunks and loses past a few hundred queries, since the
  causal part grows with the square of the chunk (docs/engine.md).
- Elsewhere, prefill without a cached prefix attends over its own new K/V (`is_causal`), no
  gather.
- And prefill over a cached prefix (CPU): the chunk attends to the prefix (gathered, no mask)
  and to itself (causal) in two calls that also return the log-sum-exp of their scores; the
  two partial results are merged exactly by their log-sum-exp. No `[q_len, kv_len]` mask is
  built. Other devices use the end-aligned mask as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F

import worker.kernels.decode_attention as decode_kernel
import worker.kernels.prefill_attention as prefill_kernel
from worker.attention.base import AttentionBackend, AttentionBatch, end_aligned_mask
from worker.kernels.calibration import median_seconds, most_won

# the chunk sizes `kernel_queries` times, each over a cached prefix of CALIBRATION_PREFIX keys
CALIBRATION_QUERIES, CALIBRATION_PREFIX = (16, 64, 256, 1024), 512
UNBOUNDED = 1 << 40
# the most queries a chunk over a cached prefix may have to go through the decode kernel's
# segments (where it has AMX): past it torch's path wins (docs/engine.md)
SEGMENT_QUERIES = 128


class NativeAttention(AttentionBackend):
    name = "native"

    def __init__(self, use_kernel: bool = True) -> None:
        self.use_kernel = use_kernel  # the C kernels where they serve (else pure torch)
        self._workspace: torch.Tensor | None = None  # [2, n, D]: gathered decode K and V

    def forward(self, q, k, v, layer, batch, kv_pool):
        k_buf, v_buf = kv_pool.k_buffer[layer], kv_pool.v_buffer[layer]
        k_buf.index_copy_(0, batch.slot_mapping, k.to(k_buf.dtype))
        v_buf.index_copy_(0, batch.slot_mapping, v.to(v_buf.dtype))
        plan = batch.plan.get("native")
        if plan is None:
            use = self.use_kernel and decode_kernel.supports(q, k_buf)
            kernel = decode_kernel.load(q.dtype) if use else None
            plan = _NativePlan.build(batch, kv_pool.num_kv_heads, kernel)
            batch.plan["native"] = plan
        if plan.all_decode:
            return self._decode(q, k_buf, v_buf, plan)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(q[plan.decode_rows], k_buf, v_buf, plan)
        same_dtype = k_buf.dtype == q.dtype
        chunk_kernel, most = self._prefill_kernel(q, k_buf)
        segment_kernel = self._segment_kernel(q, k_buf)
        for i, (start, q_len, prefix_slots, slots) in enumerate(plan.prefills):
            end = start + q_len
            if segment_kernel is not None and prefix_slots is not None and q_len <= SEGMENT_QUERIES:
                segments = plan.chunk_segments(i)
                out[start:end] = segment_kernel(q[start:end], k_buf, v_buf, *segments)
                continue
            if chunk_kernel is not None and q_len <= most:  # the keys read from the pool in place
                out[start:end] = chunk_kernel(q[start:end], k_buf, v_buf, slots)
                continue
            out[start:end] = _prefill(
                q[start:end], k[start:end], v[start:end], prefix_slots, k_buf, v_buf, same_dtype
            )
        return out

    def _prefill_kernel(self, q: torch.Tensor, k_buf: torch.Tensor):
        """(the prefill kernel for these tensors or None, the most queries a chunk it takes
        may have)."""
        if not (self.use_kernel and prefill_kernel.supports(q, k_buf)):
            return None, 0
        kernel = prefill_kernel.load(q.dtype)
        if kernel is None:
            return None, 0
        return kernel, kernel_queries(kernel, q.shape[1], k_buf.shape[1], q.shape[2])

    def _segment_kernel(self, q: torch.Tensor, k_buf: torch.Tensor):
        """The decode kernel where it takes chunks over a cached prefix as segments (AMX), else
        None."""
        if not (self.use_kernel and decode_kernel.supports(q, k_buf)):
            return None
        kernel = decode_kernel.load(q.dtype)
        return kernel if kernel is not None and kernel.amx else None

    def _gather(
        self, k_buf: torch.Tensor, v_buf: torch.Tensor, plan: _NativePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `plan.head_index` from the pool viewed as [slots * KVH, D], K and V."""
        n, dim = plan.head_index.numel(), k_buf.shape[-1]
        ws = self._workspace
        if ws is None or ws.shape[1] < n or ws.dtype != k_buf.dtype or ws.device != k_buf.device:
            ws = self._workspace = torch.empty((2, n, dim), dtype=k_buf.dtype, device=k_buf.device)
        k = torch.index_select(k_buf.view(-1, dim), 0, plan.head_index, out=ws[0, :n])
        v = torch.index_select(v_buf.view(-1, dim), 0, plan.head_index, out=ws[1, :n])
        return k, v

    def _decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, plan: _NativePlan
    ) -> torch.Tensor:
        """One query per sequence: q [B, H, D] -> [B, H, D]."""
        if plan.kernel is not None:  # the C kernel over the plan's segments, pool in place
            return plan.kernel(q, k_buf, v_buf, *plan.segments)
        b, heads, dim = q.shape
        kv_heads, group = plan.num_kv_heads, heads // plan.num_kv_heads
        k, v = self._gather(k_buf, v_buf, plan)
        qg = q.view(b, kv_heads, group, dim)
        shape, own = (b, kv_heads, plan.kmax, dim), b * kv_heads * plan.kmax
        ks, vs = k[:own].view(shape), v[:own].view(shape)
        if not plan.shared:
            o = F.scaled_dot_product_attention(
                qg, ks.to(q.dtype), vs.to(q.dtype), attn_mask=plan.decode_mask
            )
            return o.reshape(b, heads, dim)
        # Each sequence over its own keys (past its group's shared prefix), with the LSE ...
        mask = plan.additive_mask(q.dtype)
        o, lse = _FLASH(qg, ks.to(q.dtype), vs.to(q.dtype), 0.0, False, attn_mask=mask)
        o, lse = o.float(), lse.float()
        offset = own
        for members, length in plan.shared:
            # ... and each group's queries together over the prefix its members share, once.
            n = members.numel()
            size = kv_heads * length
            kp = k[offset : offset + size].view(1, kv_heads, length, dim).to(q.dtype)
            vp = v[offset : offset + size].view(1, kv_heads, length, dim).to(q.dtype)
            offset += size
            qp = qg.index_select(0, members).transpose(0, 1).reshape(1, kv_heads, n * group, dim)
            op, lsep = _FLASH(qp, kp, vp, 0.0, False)
            op = op.reshape(kv_heads, n, group, dim).transpose(0, 1).float()
            lsep = lsep.reshape(kv_heads, n, group).transpose(0, 1).float()
            o_own, lse_own = o.index_select(0, members), lse.index_select(0, members)
            o.index_copy_(0, members, _merge(op, lsep, o_own, lse_own))
        return o.to(q.dtype).reshape(b, heads, dim)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Attention over two disjoint key sets, merged exactly by their log-sum-exp (float32)."""
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp()[..., None], (lse2 - top).exp()[..., None]
    return (o1 * w1 + o2 * w2) / (w1 + w2)


MIN_SHARED = 32  # shortest common prefix that decoding sequences attend to once, together


@dataclass
class _NativePlan:
    """Index tensors of one batch, built once per forward pass and shared by every layer.

    Decoding sequences that share the slots of a prefix (the radix cache handed them the same
    KV) form a group when that prefix has `MIN_SHARED` tokens or more: on CPU each group's
    queries attend to the shared prefix in one call (its KV gathered once, not once per
    member), each sequence attends to the rest of its keys, and the two results are merged by
    their log-sum-exp (cascade attention). `head_index` lists the pool rows of the per-sequence
    keys `[B, KVH, Kmax]` (padded), then each group's prefix `[KVH, L]`.

    With the C kernel (`kernel`), the batch becomes `segments` instead: (slots, segment rows,
    members) as `DecodeKernel` takes them, one segment per group's prefix (if any), then one
    per sequence over the rest of its keys; nothing is gathered and no mask is built.
    """

    all_decode: bool  # every sequence decodes one token: the output is the decode output
    decode_rows: torch.Tensor | None  # [B] token rows of the decoding sequences (mixed batch)
    head_index: torch.Tensor | None  # rows of the pool viewed as [size*KVH, D] (see above)
    decode_mask: torch.Tensor | None  # [B, 1, 1, Kmax] where a key is real (bool or additive)
    kmax: int  # keys per sequence past its shared prefix (padded)
    num_kv_heads: int
    # per prefill chunk: start, q_len, its cached prefix's slots (or None), all its slots
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor]]
    shared: list[tuple[torch.Tensor, int]]  # per group: member indices [n], shared length
    kernel: decode_kernel.DecodeKernel | None = None  # set: decode through it, over `segments`
    segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _additive: torch.Tensor | None = None
    _chunks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    def chunk_segments(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill chunk `i` as the decode kernel's (slots, segments, members), made once: its
        t queries as sequences, all of them over its cached prefix in one segment, then query
        j over the chunk's first j + 1 keys (causal)."""
        if i not in self._chunks:
            _, t, prefix, slots = self.prefills[i]
            p, queries = prefix.numel(), torch.arange(t)
            rows = torch.empty(t + 1, 4, dtype=torch.int64)
            rows[0] = torch.tensor([0, p, 0, t])
            rows[1:, 0], rows[1:, 1], rows[1:, 2], rows[1:, 3] = p, queries + 1, t + queries, 1
            self._chunks[i] = (slots, rows, torch.cat([queries, queries]))
        return self._chunks[i]

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """`decode_mask` as 0 / -inf in `dtype` (what the CPU flash kernel takes), made once."""
        if self._additive is None or self._additive.dtype != dtype:
            zero = torch.zeros((), dtype=dtype, device=self.decode_mask.device)
            self._additive = zero.masked_fill(~self.decode_mask, float("-inf"))
        return self._additive

    @staticmethod
    def build(
        batch: AttentionBatch, num_kv_heads: int, kernel: decode_kernel.DecodeKernel | None = None
    ) -> _NativePlan:
        device = batch.slot_mapping.device
        decode_seqs, rows, prefills = [], [], []
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
            if q_len == 1:
                decode_seqs.append(i)
                rows.append(start)
            else:
                prefix = kv_len - q_len
                slots = batch.slots(i)
                prefills.append((start, q_len, slots[:prefix] if prefix else None, slots))
            start += q_len
        if not decode_seqs:
            return _NativePlan(False, None, None, None, 0, num_kv_heads, prefills, [])
        kv_lens = [batch.kv_lens[i] for i in decode_seqs]
        table = batch.padded_slots(decode_seqs, max(kv_lens))  # [B, Kmax], padding: valid slots
        shared = _shared_prefixes(table, kv_lens) if device.type == "cpu" else []
        starts = [0] * len(kv_lens)
        prefix_slots = []
        for members, length in shared:
            prefix_slots.append(table[int(members[0]), :length])
            for m in members.tolist():
                starts[m] = length
        own = [n - s for n, s in zip(kv_lens, starts, strict=True)]
        all_decode = not prefills
        decode_rows = None if all_decode else torch.tensor(rows, device=device)
        if kernel is not None:
            segments = _segments(table, kv_lens, starts, prefix_slots, shared)
            return _NativePlan(
                all_decode, decode_rows, None, None, max(own), num_kv_heads, prefills, shared,
                kernel, segments,
            )  # fmt: skip
        kmax = max(own)
        if shared:  # each sequence's keys from its start, padded with later (valid) entries
            at = torch.tensor(starts, device=device)[:, None] + torch.arange(kmax, device=device)
            table = table.gather(1, at.clamp_(max=table.shape[1] - 1))
        heads = torch.arange(num_kv_heads, device=device)
        index = [(table[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)]
        index += [(s[None, :] * num_kv_heads + heads[:, None]).reshape(-1) for s in prefix_slots]
        lens = torch.tensor(own, device=device)
        mask = (torch.arange(kmax, device=device)[None, :] < lens[:, None])[:, None, None, :]
        head_index = torch.cat(index) if len(index) > 1 else index[0]
        return _NativePlan(
            all_decode, decode_rows, head_index, mask, kmax, num_kv_heads, prefills, shared
        )


def _segments(
    table: torch.Tensor,
    kv_lens: list[int],
    starts: list[int],
    prefix_slots: list[torch.Tensor],
    shared: list[tuple[torch.Tensor, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's (slots, segments [n, 4], members): each group's prefix (its members'
    queries together), then each sequence's keys from its `start` to its `kv_len`."""
    b, width = table.shape
    keys = torch.arange(width)[None, :]
    own = (keys >= torch.tensor(starts)[:, None]) & (keys < torch.tensor(kv_lens)[:, None])
    slots = torch.cat([*prefix_slots, table[own]])
    rows, offset, member_offset = [], 0, 0
    for members, length in shared:
        rows.append((offset, length, member_offset, members.numel()))
        offset += length
        member_offset += members.numel()
    for i, (start, kv_len) in enumerate(zip(starts, kv_lens, strict=True)):
        rows.append((offset, kv_len - start, member_offset + i, 1))
        offset += kv_len - start
    members = torch.cat([*(m for m, _ in shared), torch.arange(b)])
    return slots, torch.tensor(rows, dtype=torch.int64), members


def _shared_prefixes(table: torch.Tensor, kv_lens: list[int]) -> list[tuple[torch.Tensor, int]]:
    """Groups of >= 2 decoding sequences whose first `length >= MIN_SHARED` slots are the same
    (each keeps at least its newest key to itself): (member indices, length) per group."""
    by_first: dict[int, list[int]] = {}
    for i, slot in enumerate(table[:, 0].tolist()):
        if kv_lens[i] > MIN_SHARED:
            by_first.setdefault(slot, []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min(kv_lens[i] for i in members) - 1
        rows = table[members, :limit]
        differs = (rows != rows[0]).any(0)
        length = int(differs.int().argmax()) if bool(differs.any()) else limit
        if length >= MIN_SHARED:
            groups.append((torch.tensor(members, device=table.device), length))
    return groups


@cache
def kernel_queries(kernel, heads: int, kv_heads: int, dim: int, repeat: int = 3) -> int:
    """The most queries a prefill chunk may have for `kernel` to take it instead of torch's path
    (`_prefill`) here: of `CALIBRATION_QUERIES` in order, up to the first at which the kernel
    takes as long or longer over a chunk of that many queries with a cached prefix of
    `CALIBRATION_PREFIX` keys; `UNBOUNDED` where it never does, 0 where it loses at the first.

    Where it is faster depends on the core: without AMX the kernel wins at every size
    measured; with AMX torch's flash attention does bf16 in its tiles and wins from a few dozen
    queries on (docs/engine.md, `bench/bench_prefill_attention.py`). Timed on the threads the
    engine runs, once per kernel and head shape."""
    gen = torch.Generator().manual_seed(0)
    slots = CALIBRATION_PREFIX + max(CALIBRATION_QUERIES)
    k_buf = torch.randn(slots, kv_heads, dim, generator=gen).to(kernel.dtype)
    v_buf = torch.randn(slots, kv_heads, dim, generator=gen).to(kernel.dtype)
    prefix = torch.arange(CALIBRATION_PREFIX)
    queries = {nq: torch.randn(nq, heads, dim, generator=gen).to(kernel.dtype)
               for nq in CALIBRATION_QUERIES}  # fmt: skip

    def ours(nq: int) -> float:
        keys = torch.cat((prefix, torch.arange(CALIBRATION_PREFIX, CALIBRATION_PREFIX + nq)))
        return median_seconds(lambda: kernel(queries[nq], k_buf, v_buf, keys), repeat)

    def theirs(nq: int) -> float:
        own = torch.arange(CALIBRATION_PREFIX, CALIBRATION_PREFIX + nq)
        k, v = k_buf[own], v_buf[own]
        return median_seconds(
            lambda: _prefill(queries[nq], k, v, prefix, k_buf, v_buf, True), repeat)

    best = most_won(CALIBRATION_QUERIES, ours, theirs)
    return UNBOUNDED if best == CALIBRATION_QUERIES[-1] else best


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_slots: torch.Tensor | None,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    same_dtype: bool,
) -> torch.Tensor:
    """One chunk's attention: q [q_len, H, D], its new k/v [q_len, KVH, D], over its cached
    prefix (slots, or None) and itself, causal and aligned to the end -> [q_len, H, D]."""
    q_len = q.shape[0]
    qh = q.transpose(0, 1)[None]  # [1, H, q_len, D]
    if not same_dtype:  # attend over the pool's rounding of the new K/V, as the reference does
        k, v = k.to(k_buf.dtype).to(q.dtype), v.to(v_buf.dtype).to(q.dtype)
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if prefix_slots is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)
    kp = k_buf.index_select(0, prefix_slots).to(q.dtype).transpose(0, 1)[None]
    vp = v_buf.index_select(0, prefix_slots).to(q.dtype).transpose(0, 1)[None]
    if q.device.type != "cpu":
        kv_len = prefix_slots.numel() + q_len
        mask = end_aligned_mask(q_len, kv_len, q.device)
        k_all, v_all = torch.cat((kp, kh), dim=2), torch.cat((vp, vh), dim=2)
        o = F.scaled_dot_product_attention(qh, k_all, v_all, attn_mask=mask, enable_gqa=True)
        return o[0].transpose(0, 1)
    o_prefix, lse_prefix = _FLASH(qh, kp, vp, 0.0, False)  # every prefix key is visible
    o_self, lse_self = _FLASH(qh, kh, vh, 0.0, True)  # q_len == its own keys: plain causal
    o = _merge(o_prefix.float(), lse_prefix, o_self.float(), lse_self)
    return o[0].transpose(0, 1).to(q.dtype)
