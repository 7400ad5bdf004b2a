#!/usr/bin/env bash
# The end-to-end service tests (real gateway + two workers, openai SDK) with the workers on the
# GPU. SmolLM2 (98 MB) arrives in two earlier calls as parts under /tmp/parts (64 MiB per call).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SKIFF_CACHE_DIR=/tmp/skiff-cache
mkdir -p /tmp/models
cat /tmp/parts/smolpart.00 /tmp/parts/smolpart.01 > /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
export SKIFF_SMOLLM2=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf SKIFF_TEST_DEVICE=cuda:0
python3 -m pytest -q -rs -p no:cacheprovider tests/test_services_e2e.py 2>&1 \
  | tee "$OUT/pytest-services-gpu.log"
