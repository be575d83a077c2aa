#!/usr/bin/env bash
# Session 13's device calls, one warm nvidia-h200 (each written before it ran):
#   1  ran as `scripts/h200_s12.sh 1` (session 12's prepared call, unchanged; commit ff0292b): C25 / C27 / C28 off
#      for good (each slower), C26's retune (benchmarks/results/*-s13.json, KERNEL_NOTES section 16)
#   2  C29, the register GEMV (linear_triton.USE_GEMV), and the table with C26's buckets 1, 2, 4: GPU tests (the GEMV
#      at the served shapes, the MoE decode cases with the table, the engine's PDL token test), then the decode step
#      on both shapes, model / linearout+gemv / linear+gemv at B = 1, 2, 4                                (~360 s)
#      As run (ac34add): GPU tests passed; 35B-A3B model / linearout+gemv / linear+gemv B = 1 2.66 / 2.64 / 2.53,
#      B = 2 3.21 / 3.21 / 3.21, B = 4 4.42 / 4.37 / 4.60; 27B B = 1 14.27 / 14.16 / 13.27, B = 2 14.49 / 14.53 /
#      16.93, B = 4 14.80 / 15.20 / 22.05: the GEMV wins at one row and loses at 2-4, so it is served at one row,
#      for every projection (the model calls kernels.linear)
#      Call 2's pytest was cut by its 170 s timeout after 42 passes (no failure, no summary: which 42 is unknown)
#   3  carry .whl: C29 as served: the bf16 / fp32 token gates on the tiny dense / moe / next models, the decode
#      step on both shapes, model / nogemv / gemv8k / gemv32k / routerearly (C30) at B = 1 (one process a shape) and
#      model / nogemv / routerearly at
#      B = 2, 4, 8 with gemv4rows (the GEMV at 2-4 rows, its tile shrunk per row), then the GPU suite
#      (pytest -m gpu -v, tests/api and tests/bench aside) in what is left                               (~570 s)
#      As run (9cb6213): the tiny models' gates took 483 s (transformers' torch fallbacks; moe bf16 cut at 90 s;
#      bf16 STRICT 0/32 on these untrained models as on 2026-11-29, the same first divergences; fp32 32/32 all three);
#      35B-A3B B = 1 model / nogemv / gemv8k / gemv32k / routerearly 2.48 / 2.67 / 2.49 / 2.66 / 2.41; 27B 13.06 /
#      13.96 / 13.16 / 13.09 / 13.04; the B = 2-8 run and the GPU suite got no time (cut by the call's budget)
#   4  (249 device-seconds left) the decode step at B = 2, 4 with C30 and without C29, then the GPU tests of C29 / C30
#      and the engine's PDL token test                                                                    (~170 s)
#      Refused (no device time left): it stands for the next session, with 5
#   5  carry .whl: the whole GPU suite (pytest -m gpu -v, tests/api and tests/bench aside) on C29 as served; it did
#      not run this session                                                                              (~500 s)
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [CALL_BUDGET_S=570] bash scripts/h200_s13.sh 2|3|4|5
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 2 or 3}
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
  3)
    export PYTHONPATH=$PWD:/tmp/ds_site
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models --only q35-35b-a3b,q35-27b \
      > "$W/dummies.log" 2>&1
    mark "token gates, tiny dense / moe / next, bf16 and fp32 on cuda"
    for v in dense moe next; do
      python3 -m deltaserve.cli make-tiny "/tmp/tiny/$v" --variant "$v" > /dev/null 2>&1
      for dt in bfloat16 float32; do
        timeout 90 python3 -m deltaserve.cli gate tokens --model "/tmp/tiny/$v" --dtype $dt --device cuda \
          > "$W/gate-$v-$dt.log" 2>&1
        echo "gate $v $dt rc $?: $(grep -E "STRICT" "$W/gate-$v-$dt.log" | head -1)" | tee -a "$OUT/summary.txt"
      done
    done
    mark "decode step: model / nogemv / gemv8k / gemv32k at B = 1, model / nogemv / gemv4rows at B = 2, 4, 8"
    for shape in 35b-a3b 27b; do
      decode_step "decode-step-c29-$shape-b1" --shapes $shape --variants model,nogemv,gemv8k,gemv32k,routerearly \
        --batches 1
    done
    decode_step decode-step-c29-b2-8 --shapes 35b-a3b,27b --variants model,nogemv,gemv4rows,routerearly \
      --batches 2,4,8
    mark "pytest -m gpu (C29 served), verbose so that a cut run still names what passed"
    timeout $((budget - 15 - SECONDS)) python3 -m pytest -v -m gpu -o addopts="" -p no:cacheprovider \
      --import-mode=importlib tests --ignore=tests/api --ignore=tests/bench > "$W/pytest-gpu-c29.log" 2>&1
    echo "pytest rc $?: $(grep -cE " PASSED" "$W/pytest-gpu-c29.log") passed, $(grep -E "passed|failed" \
      "$W/pytest-gpu-c29.log" | tail -1)" | tee -a "$OUT/summary.txt"
    grep -E "(FAILED|ERROR)" "$W/pytest-gpu-c29.log" | head -30 | tee -a "$OUT/summary.txt"
    ;;
  4)
    timeout 60 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models --only q35-35b-a3b > "$W/dummies.log" 2>&1
    mark "decode step, 35B-A3B: model / routerearly / nogemv at B = 2, 4"
    decode_step decode-step-c30-b2-4 --shapes 35b-a3b --variants model,routerearly,nogemv --batches 2,4
    mark "pytest -m gpu: C29 / C30 kernels, router graphs, the engine's PDL token test (verbose)"
    gpu_pytest pytest-gpu-c30 tests/kernels/test_linear.py tests/kernels/test_moe_align_router.py \
      tests/engine/test_gpu_async.py -k "gemv or captures or pdl"
    ;;
  5)
    export PYTHONPATH=$PWD:/tmp/ds_site
    mark "pytest -m gpu, the whole GPU suite on C29 as served (verbose)"
    gpu_pytest pytest-gpu-all tests --ignore=tests/api --ignore=tests/bench
    ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
