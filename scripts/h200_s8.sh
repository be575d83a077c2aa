#!/usr/bin/env bash
# The next session's device calls (planned 2026-12-02 after session 7; 1800 device-seconds), one warm nvidia-h200,
# each issued within 30 s of the last. Calls 1-3 carry the three vLLM bundle pieces (benchmarks/oracle/unpack.sh);
# call 3 needs SHA256 of the bundle (session 8's rebuild: e88e87446666ddee2baadc0a82df143139d3e2ebb6c4f97614a44c965604a33b;
# a checkout without the pieces rebuilds them with /work/shared/tools/vllm-oracle/build_bundle.sh: check the new sum)
# and carries .whl too (xgrammar 0.2.9, apache-tvm-ffi 0.1.11). If a call's summary says "pieces stored: 1 of 3"
# where 2 were expected, the machine changed between calls: send the missing piece in a short call of its own
# (`bash benchmarks/oracle/unpack.sh vllm`), as session 7 did.
#   1  carry .vllm_chunk        pytest -m gpu on the kernels changed in session 7 (C12b, C14-C18: test_gdn,
#                               test_moe_decode, test_attention, test_cuda_graphs, test_moe_align_router,
#                               test_linear); the
#                               decode step on both shapes at 13 batch sizes ("before" = decode-step-h200-20261202-s7.json:
#                               C10b, C11b, C12b; C16 / C17 are off in the committed table, so they need call 2);
#                               the mixed-step profile with the host-side columns (C14 / C15, the 35B-A3B eager step)
#   2  carry .vllm_chunk2       tune_moe for buckets 1-16 (C16 / C17 candidates), merged into the committed table
#                               (/tmp/s8/moe-table.json, kept for calls 3-4), then the 35B-A3B decode step at
#                               B = 1-16 with it, the model and the `linear` variant (KERNEL_NOTES section 10's
#                               and row C18's predictions; C18 is the split-K skinny GEMM, not used by the model)
#   3  carry .vllm_chunk3 .whl  h200_core2 on the 35B-A3B shape at c1/8/32/64 with the merged table (~480 s)
#   4                           h200_core2 on the 27B shape at c1/8/32/64 (~580 s)
# Check every grid record's unequal_outputs before reading a MoE ratio. Afterwards commit the merged table
# (call 2's moe-table.json) over deltaserve/kernels/configs/moe_E256_I512_H2048_k8_bfloat16_NVIDIA_H200.json
# if the decode step measured it no slower than the committed one.
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=570] [TUNE_BUDGET_S=200] bash scripts/h200_s8.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1..4}
SESSION=s8
BUNDLE_CALLS="1 2 3"
source scripts/h200_call.sh
TABLE=deltaserve/kernels/configs/moe_E256_I512_H2048_k8_bfloat16_NVIDIA_H200.json
# calls 3 and 4 serve with the table call 2 tuned and merged (this call's checkout is a fresh copy of the tree)
if [ "$CALL" -ge 3 ] && [ -f /tmp/s8/moe-table.json ]; then
  cp /tmp/s8/moe-table.json "$TABLE" && echo "serving with the merged table of call 2" | tee -a "$OUT/summary.txt"
fi
case $CALL in
  1)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1
    mark "pytest -m gpu on session 7's kernels"
    PYTHONPATH=$PWD:/tmp/ds_site timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels/test_gdn.py \
      tests/kernels/test_moe_decode.py tests/kernels/test_attention.py tests/kernels/test_cuda_graphs.py \
      tests/kernels/test_moe_align_router.py tests/kernels/test_linear.py > "$W/pytest-gpu-kernels.log" 2>&1
    echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu-kernels.log")" | tee -a "$OUT/summary.txt"
    mark "decode step (model variant, both shapes)"
    PYTHONPATH=$PWD timeout 150 python3 benchmarks/decode_step.py --models /tmp/ds_models --variants model \
      --batches 1,2,4,8,16,24,32,48,64,96,128,192,256 --out "$W/decode-step.json" > "$W/decode-step.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -6 "$W/decode-step.log" | tee -a "$OUT/summary.txt"
    mark "mixed-step profile with host columns (27B, 35B-A3B)"
    PYTHONPATH=$PWD timeout $((budget - 10 - SECONDS)) python3 benchmarks/mixed_step.py --models /tmp/ds_models \
      --shapes 27b,35b-a3b --cases 2048@0,0@8,0@32,2048@32,8x1024@0,8x1024@32,1024@0 --reps 5 \
      --out "$W/mixed-step.json" > "$W/mixed-step.log" 2>&1
    echo "mixed_step rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^  |FAILED|case," "$W/mixed-step.log" | tee -a "$OUT/summary.txt"
    ;;
  2)
    mark "tune_moe 35B-A3B buckets 1-16 (C16 / C17 candidates)"
    PYTHONPATH=$PWD timeout $((${TUNE_BUDGET_S:-200} + 60)) python3 benchmarks/tune_moe.py --shape 35b-a3b --buckets 1,2,4,8,16 \
      --budget-s ${TUNE_BUDGET_S:-200} \
      --out "$W/moe-table-tuned.json" > "$W/tune-moe.log" 2>&1
    echo "tune_moe rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^bucket" "$W/tune-moe.log" | tee -a "$OUT/summary.txt"
    # the tuned buckets over the committed table's (buckets 32 and up stay as committed)
    python3 - "$TABLE" "$W/moe-table-tuned.json" /tmp/s8/moe-table.json <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
committed, tuned = (json.load(open(p)) for p in sys.argv[1:3])
assert committed["shape"] == tuned["shape"], (committed["shape"], tuned["shape"])
merged = dict(committed)
merged["buckets"] = {**committed["buckets"], **tuned["buckets"]}
merged["measurements"] = {**committed.get("measurements", {}), **tuned.get("measurements", {})}
merged["source"] = committed["source"] + "; buckets " + ",".join(tuned["buckets"]) + " retuned: " + tuned["source"]
json.dump(merged, open(sys.argv[3], "w"), indent=1)
print("merged table: buckets", ",".join(tuned["buckets"]), "from the tune over", len(committed["buckets"]), "committed")
PY
    cp /tmp/s8/moe-table.json "$W/moe-table.json" 2>/dev/null
    mark "decode step 35B-A3B B = 1-16 with the merged table, the model and the linear variant (C18)"
    PYTHONPATH=$PWD timeout $((budget - 10 - SECONDS)) python3 benchmarks/decode_step.py --models /tmp/ds_models \
      --shapes 35b-a3b --variants model,linear --batches 1,2,4,8,16 --moe-table /tmp/s8/moe-table.json \
      --out "$W/decode-step-tuned.json" > "$W/decode-step-tuned.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -5 "$W/decode-step-tuned.log" | tee -a "$OUT/summary.txt"
    ;;
  3) mark "h200_core2, 35B-A3B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-35b-a3b-$day" --models q35-35b-a3b --concurrencies 1,8,32,64 ;;
  4) mark "h200_core2, 27B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-27b-$day" --models q35-27b --concurrencies 1,8,32,64 ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
