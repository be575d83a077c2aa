#!/usr/bin/env bash
# Session 12's device call (written 2026-12-03 before it ran). The session found 210 device-seconds left of the
# 30 minutes its issue's work is allowed (sessions 10 and 11 spent the rest), so ONE call on one nvidia-h200, no
# bundle piece, the most valuable figure first:
#   1  C25 (gate/up's top-k on packed int64 keys, af085c4, off): the decode step, 35B-A3B, model / packedroute at
#      B = 1-16 (decides moe_decode_triton.ROUTE_PACKED_KEYS), then its GPU tests (fp32 and bf16 at small shapes, bf16
#      at the served shape, bit for bit against the two-reduction top-k)                                  (~90 s)
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [CALL_BUDGET_S=150] bash scripts/h200_s12.sh 1
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1}
SESSION=s12
BUNDLE_CALLS=""
CALL_BUDGET_S=${CALL_BUDGET_S:-150}
source scripts/h200_call.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
decode_step() {  # name, then decode_step.py flags
  local name=$1
  shift
  timeout $((budget - 10 - SECONDS)) python3 benchmarks/decode_step.py --models /tmp/ds_models --label after \
    --out "$OUT/$name.json" "$@" > "$W/$name.log" 2>&1
  echo "decode_step $name rc $?" | tee -a "$OUT/summary.txt"
  grep -A8 "graph_ms by batch size" "$W/$name.log" | tee -a "$OUT/summary.txt"
}
case $CALL in
  1)
    timeout 60 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models --only q35-35b-a3b > "$W/dummies.log" 2>&1
    mark "decode step, 35B-A3B: model, packedroute at B = 1-16"
    decode_step decode-step-packedroute-35b --shapes 35b-a3b --variants model,packedroute --batches 1,2,4,8,16
    mark "pytest: C25's packed-key routing, fp32 and bf16, small and served shapes"
    timeout $((budget - 5 - SECONDS)) python3 -m pytest -p no:cacheprovider -rA tests/kernels/test_moe_decode.py \
      -k packed > "$W/pytest-packed.log" 2>&1
    echo "pytest: $(tail -1 "$W/pytest-packed.log")" | tee -a "$OUT/summary.txt"
    grep -E "^(PASSED|FAILED|ERROR)" "$W/pytest-packed.log" | head -30 | tee -a "$OUT/summary.txt"
    ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
