#!/usr/bin/env bash
# One device call for the quantized matmuls (issue: quantized kernels): native kernel tests, model
# tests on CUDA, W1 through the engine for random 8B-shape Q4_K_M / Q6_K / Q8_0 files, a tile
# sweep, and llama-bench on the same files (llama.cpp built in the background meanwhile).
# Carry: .whl, .llama (stripped llama.cpp source), .device (synthetic test models).
# Stages are bounded by timeouts so that one call fits the 10-minute limit; logs land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SKIFF_CACHE_DIR=/tmp/skiff-cache
source tools/gpu_cache.sh; cache_restore  # compiled kernels of earlier calls (.tcache)
export SKIFF_MODELS_DIR=$PWD/.device/models SKIFF_TEST_TIMES=$OUT/test-times.txt
BUILD=/tmp/llama-build
STAGES=${STAGES:-"tests w1 sweep llama"}  # also: attn, kv, chunks, step, tune (TUNE_ARGS), w6
TYPES=${W1_TYPES:-"q4_k_m q6_k q8_0"}
case " $STAGES " in *" llama "*)  # built meanwhile (niced: in (ab) it starved the tests stage)
  [ -x $BUILD/bin/llama-bench ] || setsid nice -n 19 bash tools/build_llama_cpp.sh .llama/llama.cpp-src.tar.gz \
    $BUILD > /tmp/llama-build.log 2>&1 < /dev/null & ;;
esac
{ date -u; echo "commit ${SKIFF_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
models() { for t in $TYPES; do
  [ -f /tmp/l3-$t.gguf ] || python3 -m tools.llama3_shape /tmp/l3-$t.gguf --type $t; done; }
case " $STAGES " in *" tests "*)
  # pytest-xdist (in the image) over TEST_WORKERS processes (0: one), since compiling every
  # parametrization's kernels, not the GPU, bounds this stage (one process ran out of time in (af)).
  # The whole log comes back (the failures' tracebacks with it); the reply shows its end.
  SKIFF_QMATMUL_TUNE=0 timeout ${TESTS_S:-300} python3 -m pytest -q -rs -p no:cacheprovider \
    -p no:benchmark -m "" --durations=8 --tb=short \
    -n ${TEST_WORKERS:-12} \
    ${TEST_K:+-k "$TEST_K"} ${TEST_FILES:-tests/test_gpu_model.py tests/test_kernel_packed_act.py \
    tests/test_kernel_packed_gemv.py tests/test_kernel_packed_int8.py tests/test_dense_copies.py \
    tests/test_kernel_packed_dequant.py \
    tests/test_kernel_packed_matmul.py tests/test_quant_linear.py tests/test_qmatmul_tuning.py \
    tests/test_sampling.py tests/test_dequant.py} 2>&1 | tee "$OUT/pytest-kernels.log" | tail -30 ;;
esac
case " $STAGES " in *" attn "*)  # batch 1-8 decode attention by split count (graph-replayed)
  timeout ${ATTN_S:-90} python3 -m tools.bench_attention ${ATTN_ARGS:---splits 1 2 4 8 16} 2>&1 \
    | tee "$OUT/attn-splits.txt" ;;
esac
case " $STAGES " in *" kv "*)  # W6's decode attention at 1k-32k: bf16 against FP8 KV
  for dt in bf16 fp8 fp8-head; do
    timeout ${KV_S:-90} python3 -m tools.bench_attention --dtype $dt 2>&1 | tee "$OUT/w6-$dt.txt"
  done ;;
esac
case " $STAGES " in *" chunks "*)  # W3's chunk steps by split count and prefill tiles
  timeout ${CHUNKS_S:-200} python3 -m tools.bench_attention --chunks 2>&1 \
    | tee "$OUT/attn-chunks.txt" ;;
esac
case " $STAGES " in *" step "*)  # where a batch-1 decode step's time goes
  # (the load and graph captures under the profiler take most of it: 100 s printed nothing in (aq))
  # with --timeline the trace is kept (step-*.json.gz)
  models 2>&1
  for t in ${STEP_TYPES:-$TYPES}; do
    timeout ${STEP_S:-240} python3 -m tools.profile_step /tmp/l3-$t.gguf \
      --concurrency 1 --steps 50 --rows ${STEP_ROWS:-25} \
      --trace "$OUT/step-$t.json.gz" ${STEP_ARGS:-} 2>&1 \
      | grep -v "^USDT\|Warning\|warn" | tee "$OUT/profile-step-$t.txt"
  done ;;
esac
case " $STAGES " in *" w1 "*)
  models 2>&1
  timeout ${W1_S:-420} python3 -m tools.bench_w1 $(for t in $TYPES; do echo /tmp/l3-$t.gguf; done) \
    2>&1 | tee "$OUT/w1-skiff.jsonl" ;;
esac
case " $STAGES " in *" w6 "*)  # W6: decode at 32k context, bf16 / FP8 per-token / FP8 per-head KV
  models 2>&1
  t=${TYPES%% *}
  for kv in "bfloat16 token" "fp8 token" "fp8 head"; do
    set -- $kv
    timeout ${W6_S:-150} python3 -m tools.bench_w1 /tmp/l3-$t.gguf --prompt 32000 --gen 64 --runs 2 \
      --kv-dtype $1 --kv-scales $2 2>&1 | grep '^{' | tee -a "$OUT/w6.jsonl"
  done ;;
esac
case " $STAGES " in *" tune "*)  # batch-1 rows configs timed in the engine's decode steps
  models 2>&1
  for t in $TYPES; do
    timeout ${TUNE_S:-240} python3 -m tools.tune_decode /tmp/l3-$t.gguf --json "$OUT/tune-$t.json" ${TUNE_ARGS:-} \
      2>&1 | grep -v "^USDT\|Warning\|warn" | tee "$OUT/tune-$t.txt"
  done ;;
esac
case " $STAGES " in *" llama "*)  # (at most 8 files come back from $OUT)
  models > /dev/null 2>&1
  for _ in $(seq 1 300); do [ -x $BUILD/bin/llama-bench ] && break; sleep 1; done
  tail -3 /tmp/llama-build.log
  for t in $TYPES; do
    timeout 90 $BUILD/bin/llama-bench -m /tmp/l3-$t.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o jsonl \
      2>/dev/null | tee -a "$OUT/w1-llama.jsonl"
  done ;;
esac
python3 -m tools.w1_table "$OUT/w1-skiff.jsonl" "$OUT/w1-llama.jsonl" 2>/dev/null  # the reply shows it
cache_save
exit 0
