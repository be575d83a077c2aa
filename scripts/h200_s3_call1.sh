#!/usr/bin/env bash
# Session of 2026-12-01 17:16 (1800 device-seconds), call 1 of 4. The vLLM bundle travels in three pieces (one a
# call), so the first two calls do the work that needs no vLLM while its pieces are stored:
#   1. store bundle piece 1 (benchmarks/oracle/unpack.sh); install the carried wheels (.whl: xgrammar 0.2.9, the
#      project's pinned version, and its needs) into /tmp/ds_site
#   2. issue 13: train the dense / moe / next test checkpoints on the GPU (deltaserve.tiny.train --device cuda,
#      64 rows a step: the CPU recipe's 8 rows x 360 steps left transformers bf16 vs fp32 at 13/32 on dense), three
#      processes at once, into /tmp/trained (kept for call 2's gates while the machine stays warm)
#   3. beside the training (correctness only, no timings): the TP=1 engine GPU tests (issue 18, the pytest part of
#      scripts/h200_tp1_check.sh) and the structured-output GPU test (issue 16)
#   4. issue 13: transformers bf16 vs fp32 conditioning of each trained checkpoint, on the GPU
# Everything lands in /tmp/s3 and comes back as $OUT/s3call1.tgz, $OUT/trained.tgz and $OUT/summary.txt.
# usage: OUT=... [TRAIN_STEPS=3000 TRAIN_BUDGET_S=210] bash scripts/h200_s3_call1.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
W=/tmp/s3
mkdir -p "$W/call1" "$OUT"
export PYTHONPATH="$PWD:/tmp/ds_site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$W/call1
mark() { echo "=== $1 (${SECONDS}s)" | tee -a "$L/timeline.txt"; }
finish() {
  tar -czf "$OUT/s3call1.tgz" -C "$W" call1
  [ -d /tmp/trained ] && tar -czf "$OUT/trained.tgz" -C /tmp trained
  cp "$L/timeline.txt" "$OUT/summary.txt"
}
trap finish EXIT
mark "start commit ${DELTASERVE_GIT_COMMIT:-unknown} $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee -a "$L/timeline.txt"
bash benchmarks/oracle/unpack.sh vllm | tee -a "$L/timeline.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ds_site .whl/*.whl \
  > "$L/pip.log" 2>&1 || echo "wheel install failed: $(tail -2 "$L/pip.log")" | tee -a "$L/timeline.txt"
python3 -c "import torch, triton, transformers, xgrammar; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'xgrammar', xgrammar.__file__)" 2>&1 | tee -a "$L/timeline.txt"

mark "train (at most ${TRAIN_STEPS:-3000} steps in ${TRAIN_BUDGET_S:-210} s, 64 rows, cuda)"
pids=()
for v in dense moe next; do
  timeout "${TRAIN_TIMEOUT_S:-290}" python3 -m deltaserve.tiny.train "/tmp/trained/$v" --variant "$v" \
    --steps "${TRAIN_STEPS:-3000}" --batch-size 64 --warmup-steps 40 --device cuda \
    --time-budget-s "${TRAIN_BUDGET_S:-210}" > "$L/train-$v.log" 2>&1 &
  pids+=($!)
done

mark "tp1 tests (beside the training)"
timeout "${TP1_TESTS_TIMEOUT_S:-170}" python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider \
  --import-mode=importlib -rs --durations=8 tests/engine/test_gpu_async.py \
  "tests/engine/test_runtime_compiles.py::test_serving_traffic_compiles_nothing_after_start_up[moe]" \
  tests/engine/test_gpu_tensor_parallel.py > "$L/pytest_gpu_tp1.log" 2>&1
echo "tp1 pytest rc $?" | tee -a "$L/timeline.txt"
grep -E "passed|failed|FAILED|Error|SKIPPED" "$L/pytest_gpu_tp1.log" | tail -8 | tee -a "$L/timeline.txt"

mark "structured GPU test (beside the training)"
timeout "${SO_TIMEOUT_S:-120}" python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider -rs --durations=5 \
  tests/engine/test_structured_engine.py > "$L/pytest_gpu_structured.log" 2>&1
echo "structured pytest rc $?" | tee -a "$L/timeline.txt"
grep -E "passed|failed|FAILED|Error|SKIPPED" "$L/pytest_gpu_structured.log" | tail -8 | tee -a "$L/timeline.txt"

mark "wait for training"
for i in 0 1 2; do wait "${pids[$i]}"; echo "train rc $?" | tee -a "$L/timeline.txt"; done
for v in dense moe next; do grep -E "^train\[" "$L/train-$v.log" | tail -2 | tee -a "$L/timeline.txt"; done

mark "conditioning on the GPU"
cpids=()
for v in dense moe next; do
  if [ -f "/tmp/trained/$v/config.json" ]; then
    timeout "${COND_TIMEOUT_S:-120}" python3 -m deltaserve.gates.conditioning "/tmp/trained/$v" --device cuda \
      > "$L/conditioning-$v.log" 2>&1 &
    cpids+=($!)
  fi
done
for p in "${cpids[@]}"; do wait "$p"; done
grep -h "^conditioning" "$L"/conditioning-*.log | tee -a "$L/timeline.txt"
mark done
