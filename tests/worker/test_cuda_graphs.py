"""Decode passes replayed from CUDA graphs (`worker.cuda_graphs`).

On a GPU: the engine with graphs (the default there) against the same engine without, on
greedy output, at page sizes 1 and 16, with batches that pad and batches above the largest
graph. On CPU: the same padded buffers and in-place decode plan, run without recording a graph,
through the Triton kernel in its interpreter (`triton_kit`).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from engine_kit import assert_idle_clean, greedy, make, prompt
from hypothesis import given
from hypothesis import strategies as st
from triton_kit import needs_triton, run_interpreted

from worker.cuda_graphs import graph_batch_sizes
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest


@given(st.integers(1, 1024))
def test_every_batch_pads_to_a_captured_size_with_few_padding_rows(max_batch):
    sizes = graph_batch_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_batch
    for b in range(1, max_batch + 1):
        size = next(s for s in sizes if s >= b)
        assert size - b < (8 if b <= 64 else 16 if b <= 128 else 32)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    return [prompt(n, seed + i) for i, n in enumerate(lengths)]


def greedy_run(engine, prompts, tag: str, max_tokens: int = 10) -> list[list[int]]:
    reqs = [GenerateRequest(f"{tag}{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    out = run_to_completion(engine, reqs, after_step=lambda e, _: e.check_integrity())
    return [out[r.request_id].token_ids for r in reqs]


CPU_CHECK = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from engine_kit import assert_idle_clean, make, prompt
    from test_cuda_graphs import greedy_run, prompts_of
    from mem_cache.kv_pool import ReqToTokenPool
    from worker.cuda_graphs import ChunkGraphs, DecodeGraphs

    page_size, max_batch = int(sys.argv[2]), int(sys.argv[3])
    # 7 prompts: decode batches of 7 and fewer as requests finish at different lengths
    prompts = prompts_of([5, 17, 3, 30, 9, 2, 12], seed=40)
    # run alone: two over a cached prompt (chunks of 20 and 50 tokens, padded to 32 and 64),
    # one past the largest chunk graph (64 tokens), run eagerly
    longer = [prompts[3] + prompt(20, 90), prompts[1] + prompt(50, 91), prompt(70, 92)]
    ref = greedy_run(make(attention="torch", page_size=page_size), prompts + longer, "r")
    engine = make(attention="triton", page_size=page_size, max_running=max_batch + 2)
    # the slot table with a copy kept current from its log of writes, as on a GPU
    host = engine.memory.rows
    rows = engine.memory.rows = ReqToTokenPool(host.max_requests, host.max_context, mirror=True)
    engine.runner.use_rows(rows)
    graphs = engine.runner.graphs = DecodeGraphs(
        engine.model, engine.kv_pool, rows.device_table, max_batch, capture=False)
    chunks = engine.runner.chunk_graphs = ChunkGraphs(
        engine.model, engine.kv_pool, rows.device_table, 64, capture=False)
    first = greedy_run(engine, prompts, "a")
    again = greedy_run(engine, prompts, "b")  # over the prefixes it cached
    alone = [greedy_run(engine, [p], f"c{i}")[0] for i, p in enumerate(prompts + longer)]
    assert_idle_clean(engine)
    same = first == ref[:7] and again == ref[:7] and alone == ref
    print(json.dumps({"same": same, "replays": graphs.replays, "chunks": chunks.replays}))
    """
)


@needs_triton
@pytest.mark.parametrize("page_size,max_batch", [(1, 8), (16, 4)])
def test_padded_decode_buffers_give_the_greedy_output_of_the_reference(page_size, max_batch):
    """The graphs' buffers and plan, run eagerly on CPU over a copy of the slot table kept
    current from its log of writes: batches padded up to 8 (or, above a largest graph of 4,
    run the plain way) give the torch reference's greedy tokens, also when run again over the
    prefixes the first run cached (padding rows wrote only the pad slot); so do prompts run
    alone through the chunk graphs' buffers, padded to 16, 32 and 64 tokens, with and without a
    cached prefix; and the engine ends idle and clean."""
    here = str(Path(__file__).parent)
    out = run_interpreted(CPU_CHECK, here, str(page_size), str(max_batch))
    result = json.loads(out.strip().splitlines()[-1])
    assert result["same"]
    assert result["replays"] > 0 and result["chunks"] > 0


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_gives_the_eager_greedy_output(page_size, dtype):
    prompts = prompts_of([5, 40, 17, 3, 300, 9, 2, 12, 66], seed=7)
    config = dict(device="cuda", attention="triton", page_size=page_size, dtype=dtype,
                  max_running=16)
    eager = make(cuda_graphs=False, **config)
    graphs = make(**config)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    want = greedy_run(eager, prompts, "e")
    assert greedy_run(graphs, prompts, "g") == want
    assert greedy_run(graphs, prompts, "h") == want  # again, over its cached prefixes
    assert graphs.runner.graphs.replays > 0
    assert_idle_clean(graphs)


@pytest.mark.gpu
@needs_cuda
def test_compiled_layers_are_captured_and_give_the_eager_greedy_output():
    """torch.compile's kernels inside the graphs: every graph size is built before any capture
    (a kernel built during one is refused by CUDA, which had left the compiled layers eager
    for good and the engine without graphs), and the output is the eager engine's."""
    prompts = prompts_of([5, 40, 17, 3, 300, 9, 2, 12, 66], seed=11)
    config = dict(device="cuda", attention="triton", dtype="float32", max_running=16)
    want = greedy_run(make(cuda_graphs=False, **config), prompts, "e")
    engine = make(compile=True, **config)
    assert engine.runner.graphs is not None
    assert all(fn.active for fn in engine.model.kernels)
    assert greedy_run(engine, prompts, "g") == want
    assert engine.runner.graphs.replays > 0 and all(fn.active for fn in engine.model.kernels)
    assert_idle_clean(engine)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunk_graphs_give_the_eager_greedy_output_of_prompts_alone(page_size, dtype):
    """Prompts that arrive alone: cold ones padded to 16-2048 tokens, ones over a cached prefix
    (chunks of 30 and 700 tokens), one past the largest graph (2100 tokens, chunked and eager);
    each pass the chunk graphs replayed gives the eager engine's tokens."""
    base = prompts_of([5, 40, 300, 1500, 2100], seed=21)
    prompts = [*base, base[1] + prompt(30, 5), base[2] + prompt(700, 6)]
    config = dict(device="cuda", attention="triton", page_size=page_size, dtype=dtype,
                  max_running=16, prefill_budget=2048)
    eager, graphs = make(cuda_graphs=False, **config), make(**config)
    assert graphs.runner.chunk_graphs.sizes[-1] == 2048
    for i, p in enumerate(prompts):
        want = greedy_run(eager, [p], f"e{i}")
        assert greedy_run(graphs, [p], f"g{i}") == want, i
    assert graphs.runner.chunk_graphs.replays >= 6
    assert_idle_clean(graphs)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_fall_back_to_eager_above_the_largest_graph():
    prompts = prompts_of([4] * 12, seed=3)
    config = dict(device="cuda", attention="triton", max_running=12)
    want = greedy_run(make(cuda_graphs=False, **config), prompts, "e")
    engine = make(**config)
    engine.runner.graphs.max_batch = 8  # decode batches of 9-12 take the eager path
    assert greedy_run(engine, prompts, "g") == want
    assert_idle_clean(engine)


def test_no_graphs_on_cpu_or_for_a_backend_without_a_device_plan():
    assert make().runner.graphs is None  # CPU
    if torch.cuda.is_available():
        assert make(device="cuda", attention="torch").runner.graphs is None
