#!/usr/bin/env bash
# One device call for structured output's cost (issue: W2 at C=64 with a quarter of the requests
# under a JSON schema, throughput within 5 % of all-unconstrained, same call): first the mask
# tests (tests/test_grammar_masks.py, its CUDA ones included, and tests/test_structured_engine.py
# on the CPU), then `skiff serve` of the 8B-shape Q4_K_M file (written here) on cuda:0 with
# gpu_bench.sh's W2 flags, and W2 C=64 unconstrained and with --constrained 4, alternating, ROUNDS
# rounds (default 2), each run with its own prompts (--seed: no prefix-cache hits between runs).
# Each JSON line has the run's grammar counters from /metrics and the mask time per masked step.
# Carry: .whl (with jsonschema, referencing, rpds-py and jsonschema-specifications for the
# tests), and .tcache when there is one. Results under $OUT: results.jsonl, summary.txt, logs.
#   bash tools/gpu_structured.sh
# Knobs: ROUNDS (2), W2_C (64), K (4), SERVE_ARGS (more serve flags, later ones win), TESTS_S
# (150; 0: no tests), RUN_S (40 s a run), PORT (8080), MODEL_PATH (another GGUF, not written
# here), DEVICES (cuda:0), BENCH_ARGS (more bench_serving flags, e.g. --vocab for another model).
# Tried here on the CPU (the pip line aside): MODEL_PATH=SmolLM2 DEVICES=cpu W2_C=4 K=2
# SERVE_ARGS="--max-model-len 512 --spec off" BENCH_ARGS="--vocab 49152 --prompt-len 32 --gen 16"
# Fits a 600 s call: every stage has a timeout within TOTAL_S (560 s) of the start.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-560}
stage() { echo "[$SECONDS s] $*" | tee -a "$OUT/stages.txt"; }
left() { echo $((TOTAL_S - SECONDS - $1)); }  # seconds left, keeping $1 in reserve

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SKIFF_CACHE_DIR=/tmp/skiff-cache
source tools/gpu_cache.sh; cache_restore
{ date -u; echo "commit ${SKIFF_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"

MODEL=${MODEL_PATH:-/tmp/l3-q4_k_m.gguf}
WRITER=
if [ ! -f "$MODEL" ]; then
  stage "writing $MODEL in the background"
  timeout 240 python3 -m tools.llama3_shape "$MODEL" --type q4_k_m > "$OUT/model.txt" 2>&1 &
  WRITER=$!
fi

if [ "${TESTS_S:-150}" -gt 0 ]; then
  stage "tests"
  SKIFF_TEST_TIMES=$OUT/test-times.txt timeout ${TESTS_S:-150} python3 -m pytest -q -rs \
    -p no:cacheprovider -m "" tests/test_grammar_masks.py tests/test_structured_engine.py \
    > "$OUT/pytest.log" 2>&1
  stage "tests: exit $? ($(tail -1 "$OUT/pytest.log"))"
fi

[ -n "$WRITER" ] && { wait $WRITER; stage "model: $(cat "$OUT/model.txt")"; }
[ -f "$MODEL" ] || { stage "no model"; cache_save; exit 1; }

ROUNDS=${ROUNDS:-2}
RUN_S=${RUN_S:-40}  # one bench_serving process: warm-up and one W2 run (C=64: ~5-10 s)
PORT=${PORT:-8080}
URL=http://127.0.0.1:$PORT
stage "skiff serve"
setsid python3 -m shared.cli serve "$MODEL" --devices ${DEVICES:-cuda:0} --port $PORT \
  --max-model-len 34000 --max-batch-tokens ${BATCH_TOKENS:-512} ${SERVE_ARGS:-} \
  > "$OUT/skiff.log" 2>&1 &
SERVER=$!
up=0
for _ in $(seq 1 "$(left $((2 * ROUNDS * RUN_S + 20)))"); do
  curl -sf $URL/health >/dev/null 2>&1 && { up=1; break; }
  kill -0 $SERVER 2>/dev/null || break
  sleep 1
done
if [ $up = 1 ]; then
  stage "ready"
  R="$OUT/results.jsonl"; : > "$R"
  seed=0
  for round in $(seq 1 "$ROUNDS"); do
    for k in 0 ${K:-4}; do
      seed=$((seed + 1))
      label=$([ "$k" = 0 ] && echo "free r$round" || echo "constrained-$k r$round")
      t=$(left 15); [ "$t" -gt "$RUN_S" ] && t=$RUN_S
      [ "$t" -lt 10 ] && { stage "out of time before $label"; break 2; }
      timeout "$t" python3 -m tools.bench_serving $URL w2 --concurrency ${W2_C:-64} \
        --constrained "$k" --seed $seed --label "$label" ${BENCH_ARGS:-} 2>&1 \
        | tee -a "$OUT/w2.log" \
        | grep '^{' >> "$R"
      stage "$label: $(tail -1 "$R" | cut -c1-160)"
    done
  done
  curl -s $URL/metrics | grep -E "^skiff_(grammar|generation_tokens|requests)" > "$OUT/metrics.txt"
else
  stage "not ready"; tail -40 "$OUT/skiff.log"
fi
kill -INT $SERVER 2>/dev/null
for _ in $(seq 1 10); do kill -0 $SERVER 2>/dev/null || break; sleep 1; done
pkill -9 -P $SERVER 2>/dev/null; kill -9 $SERVER 2>/dev/null
stage "server stopped"
grep -E "ready|Error|error|stall" "$OUT/skiff.log" | head -20
[ -s "$OUT/results.jsonl" ] && python3 - "$OUT/results.jsonl" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
free = {r["label"].split()[-1]: r for r in runs if r["label"].startswith("free")}
for r in runs:
    base = free.get(r["label"].split()[-1])
    ratio = r["output_tok_s"] / base["output_tok_s"] if base and base["output_tok_s"] else 0
    masks = ", ".join(f"{k} {r[k]}" for k in r if k.endswith("_per_step"))
    print(f"{r['label']:>18}: {r['output_tok_s']:9.1f} tok/s ({ratio:.3f} of free), TTFT p50 "
          f"{r['ttft_p50_s']} s, TPOT p50 {r['tpot_p50_ms']} ms, constrained {r['constrained']} "
          f"(JSON {r['constrained_json']}), errors {r['n_errors']}; per masked step: {masks}")
EOF
cache_save
stage "done"
