#!/usr/bin/env bash
# One device call that compares this tree with older commits on the same GPU, same call:
#   W3 and W2 through HTTP (8B-shape Q4_K_M) for this tree and for OLD_SERVE (a tree of the
#   commit before a scheduling change), and W1 for this tree and OLD_W1 (a tree of the commit
#   whose figures BENCHMARKS.md records), plus the gpu-marked model tests first.
# Trees are carried as ignored folders made here with `git archive C | tar -x -C .ab/NAME`.
#   OLD_SERVE=.ab/serve OLD_W1=.ab/w1 W1_TYPES="q4_k_m" bash tools/gpu_ab.sh
# SPLIT=1 adds this tree with a prefill and a decode worker on cuda:0 (label split); GREEDY=1
# records each served layout's greedy answers (tools/greedy_answers) and compares them.
# Carry: .whl, .ab (and .tcache when there is one). Results under $OUT (results.jsonl, logs).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
HERE=$PWD
export PYTHONUNBUFFERED=1 SKIFF_CACHE_DIR=/tmp/skiff-cache
source tools/gpu_cache.sh; cache_restore
W1_TYPES=${W1_TYPES:-q4_k_m}
MODEL=/tmp/l3-q4_k_m.gguf
R="$OUT/results.jsonl"; touch "$R"
{ date -u; echo "commit ${SKIFF_COMMIT:-unknown}"; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
for t in $W1_TYPES; do  # the files, written in the background while the tests run
  [ -f /tmp/l3-$t.gguf ] || (PYTHONPATH=/tmp/site:$HERE python3 -m tools.llama3_shape \
    /tmp/l3-$t.gguf --type $t > "$OUT/model-$t.txt" 2>&1 &)
done
if [ "${TESTS_S:-0}" -gt 0 ]; then
  SKIFF_QMATMUL_TUNE=0 PYTHONPATH=/tmp/site:$HERE timeout "$TESTS_S" python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
    -p no:benchmark --tb=short -n 8 ${TEST_FILES:-tests/test_gpu_model.py} 2>&1 | tail -25 \
    | tee "$OUT/pytest-gpu.log"
fi
for _ in $(seq 1 300); do
  n=0; for t in $W1_TYPES; do grep -q "wrote\|GB" "$OUT/model-$t.txt" 2>/dev/null && n=$((n+1)); done
  [ $n -eq $(echo $W1_TYPES | wc -w) ] && break; sleep 1
done
cat "$OUT"/model-*.txt

wait_health() { for _ in $(seq 1 "$2"); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }

serve_runs() {  # tree label port [placement flags]
  local where=${4:---devices cuda:0}
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD setsid python3 -m shared.cli serve $MODEL $where \
    --port "$3" --max-model-len 34000 ${SERVE_ARGS:-} > "$OUT/skiff-$2.log" 2>&1 &)
  if wait_health "http://127.0.0.1:$3" 400; then
    [ -n "${GREEDY:-}" ] && PYTHONPATH=/tmp/site:$HERE python3 -m tools.greedy_answers \
      http://127.0.0.1:$3 "$OUT/greedy-$2.jsonl" 2>&1 | tail -3
    PYTHONPATH=/tmp/site:$HERE python3 -m tools.bench_serving http://127.0.0.1:$3 w3 --label "$2" \
      2>&1 | tee -a "$R"
    [ -z "${NO_W2:-}" ] && PYTHONPATH=/tmp/site:$HERE python3 -m tools.bench_serving \
      http://127.0.0.1:$3 w2 --concurrency ${W2_C:-16 64 256} --label "$2" 2>&1 | tee -a "$R"
  else
    tail -30 "$OUT/skiff-$2.log"
  fi
  curl -s "http://127.0.0.1:$3/metrics" | grep -E "skiff_kv_tier_events|skiff_request_moves" \
    > "$OUT/metrics-$2.txt"
  pkill -INT -f "shared.cli serve"; sleep 4
  pkill -9 -f "services\.(gateway|decode|prefill|kvcache|spec)"
  sleep 1
}

w1_runs() {  # tree label
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD timeout ${W1_S:-200} python3 -m tools.bench_w1 \
    $(for t in $W1_TYPES; do echo /tmp/l3-$t.gguf; done) 2>&1 | grep '^{' \
    | sed "s/^{/{\"label\": \"$2\", /" | tee -a "$R")
}

[ -z "${NO_SERVE:-}" ] && serve_runs "$HERE" new 8080
[ -n "${SPLIT:-}" ] && serve_runs "$HERE" split 8082 \
  "--prefill-devices cuda:0 --decode-devices cuda:0 --kv-disk-gb 0 --kv-blocks ${SPLIT_BLOCKS:-6000}"
[ -n "${OLD_SERVE:-}" ] && serve_runs "$HERE/$OLD_SERVE" old 8081
if [ -n "${GREEDY:-}" ] && [ -f "$OUT/greedy-split.jsonl" ]; then
  python3 -m tools.greedy_answers --compare "$OUT/greedy-new.jsonl" "$OUT/greedy-split.jsonl" \
    | tee -a "$R"
fi
if [ -z "${NO_W1:-}" ]; then
  w1_runs "$HERE" w1-new
  [ -n "${OLD_W1:-}" ] && w1_runs "$HERE/$OLD_W1" w1-old
  w1_runs "$HERE" w1-new-again
fi
cache_save
echo "== results"; cat "$R"
