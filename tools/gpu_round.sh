#!/usr/bin/env bash
# One device call for this round's GPU-path changes: the new gpu-marked tests (KV block copies,
# pipeline stages replaying graphs) with the model's GPU tests, the KV tier copy bandwidth, and
# W7 (one stage against two stages on the one GPU, 8B-shape Q4_K_M written here).
# Carry: .whl, .device (and .tcache when there is one). Results under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SKIFF_CACHE_DIR=/tmp/skiff-cache \
  SKIFF_MODELS_DIR=$PWD/.device/models SKIFF_QMATMUL_TUNE=0
source tools/gpu_cache.sh; cache_restore
{ date -u; echo "commit ${SKIFF_COMMIT:-unknown}"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
} 2>&1 | tee "$OUT/env.txt"
BIG=/tmp/l3-q4_k_m.gguf
(python3 -m tools.llama3_shape $BIG --type q4_k_m > "$OUT/model.txt" 2>&1 &)
timeout ${TESTS_S:-200} python3 -m pytest -m gpu -q -rs -p no:cacheprovider -p no:benchmark \
  --tb=short -n ${TEST_WORKERS:-6} ${TEST_FILES:-tests/test_kv_block_copies.py \
  tests/test_pipeline_engine.py tests/test_gpu_model.py} 2>&1 | tail -30 | tee "$OUT/pytest.log"
timeout 90 python3 -m tools.bench_tiers --copy-bench --device cuda --copy-blocks 1024 2>&1 \
  | tail -3 | tee "$OUT/copy.txt"
for _ in $(seq 1 300); do grep -q "wrote\|GB" "$OUT/model.txt" 2>/dev/null && break; sleep 1; done
cat "$OUT/model.txt"
timeout ${W7_S:-300} python3 -m tools.bench_pipeline $BIG --layouts ${W7_LAYOUTS:-cuda:0 cuda:0,cuda:0} \
  --concurrency ${W7_C:-1 64 256} --memory cuda:0,cuda:0=20,12 2>&1 | tee "$OUT/w7.log" \
  | grep '^{' | tee "$OUT/w7.jsonl"
cache_save
