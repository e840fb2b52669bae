"""Pick the next token of every sampled request from its logits, with its own SamplingParams.

Order of operations, per row: repetition / presence / frequency penalties, the min_tokens ban
on stop tokens, then greedy (`temperature == 0` or `top_k == 1`) or temperature, top-k, top-p,
min-p and a multinomial draw. A request with a `seed` draws from its own `torch.Generator`, so
its output does not depend on which other requests share the batch; the others share the
engine's generator.

Logprobs are those of the model's raw distribution (log-softmax of the logits before any
penalty or temperature), as vLLM reports them by default: the chosen token's, plus the top-n.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.request import Request


@dataclass
class SampleResult:
    """One entry per sampled row; the logprob lists are None for rows that did not ask."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def stop_ids(request: Request, eos_token_ids: list[int]) -> set[int]:
    """Token ids that end `request`: its stop_token_ids, plus EOS unless ignore_eos."""
    ids = set(request.sampling.stop_token_ids)
    if not request.sampling.ignore_eos:
        ids.update(eos_token_ids)
    return ids


def sample(
    logits: torch.Tensor,
    requests: list[Request],
    eos_token_ids: list[int],
    generator: torch.Generator | None = None,
) -> SampleResult:
    """logits float32 [S, vocab], one row per request in `requests` -> one token each."""
    raw = logits.float()
    logits = raw  # copied before the first change: `raw` stays the model's distribution
    for i, req in enumerate(requests):
        sp = req.sampling
        ban = req.num_output < sp.min_tokens
        if not (ban or sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1):
            continue
        if logits is raw:
            logits = raw.clone()
        _apply_penalties(logits[i], req)
        if ban:
            banned = [t for t in stop_ids(req, eos_token_ids) if 0 <= t < logits.shape[1]]
            logits[i, banned] = float("-inf")
    tokens = _pick(logits, requests, generator)
    return _logprobs(raw, tokens, requests)


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    """In place on one row of logits. Presence/frequency count generated tokens (OpenAI);
    the repetition penalty (HF/vLLM) covers prompt and output tokens."""
    sp = req.sampling
    vocab = row.shape[0]
    if sp.presence_penalty or sp.frequency_penalty:
        out = torch.tensor(req.output_ids, dtype=torch.int64, device=row.device)
        counts = torch.bincount(out.clamp(0, vocab - 1), minlength=vocab)[:vocab].to(row.dtype)
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.tokens)), dtype=torch.int64, device=row.device)
        seen = seen[(seen >= 0) & (seen < vocab)]
        vals = row[seen]
        row[seen] = torch.where(
            vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty
        )


def _is_greedy(req: Request) -> bool:
    return req.sampling.temperature <= 0.0 or req.sampling.top_k == 1


def _pick(
    logits: torch.Tensor, requests: list[Request], generator: torch.Generator | None
) -> list[int]:
    # the first maximal index, as argmax; faster than argmax on CPU
    tokens = logits.max(dim=-1).indices.tolist()
    random_rows = [i for i, r in enumerate(requests) if not _is_greedy(r)]
    if not random_rows:
        return tokens
    probs = _filtered_probs(logits[random_rows], [requests[i] for i in random_rows])
    for j, i in enumerate(random_rows):
        gen = requests[i].generator or generator
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen).item())
    return tokens


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p cuts, as probabilities [R, vocab]."""
    device = logits.device
    temps = torch.tensor([r.sampling.temperature for r in requests], device=device)
    logits = logits / temps[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor(
        [r.sampling.top_k if r.sampling.top_k > 0 else vocab for r in requests], device=device
    )
    cut = ranks >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    # top_p >= 1 keeps everything (2.0 so rounding in the cumulative sum never cuts)
    top_p = torch.tensor(
        [r.sampling.top_p if r.sampling.top_p < 1.0 else 2.0 for r in requests], device=device
    )
    # keep a token while the mass before it is < top_p (the top token always stays)
    cut |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    min_p = torch.tensor([r.sampling.min_p for r in requests], device=device)
    cut |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    cut[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def _logprobs(raw: torch.Tensor, tokens: list[int], requests: list[Request]) -> SampleResult:
    wanted = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    logprobs: list[float | None] = [None] * len(requests)
    tops: list[list[tuple[int, float]] | None] = [None] * len(requests)
    if wanted:
        lp = raw[wanted].log_softmax(dim=-1)
        for j, i in enumerate(wanted):
            logprobs[i] = float(lp[j, tokens[i]])
            n = min(requests[i].sampling.logprobs or 0, lp.shape[1])
            if n > 0:
                vals, ids = lp[j].topk(n)
                tops[i] = list(zip(ids.tolist(), vals.tolist(), strict=True))
            else:
                tops[i] = []
    return SampleResult(tokens, logprobs, tops)
