"""Set-up and checks shared by the engine tests: an engine on the built-in `tiny` model, greedy
sampling, random prompts, and the integrity checks run after every step and at idle.

Imported as `from engine_kit import ...`: this folder's conftest.py puts it on `sys.path`
(pytest's importlib mode puts no test folder there)."""

from __future__ import annotations

import os
import random

from worker.engine import Engine, EngineConfig
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

# the device and attention backend of the engines `make` builds unless told: the CPU and the
# default backend, or what these name (the GPU machine runs the engine tests with
# RADIXRAY_TEST_DEVICE=cuda and RADIXRAY_TEST_ATTENTION=triton; bench/gpu_check.sh)
DEVICE = os.environ.get("RADIXRAY_TEST_DEVICE", "cpu")
ATTENTION = os.environ.get("RADIXRAY_TEST_ATTENTION")


def make(**kw) -> Engine:
    """An engine with 4,096 KV slots unless `kv_tokens` says otherwise."""
    kw.setdefault("kv_tokens", 4096)
    kw.setdefault("device", DEVICE)
    if ATTENTION:
        kw.setdefault("attention", ATTENTION)
    return Engine(EngineConfig(**kw))


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def mixed_prompts(seed: int) -> list[list[int]]:
    """Prompts whose run mixes prefill and decode batches: four short ones, one over 2k tokens,
    and two behind one shared 300-token prefix."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40, 17, 3, 2100)]
    shared = [rng.randrange(3, 1000) for _ in range(300)]
    return prompts + [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (7, 30)]


def greedy_tokens(prompts: list[list[int]], max_tokens: int = 12, **config) -> list[list[int]]:
    """Each prompt's greedy tokens from a fresh engine of `config` (`make`'s), run together,
    the integrity checked after every step."""
    engine = make(**config)
    reqs = [GenerateRequest(f"p{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    out = run_to_completion(engine, reqs, after_step=checked)
    return [out[r.request_id].token_ids for r in reqs]


def checked(engine: Engine, step: int) -> None:
    """`after_step` of `run_to_completion`: the integrity check after every step."""
    engine.check_integrity()


def assert_idle_clean(engine: Engine) -> None:
    """The conservation check of an idle engine: every slot free or evictable."""
    s = engine.stats()
    assert (s.running, s.waiting, s.kv_protected, s.kv_session, s.sessions) == (0, 0, 0, 0, 0)
    assert s.kv_free + s.kv_evictable == s.kv_total
    engine.check_integrity()


def drive_randomly(
    engine: Engine, rng: random.Random, base: list[int], ops: int, max_new: int
) -> None:
    """`ops` random operations, each followed by 0-3 steps with the integrity check: arrivals
    (prefixes of `base`, session turns "s1"/"s2" that extend their history, resumes), aborts
    of any request so far, session closes. Leaves the engine with work to finish."""
    history: dict[str, list[int]] = {}
    for i in range(ops):
        op = rng.random()
        if op < 0.35:
            sid = rng.choice([None, None, "s1", "s2"])
            ids = (
                history.get(sid, []) + base[: rng.randrange(1, 40)]
                if sid
                else base[: rng.randrange(0, 48)] + prompt(rng.randrange(1, 20), 1000 + i)
            )
            ids = ids[-100:]
            sp = greedy(rng.randrange(1, max_new))
            resume = prompt(rng.randrange(1, sp.max_tokens), i) if rng.random() < 0.1 else []
            if len(resume) >= sp.max_tokens:
                resume = []
            engine.add_request(GenerateRequest(f"q{i}", ids, sp, session_id=sid, resume_ids=resume))
            if sid:
                history[sid] = ids
        elif op < 0.45:
            engine.abort(f"q{rng.randrange(0, i + 1)}")
        elif op < 0.5:
            engine.close_session(rng.choice(["s1", "s2"]))
        for _ in range(rng.randrange(0, 4)):
            engine.step()
            engine.check_integrity()
