#!/usr/bin/env bash
# ncu counters of the packed GEMV (M = 1) on Llama-3-8B shapes, one report per shape under $OUT.
# Run after the wheels are installed (PYTHONPATH set), e.g. from tools/gpu_suite.sh's environment.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${PROFILE_SHAPES:-"Q4_K:4096:4096 Q4_K:28672:4096"}
for s in $SHAPES; do
  IFS=: read -r t n k <<< "$s"
  timeout 120 ncu --clock-control none -k regex:_gemv --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section LaunchStats --section Occupancy --section SchedulerStats \
    python3 -m tools.profile_gemv --type "$t" --n "$n" --k "$k" ${PROFILE_CONFIG:+--config "$PROFILE_CONFIG"} \
    2>&1 | grep -v "^==PROF==" >> "$OUT/ncu-gemv.txt"
done
for s in $SHAPES; do  # plain timings without the profiler
  IFS=: read -r t n k <<< "$s"
  python3 -m tools.profile_gemv --type "$t" --n "$n" --k "$k" 2>&1 | tail -1 >> "$OUT/gemv-times.txt"
done
