#!/usr/bin/env bash
# Session 16's device calls (2026-12-04; one warm nvidia-h200, each call issued within 30 s of the last). Session 15
# ran scripts/h200_s15.sh's calls 1 and 4 on 021ee1b, but its results never reached the repo (the session ended before
# they were committed), so this session runs them again on the same code, plus a fresh 27B mixed-step profile. The
# vLLM bundle goes in four pieces (this session's build; its sha256 is in the session record); .whl (xgrammar 0.2.9,
# apache-tvm-ffi 0.1.11) rides with piece 1 into /tmp/ds_site; /tmp/vllm_site goes last on PYTHONPATH once unpacked.
#   1  carry .vllm_chunk .whl  pytest -m gpu on the MoE decode kernels, PDL and the engine's PDL token test (<= 160 s);
#                              the decode step with decode_step's warm-up pass: 35B-A3B model / routerlate / nogemv at
#                              B = 1, 2, 4, then `model` on both shapes at 13 batch sizes; then the 27B mixed-step
#                              profile (2048 prefill tokens with 0 / 8 / 32 decodes, item 4)              (~300 s)
#   2  carry .vllm_chunk2      the piece alone                                                          (~2 s)
#   3  carry .vllm_chunk3      the piece alone                                                          (~2 s)
#   4  carry .vllm_chunk4      SHA256 set, CALL_BUDGET_S=585: h200_core2 on the 27B shape, c1/8/32/64   (~500 s)
#   5  (warm)                  only if call 4's deadline skipped an arm: the same grid by --resume       (~350 s)
# Added after call 4 (KERNEL_NOTES section 18, C31: the prefill conv's history branch, then its tile):
#   6  carry .whl              pytest -m gpu on the conv and the engine's GPU token tests (<= 150 s); the conv tile
#                              sweep (benchmarks/conv_prefill_sweep.py); the 27B mixed step 2048@0 / 2048@32 with
#                              C31's branch at the committed tile                                       (~250 s)
#   7  (no carry)              C31 before / after in one process: the conv kernel of 9d034a7 (the file
#                              c31_baseline_conv_triton.py, from `git show 9d034a7:deltaserve/kernels/conv_triton.py`,
#                              untracked, travels with the tree) against the current one at the committed tile (~60 s)
#   8  carry .whl              the fp32 token gates on cuda, tiny dense / moe / next (make-tiny), on the final served
#                              code (item 5: STRICT 32/32 each)                                          (~300 s)
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=585] [RECORD_DATE=20261204-s16] bash scripts/h200_s16.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1..5}
SESSION=s16
BUNDLE_CALLS="1 2 3 4"
source scripts/h200_call.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/ds_site:/tmp/vllm_site  # the bundle last: pydantic for xgrammar
BATCHES=1,2,4,8,16,24,32,48,64,96,128,192,256
case $CALL in
  1)
    timeout 150 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models --only q35-35b-a3b,q35-27b \
      > "$W/dummies.log" 2>&1
    mark "pytest -m gpu: MoE decode kernels, PDL, the engine's PDL token test (verbose, capped at 150 s)"
    budget=$((SECONDS + 160)) gpu_pytest pytest-gpu-moe tests/kernels/test_moe_decode.py tests/kernels/test_pdl.py \
      tests/engine/test_gpu_async.py -k "not async_graph_decode_matches_sync and not graph_decode_matches_eager"
    mark "decode step, 35B-A3B, with the warm-up pass: model / routerlate / nogemv at B = 1, 2, 4"
    decode_step decode-step-warmup-35b-a3b --shapes 35b-a3b --variants model,routerlate,nogemv --batches 1,2,4
    mark "decode step, both shapes: model at 13 batch sizes, with the warm-up pass"
    decode_step decode-step --shapes 35b-a3b,27b --variants model --batches $BATCHES
    mark "mixed-step profile, 27B: 2048 prefill tokens with 0 / 8 / 32 decodes"
    timeout $((budget - 10 - SECONDS)) python3 benchmarks/mixed_step.py --models /tmp/ds_models --shapes 27b \
      --cases 2048@0,2048@8,2048@32,0@8,0@32 --reps 5 --out "$OUT/mixed-step-27b.json" > "$W/mixed-step-27b.log" 2>&1
    echo "mixed_step rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^  |FAILED|case," "$W/mixed-step-27b.log" | tee -a "$OUT/summary.txt"
    ;;
  2 | 3) mark "bundle piece $CALL" ;;
  4) mark "h200_core2, 27B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-27b-$day" --models q35-27b --concurrencies 1,8,32,64 ;;
  5) mark "h200_core2, 27B, c1/8/32/64, resumed"
     grid benchmarks/grids/h200_core2.toml "h200_core2-27b-$day" --models q35-27b --concurrencies 1,8,32,64 \
       --resume "/tmp/ds_grid_$SESSION/h200_core2-27b-$day.json" ;;
  6)
    timeout 150 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models --only q35-27b > "$W/dummies.log" 2>&1
    mark "pytest -m gpu: the conv, the engine's GPU token tests (capped at 150 s)"
    budget=$((SECONDS + 160)) gpu_pytest pytest-gpu-conv tests/kernels/test_conv.py tests/kernels/test_gdn.py \
      tests/engine/test_gpu_async.py
    mark "conv tile sweep"
    timeout 200 python3 benchmarks/conv_prefill_sweep.py --out "$OUT/conv-prefill-sweep.json" > "$W/conv-sweep.log" 2>&1
    echo "conv_prefill_sweep rc $?" | tee -a "$OUT/summary.txt"
    grep -v Warn "$W/conv-sweep.log" | tee -a "$OUT/summary.txt"
    mark "mixed-step profile, 27B, C31's branch at the committed tile"
    timeout $((budget - 10 - SECONDS)) python3 benchmarks/mixed_step.py --models /tmp/ds_models --shapes 27b \
      --cases 2048@0,2048@32 --reps 5 --out "$OUT/mixed-step-27b-c31.json" > "$W/mixed-step-27b-c31.log" 2>&1
    echo "mixed_step rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^  |FAILED|case,|conv" "$W/mixed-step-27b-c31.log" | tee -a "$OUT/summary.txt"
    python3 - "$OUT/mixed-step-27b-c31.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for case, c in d["shapes"]["27b"].items():
    for k in c.get("top_kernels", []):
        if "conv" in k["name"] or "gdn" in k["name"]:
            print(f"  {case} {k['name']}: {k['us']:.0f} us / {k['calls']}")
PY
    ;;
  7)
    mark "conv before / after (C31), committed tile"
    timeout 200 python3 benchmarks/conv_prefill_sweep.py --baseline c31_baseline_conv_triton.py --only-baseline \
      --out "$OUT/conv-prefill-c31-ab.json" > "$W/conv-c31-ab.log" 2>&1
    echo "conv_prefill_sweep rc $?" | tee -a "$OUT/summary.txt"
    grep -v Warn "$W/conv-c31-ab.log" | tee -a "$OUT/summary.txt"
    ;;
  8)
    mark "token gates, tiny dense / moe / next, fp32 on cuda"
    for v in dense moe next; do
      python3 -m deltaserve.cli make-tiny "/tmp/tiny/$v" --variant "$v" > /dev/null 2>&1
      timeout 100 python3 -m deltaserve.cli gate tokens --model "/tmp/tiny/$v" --dtype float32 --device cuda \
        --record "$OUT/gate-$v-float32-tiny.json" \
        > "$W/gate-$v-float32.log" 2>&1
      echo "gate $v float32 rc $?: $(grep -E "STRICT" "$W/gate-$v-float32.log" | head -1)" | tee -a "$OUT/summary.txt"
      cp "$W/gate-$v-float32.log" "$OUT/"
    done
    ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
