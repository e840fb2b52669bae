#!/usr/bin/env bash
# The GPU checks in one device call (no Ray on that machine: the engine runs alone).
#   bash bench/gpu_check.sh [tests|bench|prefill|all]  (logs under $OUT, else /tmp/gpu_check)
# tests: the gpu-marked tests, then the engine tests on CUDA with the Triton backend.
# bench: decode steps of the built-in `small` and a Llama-3.2-1B-shaped model (bf16), with
#   and without CUDA graphs, overlapped, and where a step's time goes (torch's profiler).
# prefill: the 1B shape's TTFT at 2k and 8k tokens uncached and 95% cached (prefill tok/s),
#   and output tok/s at 32 concurrent against HF's static-batch generate on the same GPU.
# SHAPE=8b runs bench and prefill on the Llama-3.1-8B shape instead (~16 GB written first).
# Missing pure-Python packages (gguf) travel as wheels in .whl/ (the device tool's README).
set -u
what=${1:-all}
shape=${SHAPE:-1b}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 RADIXRAY_CACHE=/tmp/radixray-models PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
pytest="python3 -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -rfE"
if [[ $what == tests || $what == all ]]; then
  timeout 120 $pytest -m gpu tests/worker/test_attention_gpu.py tests/worker/test_engine.py \
    tests/mem_cache/test_radix_host_tier.py tests/worker/test_cuda_graphs.py 2>&1 \
    | tee "$out/gpu_tests.log" | tail -25
  RADIXRAY_TEST_DEVICE=cuda RADIXRAY_TEST_ATTENTION=triton timeout 180 $pytest \
    tests/worker/test_engine.py tests/worker/test_overlap.py tests/worker/test_engine_host.py \
    tests/worker/test_scheduler.py tests/worker/test_sessions.py tests/worker/test_engine_hf.py \
    2>&1 | tee "$out/cuda_engine_tests.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  # decode steps with CUDA graphs (the default) and without, then the same under the profiler
  bench="python3 bench/bench_engine.py --device cuda --decode-steps 10 --threads 0"
  bench="$bench --prefill-budget 8192 --max-running 256 --concurrency 1 8 64 256"
  for graphs in "" --no-cuda-graphs; do
    timeout 90 $bench --runs 1 --model small $graphs 2>&1 | tee -a "$out/bench.log"
  done
  python3 bench/llama_shapes.py $shape /tmp/llama-$shape
  for flags in "--profile 8 64" "--overlap" "--no-cuda-graphs --profile 8 64"; do
    timeout 150 $bench --runs 2 --model /tmp/llama-$shape --dtype bfloat16 $flags \
      2>&1 | tee -a "$out/bench.log"
  done
fi
if [[ $what == prefill || $what == all ]]; then
  python3 bench/llama_shapes.py $shape /tmp/llama-$shape
  timeout 240 python3 bench/bench_engine.py --device cuda --threads 0 --model /tmp/llama-$shape \
    --dtype bfloat16 --prefill-budget 8192 --runs 2 --ttft-lengths 2048 8192 --concurrency 32 \
    2>&1 | tee -a "$out/prefill.log"
fi
