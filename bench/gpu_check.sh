#!/usr/bin/env bash
# The GPU checks in one device call (no Ray on that machine: the engine runs alone).
#   bash bench/gpu_check.sh [tests|prefill|bench|all]  (logs under $OUT, else /tmp/gpu_check)
# tests: the gpu-marked tests, then the engine tests on CUDA with the Triton backend.
# prefill: a Llama-3.2-1B-shaped model (bf16, random weights): TTFT at 2k and 8k tokens
#   uncached and 95% cached, and output tok/s at 32 concurrent against HF's static-batch
#   generate on the same GPU.
# bench: decode steps of the 1B shape at 1/8/64/256 requests: CUDA graphs with the layers
#   compiled (torch's and Python's profilers at 8 and 64), graphs alone, then eager.
# all: tests, prefill, bench in that order. BUDGET_S=N: no part starts past N seconds, and each
#   part's timeout is cut to what is left (a device call has a fixed limit).
# SHAPE=8b runs prefill and bench on the Llama-3.1-8B shape instead (~16 GB written first).
# Missing pure-Python packages (gguf) travel as wheels in .whl/ (the device tool's README).
set -u
what=${1:-all}
shape=${SHAPE:-1b}
out=${OUT:-/tmp/gpu_check}
end=$((SECONDS + ${BUDGET_S:-100000}))
mkdir -p "$out"
export PYTHONUNBUFFERED=1 RADIXRAY_CACHE=/tmp/radixray-models PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if ! python3 -c "import gguf" 2>/dev/null; then  # worker.models imports it; the image lacks it
  echo "gguf is missing: carry its wheel in .whl/ (carry=[\".whl\"]; the device README)" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
pytest="python3 -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -rfE"

# run SECONDS LOG CMD...: CMD under a timeout of SECONDS or what is left of the budget,
# its output appended to $out/LOG; the last lines shown
run() {
  local limit=$1 log=$2 left=$((end - SECONDS))
  shift 2
  if ((left < 15)); then
    echo "skipped (budget spent): $*" | tee -a "$out/$log"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== [$SECONDS s] $*" >>"$out/$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$out/$log" | tail -"${TAIL:-25}"
}

model=/tmp/llama-$shape
shape_model() { [[ -e $model/config.json ]] || python3 bench/llama_shapes.py "$shape" "$model"; }
bench="python3 bench/bench_engine.py --device cuda --threads 0 --dtype bfloat16"

if [[ $what == tests || $what == all ]]; then
  run 120 gpu_tests.log $pytest -m gpu tests/worker/test_attention_gpu.py \
    tests/worker/test_engine.py tests/mem_cache/test_radix_host_tier.py \
    tests/worker/test_cuda_graphs.py
  RADIXRAY_TEST_DEVICE=cuda RADIXRAY_TEST_ATTENTION=triton run 180 cuda_engine_tests.log \
    $pytest tests/worker/test_engine.py tests/worker/test_engine_host.py \
    tests/worker/test_scheduler.py tests/worker/test_sessions.py tests/worker/test_engine_hf.py
fi
if [[ $what == prefill || $what == all ]]; then
  shape_model
  run 240 prefill.log $bench --model "$model" --prefill-budget 8192 --runs 2 \
    --ttft-lengths 2048 8192 --concurrency 32
fi
if [[ $what == bench || $what == all ]]; then
  shape_model
  steps="--decode-steps 10 --prefill-budget 8192 --max-running 256 --concurrency 1 8 64 256"
  TAIL=80 run 150 bench.log $bench --model "$model" $steps --runs 1 --compile --profile 8 64
  for flags in "" --no-cuda-graphs; do
    run 90 bench.log $bench --model "$model" $steps --runs 1 $flags
  done
fi
