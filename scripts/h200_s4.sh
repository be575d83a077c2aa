#!/usr/bin/env bash
# Session of 2026-12-01 20:06 (1800 device-seconds): the five device calls, one warm nvidia-h200, each issued within
# 30 s of the last (/tmp persists only while the machine stays warm). The vLLM bundle travels in three pieces, one a
# call (benchmarks/oracle/unpack.sh), so calls 1 and 2 do the work that needs no vLLM.
#   1  carry .vllm_chunk .whl   piece 1; the carried wheels into /tmp/ds_site; issues 13/14: the transformers-side
#                               bf16 gates, ten at once (benchmarks/oracle/gates_shared.sh STAGE=transformers); then
#                               alone on the GPU the TP=1 engine GPU tests and the structured-output GPU test (this
#                               session's per-instance gpu_memory_utilization and last session's structured error
#                               path ran only on the CPU so far)
#   2  carry .vllm_chunk2       piece 2; the whole `pytest -m gpu` suite (cut at GPU_SUITE_S, default 240 s)
#   3  carry .vllm_chunk3       piece 3, SHA256 set: unpack; vLLM's reference runs, five at once (STAGE=vllm-refs),
#                               then deltaserve's gates against them (STAGE=vllm)
#   4                           issue 16: the structured grid on the ASCII dummy tokenizer, its unconstrained twin first
#   5                           issue 14: the image-traffic grid (scripts/h200_image_grid.sh)
# Each call's files come back in $OUT (at most 8): summary.txt and one tarball of logs and records.
# As run (benchmarks/results/h200-session4-20261201.txt): call 1 as written; calls 2-5 as the inline commands
# that record lists (call 2 shrank to the unpack, call 3 left out the image gates, call 4 was split in two).
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] bash scripts/h200_s4.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
call=${1:?which call: 1..5}
shift
W=/tmp/s4/call$call
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mark() { echo "=== $1 (${SECONDS}s)" | tee -a "$OUT/summary.txt"; }
finish() { tar -czf "$OUT/call$call.tgz" -C "$W" . 2>/dev/null; }
trap finish EXIT
mark "call $call, commit ${DELTASERVE_GIT_COMMIT:-unknown}, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"

gpu_tests() {  # NAME LIMIT PYTEST-ARGS...
  local name=$1 limit=$2
  shift 2
  PYTHONPATH="$PWD:/tmp/ds_site" timeout "$limit" python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider \
    --import-mode=importlib -rs --durations=10 "$@" > "$W/pytest-$name.log" 2>&1
  echo "$name pytest rc $?" | tee -a "$OUT/summary.txt"
  grep -E "passed|failed|FAILED|Error|SKIPPED" "$W/pytest-$name.log" | tail -12 | tee -a "$OUT/summary.txt"
}

case $call in
  1)
    bash benchmarks/oracle/unpack.sh vllm | tee -a "$OUT/summary.txt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ds_site \
      .whl/*.whl > "$W/pip.log" 2>&1 || echo "wheel install failed: $(tail -2 "$W/pip.log")" | tee -a "$OUT/summary.txt"
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/summary.txt"
    mark "gates, transformers side (ten at once)"
    OUT=$W STAGE=transformers GATE_TIMEOUT_S=${GATE_TIMEOUT_S:-300} bash benchmarks/oracle/gates_shared.sh \
      > "$W/gates.txt" 2>&1
    echo "gates rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^===|^STRICT|^yardstick|^per kind|^four-op|REFUSED|Error" "$W/gates.txt" | tee -a "$OUT/summary.txt"
    mark "TP=1 engine GPU tests and the structured-output GPU test"
    gpu_tests tp1 170 tests/engine/test_gpu_async.py \
      "tests/engine/test_runtime_compiles.py::test_serving_traffic_compiles_nothing_after_start_up[moe]" \
      tests/engine/test_gpu_tensor_parallel.py tests/engine/test_structured_engine.py
    ;;
  2)
    bash benchmarks/oracle/unpack.sh vllm | tee -a "$OUT/summary.txt"
    mark "pytest -m gpu, the whole suite (cut at ${GPU_SUITE_S:-240} s)"
    gpu_tests suite "${GPU_SUITE_S:-240}" tests
    ;;
  3)
    bash benchmarks/oracle/unpack.sh vllm | tee -a "$OUT/summary.txt"
    mark "vLLM reference runs (five at once)"
    OUT=$W STAGE=vllm-refs GATE_TIMEOUT_S=${REF_TIMEOUT_S:-360} bash benchmarks/oracle/gates_shared.sh \
      > "$W/refs.txt" 2>&1
    echo "refs rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^===|REFUSED|Error|no verdict" "$W/refs.txt" | tee -a "$OUT/summary.txt"
    mark "gates against the saved vLLM runs (eight at once)"
    OUT=$W STAGE=vllm GATE_TIMEOUT_S=$((570 - SECONDS)) bash benchmarks/oracle/gates_shared.sh > "$W/gates.txt" 2>&1
    echo "gates rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^===|^STRICT|^yardstick|^per kind|^four-op|REFUSED|Error" "$W/gates.txt" | tee -a "$OUT/summary.txt"
    ;;
  4)
    mark "structured grid: the unconstrained twin"
    GRID=benchmarks/grids/h200_structured_free.toml GRID_TIMEOUT_S=130 GRID_STORE=/tmp/ds_grid_free \
      OUT=$W/free bash benchmarks/h200_grid.sh --record-name h200_structured_free-35b-a3b-20261201-s4 --no-drift \
      > "$W/grid-free.log" 2>&1
    echo "free rc $? (${SECONDS}s)" | tee -a "$OUT/summary.txt"
    grep "^\[grid\]" "$W/grid-free.log" | tail -8 | tee -a "$OUT/summary.txt"
    mark "structured grid: JSON schema, deltaserve then vLLM 0.26 with xgrammar"
    GRID=benchmarks/grids/h200_structured.toml GRID_TIMEOUT_S=$((578 - SECONDS)) GRID_STORE=/tmp/ds_grid_so \
      OUT=$W/so bash benchmarks/h200_grid.sh --record-name h200_structured-35b-a3b-20261201-s4 \
      --deadline-s $((565 - SECONDS)) > "$W/grid-so.log" 2>&1
    echo "structured rc $? (${SECONDS}s)" | tee -a "$OUT/summary.txt"
    grep -E "^\[grid\]|Error|failed [1-9]" "$W/grid-so.log" | tail -16 | tee -a "$OUT/summary.txt"
    ;;
  5)
    mark "image grid"
    OUT=$W bash scripts/h200_image_grid.sh "$@" > "$W/image.log" 2>&1
    echo "image grid rc $? (${SECONDS}s)" | tee -a "$OUT/summary.txt"
    grep -E "^\[grid\]|Error" "$W/image.log" | tail -16 | tee -a "$OUT/summary.txt"
    ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
mark done
