#!/usr/bin/env bash
# Session 11's device calls (written 2026-12-03 before the first of them; 1800 device-seconds, call 0 = session
# 10's call 5, run at this session's start from scripts/h200_s10.sh). One warm nvidia-h200, each call issued within
# 30 s of the last. The vLLM bundle goes in FOUR pieces this session (re-split from the same bytes, sha256
# 22e9232e...40f6): with session 10's records the tree is ~20 MiB and a 44 MiB piece beside it was refused as over
# the 64 MiB a call carries. Call 4 needs SHA256 and carries .whl.
#   1  carry .vllm_chunk        pytest -m gpu on C22 (the norm in the router's launch) and C23 (the GDN output
#                               norm in the decode core's launch): kernels, graphs, the PDL token test; then the
#                               decode step, 35B-A3B, model / block+gdnsplit (before both) / block (before C22) /
#                               gdnsplit (before C23) at 9 batch sizes, and a second process with the order
#                               reversed at B = 1-8 (does a variant's place in the process move it?) and
#                               mv (one-row F.linear calls as torch.mv: cuBLAS's matrix-vector path)  (~360 s)
#   2  carry .vllm_chunk2       the decode step, 27B, model / gdnsplit at 9 batch sizes                (~110 s)
#   3  carry .vllm_chunk3       the decode step, 27B, mv / model at B = 1, 2                           (~50 s)
#   4  carry .vllm_chunk4 .whl  h200_core2 on the 35B-A3B shape at c1/8/32/64 on this code            (~540 s)
# As run: calls 1-3; C22 and C23 measured no gain (C23 +15-22 % at B = 256) and were taken out, and call 1 showed
# a variant timed after another's profile ~0.25 ms slower at B = 1 (CUPTI stays attached after torch.profiler), so
# call 4 did not run the grid; two unscripted follow-ups on the warm machine timed C22 and mv one variant a process
# (their commands are in decode-step-c22-separate / decode-step-mv-separate-h200-20261203-s11.json).
#   5  (fresh machine, no piece) C24: the skinny GEMM's GPU tests with PDL (first W tile above the wait), then the
#                               decode step with every variant timed before any profile: model / linear / linearout
#                               at B = 1-16 on both shapes, and model alone at 9 batch sizes        (~420 s)
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=570] [RECORD_DATE=20261203-s11] bash scripts/h200_s11.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1..5}
SESSION=s11
BUNDLE_CALLS="1 2 3 4"
source scripts/h200_call.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
BATCHES=1,2,4,8,16,32,64,128,256
decode_step() {  # name, then decode_step.py flags
  local name=$1
  shift
  timeout $((budget - 10 - SECONDS)) python3 benchmarks/decode_step.py --models /tmp/ds_models --label after \
    --out "$W/$name.json" "$@" > "$W/$name.log" 2>&1
  echo "decode_step $name rc $?" | tee -a "$OUT/summary.txt"
  grep -A8 "graph_ms by batch size" "$W/$name.log" | tee -a "$OUT/summary.txt"
}
case $CALL in
  1)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1 &
    mark "pytest -m gpu: C22 / C23 kernels, graphs, PDL token test"
    timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels/test_moe_decode.py \
      tests/kernels/test_gdn.py tests/kernels/test_cuda_graphs.py tests/engine/test_gpu_async.py \
      -k "norm or served or graph_moe or graph_add_norm or graph_conv or graph_decode or pdl" > "$W/pytest-gpu-fuse.log" 2>&1
    echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu-fuse.log")" | tee -a "$OUT/summary.txt"
    grep -E "^FAILED|^ERROR" "$W/pytest-gpu-fuse.log" | head -20 | tee -a "$OUT/summary.txt"
    wait
    mark "decode step, 35B-A3B: model, block+gdnsplit, block, gdnsplit"
    decode_step decode-step-fuse-35b --shapes 35b-a3b --variants model,block+gdnsplit,block,gdnsplit --batches $BATCHES
    mark "decode step, 35B-A3B, order reversed: block+gdnsplit, model; mv (one-row F.linear as torch.mv)"
    decode_step decode-step-fuse-35b-rev --shapes 35b-a3b --variants block+gdnsplit,model,mv --batches 1,2,4,8
    ;;
  2)
    [ -d /tmp/ds_models ] || timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1
    mark "decode step, 27B: model, gdnsplit"
    decode_step decode-step-fuse-27b --shapes 27b --variants model,gdnsplit --batches $BATCHES
    ;;
  3)
    [ -d /tmp/ds_models ] || timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1
    mark "decode step, 27B: mv (one-row F.linear as torch.mv), model"
    decode_step decode-step-mv-27b --shapes 27b --variants mv,model --batches 1,2
    ;;
  4) mark "h200_core2, 35B-A3B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-35b-a3b-$day" --models q35-35b-a3b --concurrencies 1,8,32,64 ;;
  5)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1 &
    mark "pytest -m gpu: skinny GEMM with PDL, graphs"
    timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels/test_linear.py \
      tests/kernels/test_cuda_graphs.py -k "linear or skinny" > "$W/pytest-gpu-linear.log" 2>&1
    echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu-linear.log")" | tee -a "$OUT/summary.txt"
    grep -E "^FAILED|^ERROR" "$W/pytest-gpu-linear.log" | head -20 | tee -a "$OUT/summary.txt"
    wait
    mark "decode step, both shapes: model, linear, linearout at B = 1-16"
    decode_step decode-step-linear --variants model,linear,linearout --batches 1,2,4,8,16
    mark "decode step, both shapes: model at 9 batch sizes"
    decode_step decode-step --variants model --batches $BATCHES
    ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
