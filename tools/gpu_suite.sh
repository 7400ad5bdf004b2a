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
export SKIFF_CACHE_DIR=/tmp/skiff-cache
{
  date -u; git rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -m gpu -q -s -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest-gpu.log"
rc=${PIPESTATUS[0]}
# Decode speed through the engine on the largest carried synthetic model (informational).
m=$(ls -S .device/models/synthetic/*.gguf | head -1)
python3 -m shared.cli generate "$m" "x" --device cuda --max-tokens 64 2>&1 | tail -2 | tee "$OUT/cli.txt"
exit $rc
