#!/usr/bin/env bash
# One H200 call for the GPU fast path (issue 5): GPU tests, the bf16 token gate on the tiny models, the kernel
# benchmark, and an end-to-end smoke of the dummy 27B- / 35B-A3B-shaped models. Run from the repo root on the
# device, with the wheels of .whl carried (fastapi/uvicorn/pydantic are not on the host). Writes under $OUT.
# Wheels used on 2026-11-29 (py3.12, manylinux; see the device README for the pip download line): fastapi 0.165.0,
# starlette 1.10.0, pydantic 2.14.4, pydantic_core 2.50.5, annotated-types 0.8.0, typing-inspection 0.4.5,
# uvicorn 0.54.0 and opentelemetry-api 1.45.2 (fastapi 0.165 imports it). `pytest -m gpu` there needs
# --ignore=tests/api --ignore=tests/bench (they import openai, which the host lacks; they hold no GPU tests).
# `profile` runs benchmarks/profile_decode.py on the dummy 35B-A3B and 27B shapes (step time, host wait, GPU idle
# between steps, graph time, Triton compiles met after start-up); compare with benchmarks/results/profile-decode-*.json.
# usage: bash scripts/h200_check.sh [tests] [gate] [kernels] [smoke] [profile]   (default: the first four)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
steps=${*:-tests gate kernels smoke}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for step in $steps; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests)
      timeout 170 python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider --import-mode=importlib tests \
        --ignore=tests/api --ignore=tests/bench > "$OUT/pytest_gpu.log" 2>&1
      echo "pytest rc $?"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest_gpu.log" | tail -25 ;;
    gate)
      for v in dense moe next; do
        python3 -m deltaserve.cli make-tiny "/tmp/tiny/$v" --variant "$v" > /dev/null
        timeout 200 python3 -m deltaserve.cli gate tokens --model "/tmp/tiny/$v" --dtype bfloat16 --device cuda 2>&1 \
          | grep -v -i "warn\|loading weights\|falling back" | tee "$OUT/gate_bf16_$v.log"
        timeout 200 python3 -m deltaserve.cli gate tokens --model "/tmp/tiny/$v" --dtype float32 --device cuda 2>&1 \
          | grep -v -i "warn\|loading weights\|falling back" | tail -4 | tee "$OUT/gate_fp32_$v.log"
      done ;;
    kernels)
      ops=preamble_fused,preamble_fused_w1,preamble_fused_w2,preamble_unfused,rotary_embedding,rms_norm_residual
      ops=$ops,gated_rms_norm,silu_and_mul,store_kv,paged_attention,causal_conv1d,gdn,fused_moe
      for m in 35b-a3b 27b; do
        timeout 240 python3 -m deltaserve.cli bench kernels --models "$m" --ops "$ops" --tokens 1,8,64,512,2048,8192 \
          --out "$OUT/kernels-$m.json" > "$OUT/kernels-$m.log" 2>&1
        echo "kernels $m: rc $?"; grep -E "preamble_(fused|unfused) " "$OUT/kernels-$m.log" | awk '{print $2, $4, $5}' | paste - - | head -8
      done ;;
    profile)
      # PROFILE_MODELS (default both shapes) and PROFILE_BATCHES (default 1,8,32,64,128,256)
      [ -f /tmp/ds_models/q35-35b-a3b/config.json ] || python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models
      for m in ${PROFILE_MODELS:-35b-a3b 27b}; do
        timeout "${PROFILE_TIMEOUT_S:-270}" python3 benchmarks/profile_decode.py --model "/tmp/ds_models/q35-$m" \
          --batches "${PROFILE_BATCHES:-1,8,32,64,128,256}" --staggered 8,32 --steps 20 \
          --out "$OUT/profile-decode-$m.json" 2>&1 | grep -v "USDT\|UserWarning\|_warn_once" | tail -12
      done ;;
    smoke)
      [ -f /tmp/ds_models/q35-35b-a3b/config.json ] || python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models
      for m in q35-35b-a3b q35-27b; do
        timeout 240 python3 scripts/smoke_serve.py "/tmp/ds_models/$m" --out "$OUT/smoke_$m.json" 2>&1 | tail -15
      done ;;
  esac
done
