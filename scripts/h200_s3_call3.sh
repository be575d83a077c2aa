#!/usr/bin/env bash
# Session of 2026-12-01 17:16, call 3 of 4 (warm machine): store bundle piece 3 and unpack vLLM 0.26.0 into
# /tmp/vllm_site (sha256 checked), then issue 10's 27B grid: benchmarks/grids/h200_core2.toml on q35-27b at
# concurrency 1, 8, 32, deltaserve then vLLM (production configuration from the registry), then the drift re-run,
# both on their defaults. The record stays in /tmp/ds_grid; $OUT gets the record, raw.tgz, nvidia-smi.csv, summary.
# usage: OUT=... SHA256=<bundle sha256> DELTASERVE_GIT_COMMIT=... bash scripts/h200_s3_call3.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
: "${SHA256:?set SHA256 to the bundle sha256}"
echo "=== unpack (${SECONDS}s)" | tee "$OUT/summary.txt"
bash benchmarks/oracle/unpack.sh vllm 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
echo "=== grid 27b (${SECONDS}s)" | tee -a "$OUT/summary.txt"
GRID=benchmarks/grids/h200_core2.toml GRID_TIMEOUT_S=$((575 - SECONDS)) bash benchmarks/h200_grid.sh \
  --models q35-27b --concurrencies 1,8,32 --record-name h200_core2-27b-20261201 --deadline-s $((560 - SECONDS)) \
  > "$OUT/grid.log" 2>&1
echo "grid rc $? (${SECONDS}s)" | tee -a "$OUT/summary.txt"
tail -30 "$OUT/grid.log" | tee -a "$OUT/summary.txt"
