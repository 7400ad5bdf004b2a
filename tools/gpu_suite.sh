#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU test suite, write logs under $OUT.
# Carry: .whl (gguf, msgspec, pyzmq for Python 3.12) and .device (synthetic models quantized by
# llama.cpp on the CPU machine: .device/models/synthetic).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SKIFF_MODELS_DIR=$PWD/.device/models
source tools/gpu_cache.sh; cache_restore  # compiled kernels of earlier calls (.tcache)
export SKIFF_CACHE_DIR=/tmp/skiff-cache
export SKIFF_TEST_TIMES=$OUT/test-times.txt  # per-test seconds, kept even if a stage is cut off
# model tests on the default tiles (a load would time decode tiles; the tuner has its own tests)
export SKIFF_QMATMUL_TUNE=${SKIFF_QMATMUL_TUNE:-0}
M=.device/models
[ -f $M/SmolLM2-135M-Instruct.Q4_1.gguf ] && export SKIFF_SMOLLM2=$PWD/$M/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $M/gemma3-270m-q4_k_m.gguf ] && export SKIFF_GEMMA3=$PWD/$M/gemma3-270m-q4_k_m.gguf
{
  date -u; echo "commit ${SKIFF_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
# pytest-xdist (in the image) over TEST_WORKERS processes (0: one): compiling kernels, not the
# GPU, bounds these runs. The gpu-marked files each in one process (some start services).
W=${TEST_WORKERS:-12}
timeout ${GPU_TESTS_S:-300} python3 -m pytest -m gpu -q -rs -p no:cacheprovider -p no:benchmark \
  --tb=short -n $W --dist loadfile tests 2>&1 \
  | tee "$OUT/pytest-gpu.log"
rc=${PIPESTATUS[0]}
# The kernel and model tests natively at their CUDA sizes, the exhaustive tier (tests/tiers.py)
# with them: every case that is not gpu-marked (those ran above).
timeout ${KERNEL_TESTS_S:-360} python3 -m pytest -q -rs -p no:cacheprovider -p no:benchmark \
  -m "not gpu" --tb=short -n $W tests/test_kernel*.py tests/test_*_model.py \
  tests/test_quant_linear.py tests/test_qmatmul_tuning.py tests/test_dense_copies.py 2>&1 \
  | tee "$OUT/pytest-kernels.log"
krc=${PIPESTATUS[0]}; [ $rc -eq 0 ] && rc=$krc
if [ "${SKIFF_BENCH:-1}" = 1 ]; then
  python3 -m tools.bench_attention 2>&1 | tee "$OUT/bench-attention.txt"
  python3 -m tools.bench_fused 2>&1 | tee "$OUT/bench-fused.txt"
fi
# Decode speed through the engine on the largest carried synthetic model (informational).
m=$(ls -S .device/models/synthetic/*.gguf | head -1)
python3 -m shared.cli generate "$m" "x" --device cuda --max-tokens 64 2>&1 | tail -2 | tee "$OUT/cli.txt"
if [ -n "${SKIFF_SMOLLM2:-}" ]; then
  python3 -m shared.cli generate "$SKIFF_SMOLLM2" "What is the capital of France? Answer in one \
sentence, then explain why it matters." --chat --device cuda --max-tokens 96 2>&1 | tee -a "$OUT/cli.txt"
fi
cache_save
exit $rc
