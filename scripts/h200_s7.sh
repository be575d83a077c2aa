#!/usr/bin/env bash
# The next session's device calls (planned 2026-12-02 after session 6; 1800 device-seconds), one warm nvidia-h200,
# each issued within 30 s of the last. Calls 1-3 carry the three vLLM bundle pieces (benchmarks/oracle/unpack.sh);
# call 3 needs SHA256 of the bundle (session 7 rebuilt it: 200fca33a2d2e97b9f29be95c3d7c36b7b134dc8bb051ebf089525d492cee0af)
# and carries .whl too (pieces 1 and 2 with the tree fill a call's 64 MiB).
#   1  carry .vllm_chunk        issue 11: the decode step on both shapes at 13 batch sizes ("before" =
#                               decode-step-h200-20261202-s6.json; C10 align, C11 router, C12 attention, C13 GDN
#                               decode), the align/router bench (C10/C11 alone), the mixed-step profile (item 4)
#   2  carry .vllm_chunk2       pytest -m gpu tests/kernels
#   3  carry .vllm_chunk3 .whl  issue 11: h200_core2 on the 35B-A3B shape at c1/8/32/64 (~460 s: vLLM cold ~270 s)
#   4                           issue 11: h200_core2 on the 27B shape at c1/8/32/64 (~540 s; deltaserve's default
#                               budget is 2048 there now: engine/budget.py, KERNEL_NOTES section 7's prediction)
#   5                           issue 14 follow-up: the bf16 image gates against vLLM 0.26 on the trained vision
#                               checkpoints (benchmarks/oracle/media_gate_runs.sh, vLLM reference only), if >= 250 s
# Check every grid record's unequal_outputs before reading a MoE ratio.
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=570] bash scripts/h200_s7.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
call=${1:?which call: 1..5}
W=/tmp/s7/call$call
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
  GRID=$file GRID_TIMEOUT_S=$((budget - SECONDS)) GRID_STORE=/tmp/ds_grid_s7 OUT=$W/$name \
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
    mark "decode step (model variant, both shapes)"
    PYTHONPATH=$PWD timeout 150 python3 benchmarks/decode_step.py --models /tmp/ds_models --variants model \
      --batches 1,2,4,8,16,24,32,48,64,96,128,192,256 --out "$W/decode-step.json" > "$W/decode-step.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -8 "$W/decode-step.log" | tee -a "$OUT/summary.txt"
    mark "mixed-step profile (27B, 35B-A3B)"
    PYTHONPATH=$PWD timeout 180 python3 benchmarks/mixed_step.py --models /tmp/ds_models --shapes 27b,35b-a3b \
      --reps 5 --out "$W/mixed-step.json" > "$W/mixed-step.log" 2>&1
    echo "mixed_step rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^  |FAILED" "$W/mixed-step.log" | tee -a "$OUT/summary.txt"
    mark "align / router alone (C10, C11)"
    PYTHONPATH=$PWD timeout $((budget - 10 - SECONDS)) python3 benchmarks/align_router_bench.py --out "$W/align-router.json" \
      > "$W/align-router.log" 2>&1
    echo "align_router_bench rc $?" | tee -a "$OUT/summary.txt"
    tail -30 "$W/align-router.log" | tee -a "$OUT/summary.txt"
    ;;
  2)
    mark "pytest -m gpu tests/kernels"
    PYTHONPATH=$PWD:/tmp/ds_site timeout 250 python3 -m pytest -m gpu tests/kernels -p no:cacheprovider -rA \
      > "$W/pytest-gpu-kernels.log" 2>&1
    echo "pytest -m gpu tests/kernels: $(tail -1 "$W/pytest-gpu-kernels.log")" | tee -a "$OUT/summary.txt"
    ;;
  3) mark "h200_core2, 35B-A3B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-35b-a3b-$day" --models q35-35b-a3b --concurrencies 1,8,32,64 ;;
  4) mark "h200_core2, 27B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-27b-$day" --models q35-27b --concurrencies 1,8,32,64 ;;
  5)
    mark "bf16 image gates against vLLM 0.26 on the trained vision checkpoints"
    for v in dense-vl moe-vl; do
      PYTHONPATH=$PWD:/tmp/vllm_site timeout $((budget - 20 - SECONDS)) python3 -m deltaserve.cli gate tokens \
        --model "deltaserve/tiny/trained/$v" --media image --reference vllm --dtype bfloat16 --device cuda \
        --record "$W/gate-bf16-image-vllm-$v.json" > "$W/gate-bf16-image-vllm-$v.log" 2>&1
      echo "gate $v rc $?" | tee -a "$OUT/summary.txt"
    done
    grep -hE "^STRICT|^yardstick|^per kind" "$W"/gate-bf16-image-vllm-*.log | tee -a "$OUT/summary.txt"
    ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
mark done
