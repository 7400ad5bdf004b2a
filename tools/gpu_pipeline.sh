#!/usr/bin/env bash
# One device call for the pipeline (issue 45): greedy tokens and W7 output tok/s of one stage
# against two stages on the one GPU (two processes) and a GPU + CPU pipeline, through the engine
# (tools/bench_pipeline.py): with SMALL=1 first a small synthetic model carried in .device, then the 8B-shape
# Q4_K_M written here. Carry: .whl, .device. Results under $OUT.
#   W7_C="1 64 256" W7_LAYOUTS="cuda:0 cuda:0,cuda:0 cuda:0,cpu" bash tools/gpu_pipeline.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SKIFF_CACHE_DIR=/tmp/skiff-cache
# default tiles: a load's tile timing would add minutes to each layout's start (8B: ~200 s tuned)
export SKIFF_QMATMUL_TUNE=${SKIFF_QMATMUL_TUNE:-0}
source tools/gpu_cache.sh; cache_restore
{ date -u; echo "commit ${SKIFF_COMMIT:-unknown}"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  nproc; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
BIG=/tmp/l3-q4_k_m.gguf
(python3 -m tools.llama3_shape $BIG --type q4_k_m > "$OUT/model.txt" 2>&1 &)
LAYOUTS=${W7_LAYOUTS:-cuda:0 cuda:0,cuda:0 cuda:0,cpu}
if [ "${SMALL:-0}" = 1 ]; then  # the small synthetic model first (SMALL=1)
  small=$(ls .device/models/synthetic/llama-L4-*Q4_K_M.gguf | head -1)
  timeout ${SMALL_S:-150} python3 -m tools.bench_pipeline "$small" --layouts $LAYOUTS \
    --memory ${W7_MEMORY:-cuda:0,cuda:0=20,12} --concurrency 1 16 --gen 16 --check 24 2>&1 \
    | tee "$OUT/small.log" | grep '^{' | tee "$OUT/small.jsonl"
fi
for _ in $(seq 1 300); do grep -q "wrote\|GB" "$OUT/model.txt" 2>/dev/null && break; sleep 1; done
cat "$OUT/model.txt"
timeout ${BIG_S:-540} python3 -m tools.bench_pipeline $BIG --layouts $LAYOUTS \
  --concurrency ${W7_C:-1 64 256} ${W7_SPLIT:+--split $W7_SPLIT} \
  --memory ${W7_MEMORY:-cuda:0,cuda:0=20,12} 2>&1 | tee "$OUT/w7.log" \
  | grep '^{' | tee "$OUT/w7.jsonl"
cache_save
