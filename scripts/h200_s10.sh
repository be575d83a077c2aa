#!/usr/bin/env bash
# The next session's device calls (planned 2026-12-02 after session 9; 1800 device-seconds), one warm nvidia-h200,
# each issued within 30 s of the last (session 9 lost 362 s to a machine taken back mid-call and a refused start,
# then its warm machine between calls 1 and 5). Calls 1-3 carry the three vLLM bundle pieces; call 3 needs SHA256
# (session 9's rebuild: c62076ceff0a46e37484c40bc5eb8c0a62f51bac675debe2f35522bd3dc5f876; a checkout without the
# pieces rebuilds them with /work/shared/tools/vllm-oracle/build_bundle.sh: check the new sum) and carries .whl.
#   1  carry .vllm_chunk        pytest -m gpu tests/kernels (everything; the alignment refactor of 67c1254 has not
#                               run on the H200)                                                          (~190 s)
#   2  carry .vllm_chunk2       the decode step on the 35B-A3B shape at B = 64 ... 256 (the chunked alignment
#                               now serves 129-512 tokens, 129-256 timed here; before = decode-step-h200-20261202-s8.json)      (~150 s)
#   3  carry .vllm_chunk3 .whl  h200_core2 on the 35B-A3B shape at c1/8/32/64 (not run since session 7)      (~490 s)
#   4                           the mixed-step profile, 27B and 35B-A3B, 2048@0 / 2048@32 / 8x1024@0       (~120 s)
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=570] [RECORD_DATE=20261203-s10] bash scripts/h200_s10.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1..4}
SESSION=s10
BUNDLE_CALLS="1 2 3"
source scripts/h200_call.sh
export PYTHONPATH=$PWD
case $CALL in
  1)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1 &
    mark "pytest -m gpu tests/kernels"
    timeout $((budget - 20 - SECONDS)) python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels \
      > "$W/pytest-gpu-kernels.log" 2>&1
    echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu-kernels.log")" | tee -a "$OUT/summary.txt"
    grep -E "^FAILED|^ERROR" "$W/pytest-gpu-kernels.log" | head -20 | tee -a "$OUT/summary.txt"
    wait
    ;;
  2)
    [ -d /tmp/ds_models ] || timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1
    mark "decode step, 35B-A3B, B = 64-256"
    timeout $((budget - 10 - SECONDS)) python3 benchmarks/decode_step.py --models /tmp/ds_models --shapes 35b-a3b \
      --variants model --batches 64,96,128,192,256 --out "$W/decode-step.json" > "$W/decode-step.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -10 "$W/decode-step.log" | tee -a "$OUT/summary.txt"
    ;;
  3) mark "h200_core2, 35B-A3B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-35b-a3b-$day" --models q35-35b-a3b --concurrencies 1,8,32,64 ;;
  4)
    mark "mixed-step profile (27B, 35B-A3B)"
    timeout $((budget - 10 - SECONDS)) python3 benchmarks/mixed_step.py --models /tmp/ds_models \
      --shapes 27b,35b-a3b --cases 2048@0,2048@32,8x1024@0 --reps 5 --out "$W/mixed-step.json" > "$W/mixed-step.log" 2>&1
    echo "mixed_step rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^  |FAILED|case," "$W/mixed-step.log" | tee -a "$OUT/summary.txt"
    ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
