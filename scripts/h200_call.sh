#!/usr/bin/env bash
# What every device call of a session script shares (sourced from the repo root, from scripts/h200_s8.sh on; the
# earlier session scripts are records of what ran and keep their own copy): the work folder /tmp/$SESSION/call$CALL,
# the offline and NVLink-multicast-off environment, the summary's `mark`, the call's tarball on exit, the budget,
# the header line, the vLLM bundle piece of the calls that carry one (BUNDLE_CALLS), `grid`, `decode_step` (from
# h200_s12.sh on; earlier scripts define their own), `gpu_pytest` (from h200_s13.sh's call 4), and the carried wheels.
# Needs: OUT, SESSION (e.g. s8), CALL; optional BUNDLE_CALLS ("1 2 3"), CALL_BUDGET_S (570), RECORD_DATE.
W=/tmp/$SESSION/call$CALL
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mark() { echo "=== $1 (${SECONDS}s)" | tee -a "$OUT/summary.txt"; }
finish() { tar -czf "$OUT/call$CALL.tgz" -C "$W" . 2>/dev/null; }
trap finish EXIT
budget=${CALL_BUDGET_S:-570}
mark "call $CALL, commit ${DELTASERVE_GIT_COMMIT:-unknown}, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
case " ${BUNDLE_CALLS:-1 2 3} " in
  *" $CALL "*) bash benchmarks/oracle/unpack.sh vllm | tee -a "$OUT/summary.txt" ;;
esac
grid() {  # grid file, record name, extra flags...
  local file=$1 name=$2
  shift 2
  GRID=$file GRID_TIMEOUT_S=$((budget - SECONDS)) GRID_STORE=/tmp/ds_grid_$SESSION OUT=$W/$name \
    bash benchmarks/h200_grid.sh --record-name "$name" --no-drift --deadline-s $((budget - 15 - SECONDS)) "$@" \
    > "$W/$name.log" 2>&1
  grep -E "^\[grid\]|rror" "$W/$name.log" | tail -16 | tee -a "$OUT/summary.txt"
}
decode_step() {  # record name, then benchmarks/decode_step.py flags: the record to $OUT, its log to $W
  local name=$1
  shift
  timeout $((budget - 10 - SECONDS)) python3 benchmarks/decode_step.py --models /tmp/ds_models --label after \
    --out "$OUT/$name.json" "$@" > "$W/$name.log" 2>&1
  echo "decode_step $name rc $?" | tee -a "$OUT/summary.txt"
  grep -A8 "graph_ms by batch size" "$W/$name.log" | tee -a "$OUT/summary.txt"
}
gpu_pytest() {  # log name, then pytest arguments: -v -m gpu in what is left of the budget, so a cut run still
  local name=$1  # names what passed; the summary gets the pass count, pytest's last line and every failure
  shift
  timeout $((budget - 10 - SECONDS)) python3 -m pytest -v -m gpu -o addopts="" -p no:cacheprovider \
    --import-mode=importlib "$@" > "$W/$name.log" 2>&1
  echo "pytest rc $?: $(grep -cE " PASSED" "$W/$name.log") passed, $(grep -E "passed|failed" "$W/$name.log" \
    | tail -1)" | tee -a "$OUT/summary.txt"
  grep -E "(FAILED|ERROR)" "$W/$name.log" | head -40 | tee -a "$OUT/summary.txt"
}
day=${RECORD_DATE:-$(date +%Y%m%d)}
# deltaserve's own pins for the grids (xgrammar 0.2.9 and its needs): .whl rides with piece 3 (pieces 1 and 2 with
# the tree fill the 64 MiB a call carries)
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ds_site \
    .whl/*.whl > "$W/pip.log" 2>&1 || echo "wheel install failed: $(tail -2 "$W/pip.log")" | tee -a "$OUT/summary.txt"
fi
