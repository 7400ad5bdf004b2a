#!/usr/bin/env bash
# Serving benchmarks on the GPU machine, Skiff and llama-server in the same run (BENCHMARKS.md).
#   bash tools/gpu_bench.sh prepare   # background llama.cpp build, 8B-shape model, GPU tests, smoke
#   bash tools/gpu_bench.sh run       # W2 (C=16/64/256) and W3 for Skiff, then for llama-server
# Carry: .whl (wheels), .llama (stripped llama.cpp source), .device (synthetic test models).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SKIFF_CACHE_DIR=/tmp/skiff-cache
source tools/gpu_cache.sh; cache_restore  # compiled kernels of earlier calls (.tcache)
MODEL=/tmp/l3-8b-f16.gguf
BUILD=/tmp/llama-build
BATCH_TOKENS=${BATCH_TOKENS:-512}
MODEL=${MODEL_PATH:-$MODEL}  # e.g. a Q4_K_M file from tools/llama3_shape.py --type q4_k_m
# SERVE_ARGS=--overlap: overlapped engine steps; SERVE_ARGS_B: a second configuration (A/B);
# LLAMA_BENCH=1: llama-bench (W1) on the same file at the end; PROFILE=1 / PROFILE_C=1: the
# engine's step profile (tools/profile_step) at 64 / 1 sequences first; ONLY_B=1: configuration
# B alone (no A, no llama.cpp: for a follow-up call beside an earlier one's llama.cpp numbers);
# NO_LLAMA=1: A (and B) without llama.cpp; NO_W2=1: configuration B runs W3 alone; TEST_FILES (TEST_K, TESTS_S): GPU tests first

wait_health() {  # url timeout_s
  for _ in $(seq 1 "$2"); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}

skiff_up() {  # port max_model_len
  setsid python3 -m shared.cli serve "$MODEL" --devices cuda:0 --port "$1" \
    --max-model-len "$2" --max-batch-tokens "$BATCH_TOKENS" ${SERVE_ARGS:-} \
    > "$OUT/skiff-$1.log" 2>&1 &
  wait_health "http://127.0.0.1:$1" 600
}

skiff_down() { pkill -INT -f "shared.cli serve" ; sleep 5; pkill -9 -f "services\.(gateway|decode)"; }

if [ "${1:-}" = prepare ]; then
  if [ ! -x $BUILD/bin/llama-server ]; then
    setsid nice -n 19 bash tools/build_llama_cpp.sh .llama/llama.cpp-src.tar.gz $BUILD \
      > /tmp/llama-build.log 2>&1 < /dev/null &
  fi
  [ -f $MODEL ] || python3 -m tools.llama3_shape $MODEL --type ${MODEL_TYPE:-f16} 2>&1 | tee "$OUT/model.txt"
  SKIFF_MODELS_DIR=$PWD/.device/models python3 -m pytest -q -rs -s -p no:cacheprovider -m gpu \
    tests/test_gpu_model.py 2>&1 | tee "$OUT/pytest-gpu-model.log"
  skiff_up 8080 34000 || { tail -50 "$OUT/skiff-8080.log"; exit 1; }
  python3 -m tools.bench_serving http://127.0.0.1:8080 w2 --concurrency 16 --label skiff-smoke \
    2>&1 | tee "$OUT/smoke.jsonl"
  skiff_down
  grep -E "ready|error|Error" "$OUT/skiff-8080.log" | head -20
  tail -3 /tmp/llama-build.log
  cache_save
  exit 0
fi

# run
if [ -n "${TEST_FILES:-}" ]; then  # GPU tests first (synthetic models: carry .device); TEST_K: -k
  SKIFF_MODELS_DIR=$PWD/.device/models SKIFF_TEST_TIMES=$OUT/test-times.txt \
    timeout ${TESTS_S:-200} python3 -m pytest -q -rs -p no:cacheprovider -m "" \
    ${TEST_K:+-k "$TEST_K"} $TEST_FILES 2>&1 | tail -30 | tee "$OUT/pytest.log"
fi
[ -f $MODEL ] || python3 -m tools.llama3_shape $MODEL --type ${MODEL_TYPE:-f16}
if [ -z "${ONLY_B:-}${NO_LLAMA:-}" ] && [ ! -x $BUILD/bin/llama-server ] && [ ! -f /tmp/llama-build.log ]; then
  setsid nice -n 19 bash tools/build_llama_cpp.sh .llama/llama.cpp-src.tar.gz $BUILD \
    > /tmp/llama-build.log 2>&1 < /dev/null &
fi
R="$OUT/results.jsonl"; : > "$R"
for c in ${PROFILE:+64} ${PROFILE_C:+1}; do  # where a decode step's time goes (engine, no HTTP)
  timeout ${PROFILE_S:-120} python3 -m tools.profile_step "$MODEL" --concurrency $c --rows 25 \
    2>&1 | grep -v "^USDT\|Warning\|warn" | tee "$OUT/profile-step-c$c.txt"
done
if [ -z "${ONLY_B:-}" ]; then
  skiff_up 8080 34000 || { tail -50 "$OUT/skiff-8080.log"; exit 1; }
  python3 -m tools.bench_serving http://127.0.0.1:8080 w2 --label skiff 2>&1 | tee -a "$R"
  python3 -m tools.bench_serving http://127.0.0.1:8080 w3 --label skiff 2>&1 | tee -a "$R"
  skiff_down
fi
if [ -n "${SERVE_ARGS_B:-}" ]; then  # a second Skiff configuration (A/B): W2 at C=64 and W3
  SERVE_ARGS=$SERVE_ARGS_B skiff_up 8081 34000 || tail -50 "$OUT/skiff-8081.log"
  [ -z "${NO_W2:-}" ] && python3 -m tools.bench_serving http://127.0.0.1:8081 w2 --concurrency 64 \
    --label "skiff $SERVE_ARGS_B" 2>&1 | tee -a "$R"
  python3 -m tools.bench_serving http://127.0.0.1:8081 w3 --label "skiff $SERVE_ARGS_B" 2>&1 \
    | tee -a "$R"
  skiff_down
fi
[ -n "${ONLY_B:-}${NO_LLAMA:-}" ] && { cache_save; exit 0; }
for _ in $(seq 1 400); do [ -x $BUILD/bin/llama-server ] && break; sleep 1; done
[ -x $BUILD/bin/llama-server ] || { tail -30 /tmp/llama-build.log; exit 1; }
setsid $BUILD/bin/llama-server -m $MODEL -ngl 99 -fa on -np 256 -c 262144 --port 8090 \
  > "$OUT/llama-w2.log" 2>&1 &
wait_health http://127.0.0.1:8090 300 && \
  python3 -m tools.bench_serving http://127.0.0.1:8090 w2 --label llama.cpp 2>&1 | tee -a "$R"
pkill -f llama-server; sleep 3
setsid $BUILD/bin/llama-server -m $MODEL -ngl 99 -fa on -np 8 -c 272000 --port 8091 \
  > "$OUT/llama-w3.log" 2>&1 &
wait_health http://127.0.0.1:8091 300 && \
  python3 -m tools.bench_serving http://127.0.0.1:8091 w3 --label llama.cpp 2>&1 | tee -a "$R"
pkill -f llama-server; sleep 2
if [ -n "${LLAMA_BENCH:-}" ]; then  # W1 beside the serving runs: llama-bench on the same file
  timeout 90 $BUILD/bin/llama-bench -m $MODEL -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o jsonl \
    2>/dev/null | tee -a "$R"
fi
cache_save
