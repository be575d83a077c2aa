#!/usr/bin/env bash
# Session 13's device calls, one warm nvidia-h200 (each written before it ran):
#   1  ran as `scripts/h200_s12.sh 1` (session 12's prepared call, unchanged; commit ff0292b): C25 / C27 / C28 off
#      for good (each slower), C26's retune (benchmarks/results/*-s13.json, KERNEL_NOTES section 16)
#   2  C29, the register GEMV (linear_triton.USE_GEMV), and the table with C26's buckets 1, 2, 4: GPU tests (the GEMV
#      at the served shapes, the MoE decode cases with the table, the engine's PDL token test), then the decode step
#      on both shapes, model / linearout+gemv / linear+gemv at B = 1, 2, 4                                (~360 s)
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [CALL_BUDGET_S=570] bash scripts/h200_s13.sh 2
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 2}
SESSION=s13
BUNDLE_CALLS=""
source scripts/h200_call.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
case $CALL in
  2)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models --only q35-35b-a3b,q35-27b \
      > "$W/dummies.log" 2>&1
    mark "pytest: C29 GEMV, MoE decode with the table, engine PDL tokens"
    timeout 170 python3 -m pytest -p no:cacheprovider -rA -m gpu tests/kernels/test_linear.py \
      tests/kernels/test_moe_decode.py tests/kernels/test_moe_configs.py tests/engine/test_gpu_async.py \
      -k "gemv or linear_triton or served_shape or one_and_two_warps or table or pdl" > "$W/pytest-c29.log" 2>&1
    echo "pytest: $(tail -1 "$W/pytest-c29.log")" | tee -a "$OUT/summary.txt"
    grep -E "^(FAILED|ERROR)" "$W/pytest-c29.log" | head -30 | tee -a "$OUT/summary.txt"
    mark "decode step, both shapes: model, linearout+gemv, linear+gemv at B = 1, 2, 4"
    decode_step decode-step-c29-gemv --shapes 35b-a3b,27b --variants model,linearout+gemv,linear+gemv \
      --batches 1,2,4
    ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
