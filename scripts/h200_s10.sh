#!/usr/bin/env bash
# Session 10's device calls (rewritten 2026-12-03 at the session's start from session 9's plan; 1800 device-seconds),
# one warm nvidia-h200, each issued within 30 s of the last. Calls 1-3 carry the three vLLM bundle pieces; call 3
# needs SHA256 (this session's rebuild: 22e9232ea065d0cd550683b02f713d8e185504eaa8c0e2b0a96b45c3ac9c40f6) and carries
# .whl. The grid comes first this session (the 35B-A3B shape has not run one since session 7); the B = 1 work of this
# session runs afterwards on a fresh machine (call 5, no bundle).
#   1  carry .vllm_chunk        pytest -m gpu on the alignment / graph / MoE decode tests (67c1254 and 4f4756b have
#                               not run on the H200), then the decode-step table, both shapes, 13 batch sizes: the
#                               "before" of this session                                              (~300 s)
#   2  carry .vllm_chunk2       the mixed-step profile, 35B-A3B, 2048@0 / 2048@32 / 8x1024@0               (~90 s)
#   3  carry .vllm_chunk3 .whl  h200_core2 on the 35B-A3B shape at c1/8/32/64 (not run since session 7)      (~540 s)
#   4  (fresh machine, no piece) C21: pytest -m gpu on the graph / MoE decode tests and the PDL on/off token test,
#                               then the decode step with and without PDL, both shapes, 9 batch sizes  (~330 s)
#   5  (fresh machine, carry .baseline = 4cee267's deltaserve/ without tiny/trained) C21b: the graph tests of conv /
#                               MoE and the PDL token test, then the decode step: after (model) against the before
#                               tree in one run, both shapes; nopdl / pdlgrouped on the 35B-A3B shape      (~300 s)
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=570] [RECORD_DATE=20261203-s10] bash scripts/h200_s10.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1..5}
SESSION=s10
BUNDLE_CALLS="1 2 3"
source scripts/h200_call.sh
export PYTHONPATH=$PWD
case $CALL in
  1)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1 &
    mark "pytest -m gpu: alignment, graphs, MoE decode"
    timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels/test_moe_align_router.py \
      tests/kernels/test_cuda_graphs.py tests/kernels/test_moe_decode.py > "$W/pytest-gpu-kernels.log" 2>&1
    echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu-kernels.log")" | tee -a "$OUT/summary.txt"
    grep -E "^FAILED|^ERROR" "$W/pytest-gpu-kernels.log" | head -20 | tee -a "$OUT/summary.txt"
    wait
    mark "decode step, both shapes, 13 batch sizes"
    timeout $((budget - 10 - SECONDS)) python3 benchmarks/decode_step.py --models /tmp/ds_models --variants model \
      --label before --out "$W/decode-step.json" > "$W/decode-step.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -6 "$W/decode-step.log" | tee -a "$OUT/summary.txt"
    ;;
  2)
    [ -d /tmp/ds_models ] || timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1
    mark "mixed-step profile, 35B-A3B"
    timeout $((budget - 10 - SECONDS)) python3 benchmarks/mixed_step.py --models /tmp/ds_models \
      --shapes 35b-a3b --cases 2048@0,2048@32,8x1024@0 --reps 5 --out "$W/mixed-step.json" > "$W/mixed-step.log" 2>&1
    echo "mixed_step rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^  |FAILED|case," "$W/mixed-step.log" | tee -a "$OUT/summary.txt"
    ;;
  3) mark "h200_core2, 35B-A3B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-35b-a3b-$day" --models q35-35b-a3b --concurrencies 1,8,32,64 ;;
  4)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1 &
    mark "pytest -m gpu: graphs, MoE decode, PDL on / off"
    timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels/test_cuda_graphs.py \
      tests/kernels/test_moe_decode.py tests/engine/test_gpu_async.py > "$W/pytest-gpu-pdl.log" 2>&1
    echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu-pdl.log")" | tee -a "$OUT/summary.txt"
    grep -E "^FAILED|^ERROR" "$W/pytest-gpu-pdl.log" | head -20 | tee -a "$OUT/summary.txt"
    wait
    mark "decode step, both shapes, PDL on (model) and off (nopdl)"
    timeout $((budget - 10 - SECONDS)) python3 benchmarks/decode_step.py --models /tmp/ds_models --variants model,nopdl \
      --batches 1,2,4,8,16,32,64,128,256 --label after --out "$W/decode-step-pdl.json" > "$W/decode-step-pdl.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -8 "$W/decode-step-pdl.log" | tee -a "$OUT/summary.txt"
    ;;
  5)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1 &
    mark "pytest -m gpu: graphs (conv, MoE), PDL on / off"
    timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels/test_cuda_graphs.py \
      tests/engine/test_gpu_async.py -k "conv or moe or pdl" > "$W/pytest-gpu-pdl2.log" 2>&1
    echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu-pdl2.log")" | tee -a "$OUT/summary.txt"
    grep -E "^FAILED|^ERROR" "$W/pytest-gpu-pdl2.log" | head -20 | tee -a "$OUT/summary.txt"
    wait
    mark "decode step, before (4cee267) and after, both shapes"
    timeout $((budget - 60 - SECONDS)) python3 benchmarks/decode_step.py --models /tmp/ds_models --variants model \
      --baseline .baseline --batches 1,2,4,8,16,32,64,128,256 --label after --out "$W/decode-step-ab.json" \
      > "$W/decode-step-ab.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -8 "$W/decode-step-ab.log" | tee -a "$OUT/summary.txt"
    mark "decode step, 35B-A3B, nopdl / pdlgrouped"
    timeout $((budget - 5 - SECONDS)) python3 benchmarks/decode_step.py --models /tmp/ds_models --shapes 35b-a3b \
      --variants nopdl,pdlgrouped --batches 1,8,32,64,128 --label after --out "$W/decode-step-pdlvar.json" \
      > "$W/decode-step-pdlvar.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -6 "$W/decode-step-pdlvar.log" | tee -a "$OUT/summary.txt"
    ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
