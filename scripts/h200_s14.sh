#!/usr/bin/env bash
# Session 14's device calls (written 2026-12-03 before the first; 1800 device-seconds; one warm nvidia-h200, each
# call issued within 30 s of the last). C30 (moe_decode_triton.ROUTER_W_BEFORE_WAIT) is ON in the tree they run; if
# its GPU tests fail in call 1, it is turned off again before call 4. The vLLM bundle goes in four pieces (sha256
# 22e9232e...40f6), one a call; .whl (deltaserve's xgrammar pins) rides with piece 1 into /tmp/ds_site.
#   1  carry .vllm_chunk .whl  the GPU tests of C29 / C30 and the served paths (linear, router, MoE decode, the
#                              engine's PDL token test, structured outputs, runtime compiles), verbose, capped at
#                              300 s; then the decode step on the 35B-A3B, model / routerlate / nogemv at B = 1, 2,
#                              4, 8 (C30 and C29 against their absence, one process), and the 13-batch table of
#                              `model` on both shapes                                                   (~450 s)
#   2  carry .vllm_chunk2      the rest of the GPU suite (attention, GDN, graphs, norms, MoE, sampler...)  (~200 s)
#   3  carry .vllm_chunk3      the piece alone                                                           (~5 s)
#   4  carry .vllm_chunk4      SHA256 set: h200_core2 on the 35B-A3B shape at c1/8/32/64                 (~420 s)
#   5  (warm)                  h200_core2 on the 27B shape at c1/8/32/64                                 (~570 s)
# As run: call 1 (38891d5, 374 s): 149 passed, test_constraints_through_decode_graphs_async_equals_sync FAILED (its
# text lost: the capped pytest was cut before its summary), test_runtime_compiles[dense] cut; decode step 35B-A3B
# model / routerlate / nogemv B = 1 2.55 / 2.52 / 2.63, B = 2 3.17 / 3.29 / 3.25, B = 4 4.35 / 4.38 / 4.35, B = 8 equal;
# the 13-batch table, no cliffs. The machine went back before call 2 (a cut reply), so the pieces start again:
#   6  carry .vllm_chunk .whl  the failed test again, its text in full, then with the one-row GEMV off (in one
#                              process: is C29 what moved it?); test_runtime_compiles; test_cuda_graphs (~150 s)
#   then 2 (the piece alone: call 2's pytest skipped with SKIP_PYTEST=1), 3, 4, 5 as above
# As run: 6 (138 s): the failure was the host's missing pydantic (xgrammar 0.2.9 needs it; the vLLM bundle brings
# it), with and without the GEMV; graphs / runtime compiles 19 passed. 2, 3: the pieces. 4 (CALL_BUDGET_S=460): the
# deltaserve arm only (the deadline skipped vLLM); the vLLM arm by --resume in the next call (h200_grid.sh directly).
# Then 2 again with /tmp/vllm_site on PYTHONPATH (the rest of the suite: 103 passed, 5 skipped), the structured test
# (1 passed), and decode_step C30 on / off in four process orders. Call 5 (the 27B grid) did not run: 230 s were
# left, too few to start it. Every command and figure: benchmarks/results/h200-session14-20261203.txt.
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=585] [RECORD_DATE=20261203-s14] bash scripts/h200_s14.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1..5}
SESSION=s14
BUNDLE_CALLS="1 2 3 4"
source scripts/h200_call.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/ds_site:/tmp/vllm_site  # the bundle last: pydantic for xgrammar (call 8)
BATCHES=1,2,4,8,16,24,32,48,64,96,128,192,256
# call 1's test files: the kernels C29 / C30 changed and the served paths through them; call 2 runs the rest
FIRST="tests/kernels/test_linear.py tests/kernels/test_moe_align_router.py tests/kernels/test_moe_decode.py
  tests/engine/test_gpu_async.py tests/engine/test_structured_engine.py tests/engine/test_runtime_compiles.py"
case $CALL in
  1)
    timeout 150 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models --only q35-35b-a3b,q35-27b \
      > "$W/dummies.log" 2>&1 &
    mark "pytest -m gpu: C29 / C30 kernels and the served paths (verbose, capped at 300 s)"
    # shellcheck disable=SC2086
    budget=$((SECONDS + 310)) gpu_pytest pytest-gpu-first $FIRST
    wait
    mark "decode step, 35B-A3B: model / routerlate / nogemv at B = 1, 2, 4, 8"
    decode_step decode-step-c30-35b-a3b --shapes 35b-a3b --variants model,routerlate,nogemv --batches 1,2,4,8
    mark "decode step, both shapes: model at 13 batch sizes"
    decode_step decode-step --shapes 35b-a3b,27b --variants model --batches $BATCHES
    ;;
  2)
    [ -n "${SKIP_PYTEST:-}" ] && { mark "bundle piece 2"; exit 0; }
    mark "pytest -m gpu: the rest of the GPU suite (verbose)"
    ignores=()
    for f in $FIRST; do ignores+=(--ignore="$f"); done
    gpu_pytest pytest-gpu-rest tests --ignore=tests/api --ignore=tests/bench "${ignores[@]}"
    ;;
  3) mark "bundle piece 3" ;;
  6)
    timeout 150 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models --only q35-35b-a3b,q35-27b \
      > "$W/dummies.log" 2>&1 &  # for the grids of calls 4 and 5
    t=tests/engine/test_structured_engine.py::test_constraints_through_decode_graphs_async_equals_sync
    mark "the failed structured test, as committed"
    timeout 120 python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -rA --tb=long "$t" > "$W/structured.log" 2>&1
    echo "rc $?: $(tail -1 "$W/structured.log")" | tee -a "$OUT/summary.txt"
    grep -E "^E " "$W/structured.log" | head -30 | tee -a "$OUT/summary.txt"
    mark "the same with the one-row GEMV off (linear_triton.USE_GEMV = False, same process)"
    timeout 120 python3 -c "import sys, pytest, deltaserve.kernels.linear_triton as lt; lt.USE_GEMV = False; \
sys.exit(pytest.main(['-m', 'gpu', '-p', 'no:cacheprovider', '-o', 'addopts=', '-rA', '--tb=short', '$t']))" \
      > "$W/structured-nogemv.log" 2>&1
    echo "rc $?: $(tail -1 "$W/structured-nogemv.log")" | tee -a "$OUT/summary.txt"
    grep -E "^E " "$W/structured-nogemv.log" | head -10 | tee -a "$OUT/summary.txt"
    mark "runtime compiles, graphs"
    budget=$((SECONDS + 130)) gpu_pytest pytest-gpu-graphs tests/engine/test_runtime_compiles.py \
      tests/kernels/test_cuda_graphs.py
    wait
    ;;
  4) mark "h200_core2, 35B-A3B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-35b-a3b-$day" --models q35-35b-a3b --concurrencies 1,8,32,64 ;;
  5) mark "h200_core2, 27B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-27b-$day" --models q35-27b --concurrencies 1,8,32,64 ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
