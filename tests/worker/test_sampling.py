"""Sampling parameters do what the OpenAI/vLLM semantics say."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from worker.engine import Engine, EngineConfig
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams
from worker.request import Request
from worker.sampling import sample


def request(tokens: list[int] | None = None, num_input: int = 1, **kw) -> Request:
    sp = SamplingParams(**kw)
    gen = None
    if sp.seed is not None:
        gen = torch.Generator().manual_seed(sp.seed)
    return Request("r", tokens or [0], num_input, 0, sp, generator=gen)


def draws(logits: list[float], n: int = 400, **kw) -> Counter:
    row = torch.tensor([logits])
    gen = torch.Generator().manual_seed(0)
    return Counter(sample(row, [request(**kw)], [], gen).token_ids[0] for _ in range(n))


def test_top_k_top_p_min_p_cut_the_tail():
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert set(draws(logits, top_k=2)) == {0, 1}
    assert set(draws(logits, top_p=0.7)) == {0, 1}  # 0.5 < 0.7: the second token stays
    assert set(draws(logits, min_p=0.5)) == {0, 1}  # 0.15 < 0.5 * 0.5
    assert set(draws(logits)) == {0, 1, 2, 3}
    assert set(draws(logits, temperature=0.0)) == {0}
    assert set(draws(logits, top_k=1, temperature=1.5)) == {0}


def test_greedy_takes_the_first_of_tied_maxima_per_row():
    """As HF's and vLLM's argmax do: tied top logits resolve to the lowest token id."""
    rows = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0], [-1.0, -5.0, -1.0, -9.0]])
    reqs = [request(temperature=0.0) for _ in range(3)]
    assert sample(rows, reqs, [], None).token_ids == [1, 0, 0]


def test_low_temperature_sharpens():
    logits = [math.log(p) for p in (0.5, 0.3, 0.2)]
    assert draws(logits, temperature=0.2)[0] > draws(logits, temperature=2.0)[0]


def test_penalties_push_repeated_tokens_down():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    out = [0, 0, 0]  # the output so far repeats token 0
    plain = request(tokens=[2] + out, temperature=0.0)
    assert sample(logits, [plain], []).token_ids == [0]
    for kw in ({"frequency_penalty": 0.1}, {"presence_penalty": 0.2}, {"repetition_penalty": 1.2}):
        req = request(tokens=[2] + out, temperature=0.0, **kw)
        assert sample(logits, [req], []).token_ids == [1], kw
    # presence counts once, frequency per occurrence
    weak = request(tokens=[2] + out, temperature=0.0, presence_penalty=0.05)
    assert sample(logits, [weak], []).token_ids == [0]


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    req = request(tokens=[2], temperature=0.0, min_tokens=1, stop_token_ids=[0])
    assert sample(logits, [req], eos_token_ids=[]).token_ids == [1]
    eos = request(tokens=[2], temperature=0.0, min_tokens=1)
    assert sample(logits, [eos], eos_token_ids=[0]).token_ids == [1]
    done = request(tokens=[2, 1], temperature=0.0, min_tokens=1, stop_token_ids=[0])
    assert sample(logits, [done], eos_token_ids=[]).token_ids == [0]


def test_logprobs_are_the_raw_distribution():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    reqs = [request(temperature=0.0, logprobs=5), request(temperature=0.7, seed=3, logprobs=0)]
    res = sample(logits, reqs, [])
    full = logits.log_softmax(-1)
    assert res.logprobs[0] == pytest.approx(float(full[0].max()))
    top = res.top_logprobs[0]
    assert [t for t, _ in top] == full[0].topk(5).indices.tolist()
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert sum(math.exp(v) for _, v in top) <= 1.0 + 1e-6
    assert res.top_logprobs[1] == [] and res.logprobs[1] == pytest.approx(
        float(full[1, res.token_ids[1]])
    )


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(kv_tokens=4096))


def generate(engine: Engine, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
    return {rid: c.token_ids for rid, c in out.items()}


def prompt(seed: int, length: int = 30) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def test_seed_is_reproducible_whatever_the_batch(engine):
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    alone = generate(engine, [GenerateRequest("a", prompt(1), sp)])["a"]
    others = [
        GenerateRequest(f"o{i}", prompt(10 + i), SamplingParams(max_tokens=16, ignore_eos=True))
        for i in range(4)
    ]
    mixed = generate(engine, [*others, GenerateRequest("a", prompt(1), sp)])["a"]
    assert alone == mixed
    sp_other = SamplingParams(max_tokens=16, temperature=1.0, seed=43, ignore_eos=True)
    assert generate(engine, [GenerateRequest("b", prompt(1), sp_other)])["b"] != alone


def test_top_k_1_is_greedy(engine):
    p = prompt(2)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    top1 = SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True)
    out = generate(engine, [GenerateRequest("g", p, greedy), GenerateRequest("k", p, top1)])
    assert out["g"] == out["k"]


def test_frequency_penalty_reduces_repetition(engine):
    p = prompt(3, 20)
    plain = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    penal = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, frequency_penalty=2.0)
    out = generate(engine, [GenerateRequest("p", p, plain), GenerateRequest("f", p, penal)])
    assert len(set(out["f"])) > len(set(out["p"]))


def test_engine_streams_logprobs_per_token(engine):
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    out = run_to_completion(engine, [GenerateRequest("l", prompt(4), sp)])["l"]
    assert len(out.logprobs) == len(out.top_logprobs) == 6
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert top[0][0] == token and top[0][1] == pytest.approx(lp) and lp <= 0
