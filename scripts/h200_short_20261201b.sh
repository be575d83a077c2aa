#!/usr/bin/env bash
# One short H200 call (this session had 6 device-minutes): in priority order, each part time-limited, results
# under $OUT as they come.
#   1. scripts/h200_tp1_check.sh (issue 18: TP=1 GPU tests + 35B-A3B decode timings vs the committed records)
#   2. the structured-output GPU test (issue 16: constrained rows through the decode graphs, async == sync)
#   3. the bf16 token gate against transformers on the trained dense / moe / next checkpoints, fused preamble
#      (issue 13's transformers half; the vLLM half needs the bundle and a later session)
# usage: OUT=... bash scripts/h200_short_20261201b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT/tp1" "$OUT/gates"
echo "commit ${DELTASERVE_GIT_COMMIT:-unknown} date $(date -u +%FT%TZ)" | tee "$OUT/provenance.txt"
OUT="$OUT/tp1" bash scripts/h200_tp1_check.sh 2>&1 | tee "$OUT/tp1/console.txt"
echo "=== structured GPU test (${SECONDS}s)"
timeout 45 python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider -q tests/engine/test_structured_engine.py \
  > "$OUT/pytest_gpu_structured.log" 2>&1
echo "structured rc $?"; tail -3 "$OUT/pytest_gpu_structured.log"
echo "=== bf16 gates vs transformers (${SECONDS}s)"
OUT="$OUT/gates" REFERENCES=transformers PREAMBLES=1 timeout 100 bash benchmarks/oracle/gate_runs.sh dense moe next
echo "done ${SECONDS}s"
