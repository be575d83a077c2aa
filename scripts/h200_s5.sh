#!/usr/bin/env bash
# The next session's device calls (planned 2026-12-01 after session 4; 1800 device-seconds), one warm nvidia-h200,
# each issued within 30 s of the last. Calls 1-3 carry the three vLLM bundle pieces (benchmarks/oracle/unpack.sh).
#   1  carry .vllm_chunk .whl build/baseline   piece 1, the wheels; issue 11: decode_step.py before/after KERNEL_NOTES
#                               C7 (fused GDN in_proj) and C8 (one-launch attention output gate) on both shapes at
#                               B = 1, 8, 32, 128 (BATCHES; ~300 s).
#                               build/baseline = deltaserve/ of 0463821 (before both):
#                                 mkdir -p build/baseline && git archive 0463821 deltaserve | tar -x -C build/baseline
#   2  carry .vllm_chunk2       piece 2; issue 14: the bf16 image gates against transformers, both vision variants
#   3  carry .vllm_chunk3       piece 3 (SHA256 set); issues 13/14: vLLM's runs for all five checkpoints side by side,
#                               then deltaserve's gates against them (the text ones again after C7/C8; ~420 s)
#   4                           issue 16: the structured grid pair on the fixed schema (minItems 64)
#   5                           issue 14: the image grid; only with >= 470 s of budget left (`status`), and DEADLINE_S /
#                               GRID_TIMEOUT_S at least 40 s under it (session 4's call was killed by the budget)
# Files come back in $OUT: summary.txt and call<N>.tgz.
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] bash scripts/h200_s5.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
call=${1:?which call: 1..5}
W=/tmp/s5/call$call
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mark() { echo "=== $1 (${SECONDS}s)" | tee -a "$OUT/summary.txt"; }
finish() { tar -czf "$OUT/call$call.tgz" -C "$W" . 2>/dev/null; }
trap finish EXIT
mark "call $call, commit ${DELTASERVE_GIT_COMMIT:-unknown}, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
case $call in
  1 | 2 | 3) bash benchmarks/oracle/unpack.sh vllm | tee -a "$OUT/summary.txt" ;;
  # session 5: piece 3 rides with call 4 (UNPACK=1) so the structured pair runs in the call that completes vLLM
  4) [ "${UNPACK:-0}" = 1 ] && bash benchmarks/oracle/unpack.sh vllm | tee -a "$OUT/summary.txt" ;;
esac
case $call in
  1)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ds_site \
      .whl/*.whl > "$W/pip.log" 2>&1 || echo "wheel install failed: $(tail -2 "$W/pip.log")" | tee -a "$OUT/summary.txt"
    [ -d build/baseline/deltaserve ] || { echo "no build/baseline/deltaserve: carry it (see the header)"; exit 3; }
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1
    mark "decode step, baseline 0463821 then this tree (model variant)"
    PYTHONPATH=$PWD timeout "${DECODE_TIMEOUT_S:-320}" python3 benchmarks/decode_step.py --models /tmp/ds_models \
      --variants model --batches "${BATCHES:-1,8,32,128}" --baseline build/baseline \
      --baseline-timeout-s "${BASELINE_TIMEOUT_S:-150}" \
      --out "$W/decode-step.json" > "$W/decode-step.log" 2>&1
    echo "decode_step rc $?" | tee -a "$OUT/summary.txt"
    tail -40 "$W/decode-step.log" | tee -a "$OUT/summary.txt"
    ;;
  2)
    mark "image gates against transformers (two at a time)"
    for v in dense-vl moe-vl; do
      [ -f "/tmp/ds_media_models/$v/config.json" ] || PYTHONPATH=$PWD python3 -m deltaserve.cli make-tiny \
        "/tmp/ds_media_models/$v" --variant "$v" > /dev/null
    done
    for v in dense-vl moe-vl; do
      PYTHONPATH=$PWD timeout 280 python3 -m deltaserve.cli gate tokens --model "/tmp/ds_media_models/$v" --media image \
        --reference transformers --dtype bfloat16 --device cuda --share-gpu \
        --record "$W/gate-bf16-image-transformers-$v.json" > "$W/gate-bf16-image-transformers-$v.log" 2>&1 &
    done
    wait
    grep -hE "^STRICT|^yardstick|^per kind|^four-op" "$W"/gate-bf16-image-*.log | tee -a "$OUT/summary.txt"
    ;;
  3)
    # all five checkpoints: the text gates again because C7/C8 (120ee41) came after session 4's text records
    mark "vLLM refs side by side (text and image), then the gates against them"
    OUT=$W STAGE=vllm-refs GATE_TIMEOUT_S=260 bash benchmarks/oracle/gates_shared.sh > "$W/refs.txt" 2>&1
    grep -E "^===|REFUSED|Error|no verdict" "$W/refs.txt" | tee -a "$OUT/summary.txt"
    cp /tmp/gate_cache/*.json "$W/" 2>/dev/null  # the saved vLLM runs come back too
    OUT=$W STAGE=vllm GATE_TIMEOUT_S=$((560 - SECONDS)) bash benchmarks/oracle/gates_shared.sh > "$W/gates.txt" 2>&1
    grep -E "^===|^STRICT|^yardstick|^per kind|^four-op|REFUSED|Error" "$W/gates.txt" | tee -a "$OUT/summary.txt"
    ;;
  4)
    mark "structured grid: the unconstrained twin"
    GRID=benchmarks/grids/h200_structured_free.toml GRID_TIMEOUT_S=130 GRID_STORE=/tmp/ds_grid_free OUT=$W/free \
      bash benchmarks/h200_grid.sh --record-name "h200_structured_free-35b-a3b-${RECORD_DATE:-$(date +%Y%m%d)}" \
      --no-drift > "$W/grid-free.log" 2>&1
    grep "^\[grid\]" "$W/grid-free.log" | tail -6 | tee -a "$OUT/summary.txt"
    mark "structured grid: deltaserve then vLLM 0.26 with xgrammar"
    # the deadline counts from the grid's own start: what the call has left, less the stop margin
    GRID=benchmarks/grids/h200_structured.toml GRID_TIMEOUT_S=$((${CALL_BUDGET_S:-575} - SECONDS)) GRID_STORE=/tmp/ds_grid_so OUT=$W/so \
      bash benchmarks/h200_grid.sh --record-name "h200_structured-35b-a3b-${RECORD_DATE:-$(date +%Y%m%d)}" --no-drift \
      --deadline-s $((${CALL_BUDGET_S:-575} - 15 - SECONDS)) > "$W/grid-so.log" 2>&1
    grep -E "^\[grid\]|rror" "$W/grid-so.log" | tail -16 | tee -a "$OUT/summary.txt"
    # vLLM's start spent 39 s in torch.compile and 87 s in its first profiling run (Triton JIT) in session 4: how
    # large are the caches a later session could carry to skip that (start time only, no measured figure moves)?
    du -sh ~/.cache/vllm ~/.triton/cache /tmp/torchinductor_* 2>/dev/null | tee -a "$OUT/summary.txt"
    ;;
  5)
    mark "image grid (DEADLINE_S=${DEADLINE_S:-420}, GRID_TIMEOUT_S=${GRID_TIMEOUT_S:-430})"
    OUT=$W DEADLINE_S=${DEADLINE_S:-420} GRID_TIMEOUT_S=${GRID_TIMEOUT_S:-430} bash scripts/h200_image_grid.sh --no-drift \
      > "$W/image.log" 2>&1
    grep -E "^\[grid\]|rror" "$W/image.log" | tail -16 | tee -a "$OUT/summary.txt"
    ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
mark done
