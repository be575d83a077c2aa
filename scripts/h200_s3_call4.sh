#!/usr/bin/env bash
# Session of 2026-12-01 17:16, call 4 of 4 (warm machine, vLLM unpacked in call 3): issue 16's structured-output
# grid on the 35B-A3B dummy shape at concurrency 1, 8, 32: first deltaserve on the same workload unconstrained
# (benchmarks/grids/h200_structured_free.toml: the constraint's own cost, and, being core2's text workload at
# c1/8/32, issue 18's TP=1 serving non-regression against the core2 record of d3cd0eb), then the JSON-schema grid,
# deltaserve then vLLM 0.26.0 with xgrammar (benchmarks/grids/h200_structured.toml), no drift re-run (the budget).
# usage: OUT=... DELTASERVE_GIT_COMMIT=... bash scripts/h200_s3_call4.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
mkdir -p "$OUT"
echo "=== free (${SECONDS}s)" | tee "$OUT/summary.txt"
GRID=benchmarks/grids/h200_structured_free.toml GRID_TIMEOUT_S=${FREE_TIMEOUT_S:-130} GRID_STORE=/tmp/ds_grid_free \
  bash benchmarks/h200_grid.sh --record-name h200_structured_free-35b-a3b-20261201 --no-drift > "$OUT/grid-free.log" 2>&1
echo "free rc $? (${SECONDS}s)" | tee -a "$OUT/summary.txt"
tail -12 "$OUT/grid-free.log" | tee -a "$OUT/summary.txt"
mkdir -p "$OUT/free" && mv "$OUT"/h200_structured_free*.json "$OUT/raw.tgz" "$OUT/free/" 2>/dev/null
echo "=== structured (${SECONDS}s)" | tee -a "$OUT/summary.txt"
GRID=benchmarks/grids/h200_structured.toml GRID_TIMEOUT_S=$((578 - SECONDS)) GRID_STORE=/tmp/ds_grid_so \
  bash benchmarks/h200_grid.sh --record-name h200_structured-35b-a3b-20261201 --no-drift \
  --deadline-s $((565 - SECONDS)) > "$OUT/grid-so.log" 2>&1
echo "structured rc $? (${SECONDS}s)" | tee -a "$OUT/summary.txt"
tail -20 "$OUT/grid-so.log" | tee -a "$OUT/summary.txt"
