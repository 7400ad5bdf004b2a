#!/usr/bin/env bash
# ncu counters of the packed GEMVs (M = 1) on Llama-3-8B shapes, all reports in $OUT/ncu-gemv.txt.
# Run after the wheels are installed (PYTHONPATH set), e.g. from tools/gpu_qmatmul.sh's environment.
#   PROFILE_RUNS="Q4_K 28672 4096 {\"BLOCK_N\": 128, \"INT8\": 1, \"SPLIT_K\": 4};Q4_K 4096 4096"
# one run per ';'-separated entry: type, N, K and an optional tile config (JSON; default tiles
# without); PROFILE_KERNEL: the kernel-name regex (default: every GEMV, float and int8);
# PROFILE_SOURCE=1 adds the sampled stall locations (SourceCounters); PROFILE_ARGS are passed
# to every profile_gemv run (--rows: the row-interleaved planes and their GEMV).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUNS=${PROFILE_RUNS:-"Q4_K 4096 4096;Q4_K 28672 4096"}
KERNEL=${PROFILE_KERNEL:-"regex:gemv"}
IFS=';' read -ra ENTRIES <<< "$RUNS"
for e in "${ENTRIES[@]}"; do
  read -r t n k cfg <<< "$e"
  echo "=== $t ${n}x$k ${cfg:-default}" >> "$OUT/ncu-gemv.txt"
  timeout 120 ncu --clock-control none -k "$KERNEL" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section LaunchStats --section Occupancy --section SchedulerStats \
    ${PROFILE_SOURCE:+--section SourceCounters} \
    python3 -m tools.profile_gemv --type "$t" --n "$n" --k "$k" ${cfg:+--config "$cfg"} \
    ${PROFILE_ARGS:-} 2>&1 | grep -v "^==PROF==" >> "$OUT/ncu-gemv.txt"
  python3 -m tools.profile_gemv --type "$t" --n "$n" --k "$k" ${cfg:+--config "$cfg"} \
    ${PROFILE_ARGS:-} 2>&1 \
    | tail -1 >> "$OUT/gemv-times.txt"  # plain timing without the profiler
done
