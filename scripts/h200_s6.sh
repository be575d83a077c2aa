#!/usr/bin/env bash
# The next session's device calls (planned 2026-12-01 after session 5; 1800 device-seconds), one warm nvidia-h200,
# each issued within 30 s of the last. Calls 1-3 carry the three vLLM bundle pieces (benchmarks/oracle/unpack.sh);
# call 3 needs SHA256=f1072cf22d5e5197df0192a8c4c7b9d43df6d029ab0fd8ec607f0bf36423d077.
#   1  carry .vllm_chunk        issue 11: the decode step after C9 (router GEMV) on both shapes at 13 batch sizes
#                               (~70 s; "before" = decode-step-h200-20261201-s5.json), then the mixed-step profile
#                               (benchmarks/mixed_step.py, item 4: prefill chunks + decodes against their parts)
#   2  carry .vllm_chunk2       issue 14: the bf16 image gates against transformers on the trained vision checkpoints
#                               (deltaserve/tiny/trained/{dense-vl,moe-vl}; two at once, ~200 s), beside
#                               pytest -m gpu tests/kernels
#   3  carry .vllm_chunk3 .whl  issue 11: h200_core2 on the 35B-A3B shape at c1/8/32/64 (~460 s: vLLM cold ~295 s)
#   4                           issue 11: h200_core2 on the 27B shape at c1/8/32/64 (~560 s)
#   5                           issue 11: deltaserve's token budget on the 27B shape (benchmarks/grids/h200_budget.toml,
#                               ARMS=deltaserve-b4096 or both), whatever the budget leaves
#   6                           issue 14: the image grid again (vLLM's dummy-weight scheme in both arms now;
#                               ~430 s) only with >= 470 s left, DEADLINE_S / GRID_TIMEOUT_S 40 s under the budget
# Every grid run now records num_distinct_generated_texts per arm, and a ratio whose arms differ in it by > 2x is
# flagged (unequal_outputs): check the records for it before reading any MoE ratio.
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=570] bash scripts/h200_s6.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
call=${1:?which call: 1..6}
W=/tmp/s6/call$call
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mark() { echo "=== $1 (${SECONDS}s)" | tee -a "$OUT/summary.txt"; }
finish() { tar -czf "$OUT/call$call.tgz" -C "$W" . 2>/dev/null; }
trap finish EXIT
budget=${CALL_BUDGET_S:-570}
mark "call $call, commit ${DELTASERVE_GIT_COMMIT:-unknown}, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
case $call in
  1 | 2 | 3) bash benchmarks/oracle/unpack.sh vllm | tee -a "$OUT/summary.txt" ;;
esac
grid() {  # grid file, record name, extra flags...
  local file=$1 name=$2
  shift 2
  GRID=$file GRID_TIMEOUT_S=$((budget - SECONDS)) GRID_STORE=/tmp/ds_grid_s6 OUT=$W/$name \
    bash benchmarks/h200_grid.sh --record-name "$name" --no-drift --deadline-s $((budget - 15 - SECONDS)) "$@" \
    > "$W/$name.log" 2>&1
  grep -E "^\[grid\]|rror" "$W/$name.log" | tail -16 | tee -a "$OUT/summary.txt"
}
day=${RECORD_DATE:-$(date +%Y%m%d)}
# deltaserve's own pins for the grids (xgrammar 0.2.9 and its needs): .whl rides with piece 3 (pieces 1 and 2 with
# the tree fill the 64 MiB a call carries)
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ds_site \
    .whl/*.whl > "$W/pip.log" 2>&1 || echo "wheel install failed: $(tail -2 "$W/pip.log")" | tee -a "$OUT/summary.txt"
fi
case $call in
  1)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1
    mark "decode step after C9 (model variant, both shapes)"
    PYTHONPATH=$PWD timeout 200 python3 benchmarks/decode_step.py --models /tmp/ds_models --variants model \
      --batches 1,2,4,8,16,24,32,48,64,96,128,192,256 --out "$W/decode-step.json" > "$W/decode-step.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -8 "$W/decode-step.log" | tee -a "$OUT/summary.txt"
    mark "mixed-step profile (27B, 35B-A3B)"
    PYTHONPATH=$PWD timeout 300 python3 benchmarks/mixed_step.py --models /tmp/ds_models --shapes 27b,35b-a3b \
      --reps 5 --out "$W/mixed-step.json" > "$W/mixed-step.log" 2>&1
    echo "mixed_step rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^  |FAILED" "$W/mixed-step.log" | tee -a "$OUT/summary.txt"
    ;;
  2)
    mark "image gates against transformers on the trained vision checkpoints, beside pytest -m gpu tests/kernels"
    PYTHONPATH=$PWD:/tmp/ds_site timeout 250 python3 -m pytest -m gpu tests/kernels -p no:cacheprovider -rA \
      > "$W/pytest-gpu-kernels.log" 2>&1 &
    for v in dense-vl moe-vl; do
      model=deltaserve/tiny/trained/$v
      [ -f "$model/config.json" ] || { echo "no $model: skipped" | tee -a "$OUT/summary.txt"; continue; }
      PYTHONPATH=$PWD timeout 300 python3 -m deltaserve.cli gate tokens --model "$model" --media image \
        --reference transformers --dtype bfloat16 --device cuda --share-gpu \
        --record "$W/gate-bf16-image-transformers-$v.json" > "$W/gate-bf16-image-transformers-$v.log" 2>&1 &
    done
    wait
    echo "pytest -m gpu tests/kernels: $(tail -1 "$W/pytest-gpu-kernels.log")" | tee -a "$OUT/summary.txt"
    grep -hE "^STRICT|^yardstick|^per kind|^four-op" "$W"/gate-bf16-image-*.log | tee -a "$OUT/summary.txt"
    ;;
  3) mark "h200_core2, 35B-A3B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-35b-a3b-$day" --models q35-35b-a3b --concurrencies 1,8,32,64 ;;
  4) mark "h200_core2, 27B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-27b-$day" --models q35-27b --concurrencies 1,8,32,64 ;;
  5) mark "token budget, 27B, deltaserve only (${ARMS:-deltaserve-b4096})"
     grid benchmarks/grids/h200_budget.toml "h200_budget-27b-$day" --arms "${ARMS:-deltaserve-b4096}" ;;
  6)
    mark "image grid (DEADLINE_S=${DEADLINE_S:-420}, GRID_TIMEOUT_S=${GRID_TIMEOUT_S:-430})"
    OUT=$W DEADLINE_S=${DEADLINE_S:-420} GRID_TIMEOUT_S=${GRID_TIMEOUT_S:-430} bash scripts/h200_image_grid.sh --no-drift \
      > "$W/image.log" 2>&1
    grep -E "^\[grid\]|rror" "$W/image.log" | tail -16 | tee -a "$OUT/summary.txt"
    ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
mark done
