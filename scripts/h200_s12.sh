#!/usr/bin/env bash
# Session 12's device calls (written 2026-12-03 before any of them). The session found 210 device-seconds left of the
# 30 minutes its work is allowed (session 11's time counted in: this session retried stop 29, whose CI failed), and
# the first call was refused ("too little device-machine time is left to start another machine"): NOTHING here has
# run yet. The calls stand for the next session, in this order, one warm nvidia-h200:
#   1  C25 / C26 / C27 / C28 (all off or untuned, KERNEL_NOTES section 15): their GPU tests (bitwise at the served
#      shape, the one- and two-warp gate/up against four warps); the decode step, 35B-A3B, model / packedroute /
#      sharedearly / prefetchdown / all three at B = 1-16 (decides ROUTE_PACKED_KEYS, SHARED_GATE_UP_BEFORE_WAIT and
#      PREFETCH_DOWN_L2);
#      then tune_moe on buckets 1, 2, 4, 8 with C26's candidates and the decode step with that table against the
#      committed one (decides whether the table takes a one-warp gate/up)                             (~330 s)
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [CALL_BUDGET_S=570] bash scripts/h200_s12.sh 1
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1}
SESSION=s12
BUNDLE_CALLS=""
source scripts/h200_call.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
case $CALL in
  1)
    timeout 60 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models --only q35-35b-a3b > "$W/dummies.log" 2>&1
    mark "pytest: C25 / C26 / C27 / C28 at the served shape"
    timeout 150 python3 -m pytest -p no:cacheprovider -rA tests/kernels/test_moe_decode.py tests/kernels/test_pdl.py \
      -k "packed or switches or prefetch or shared_programs or one_and_two_warps or pdl" > "$W/pytest-c25-28.log" 2>&1
    echo "pytest: $(tail -1 "$W/pytest-c25-28.log")" | tee -a "$OUT/summary.txt"
    grep -E "^(FAILED|ERROR)" "$W/pytest-c25-28.log" | head -30 | tee -a "$OUT/summary.txt"
    mark "decode step, 35B-A3B: model, packedroute, sharedearly, prefetchdown, all three at B = 1-16"
    decode_step decode-step-c25-c28-35b --shapes 35b-a3b \
      --variants model,packedroute,sharedearly,prefetchdown,packedroute+prefetchdown+sharedearly --batches 1,2,4,8,16
    mark "tune_moe 35B-A3B buckets 1,2,4,8 with C26's one- and two-warp gate/up candidates"
    timeout 200 python3 benchmarks/tune_moe.py --shape 35b-a3b --buckets 1,2,4,8 --budget-s 150 \
      --out "$OUT/moe-table-c26.json" > "$W/tune-c26.log" 2>&1
    echo "tune rc $?" | tee -a "$OUT/summary.txt"
    grep -E "bucket" "$W/tune-c26.log" | tail -8 | tee -a "$OUT/summary.txt"
    [ -f "$OUT/moe-table-c26.json" ] && decode_step decode-step-c26-table-35b --shapes 35b-a3b --variants model \
      --batches 1,2,4,8 --moe-table "$OUT/moe-table-c26.json"
    ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
