#!/usr/bin/env bash
# Tensor parallelism on the H200s (issues 18 and 19). Run from the repo root on the device, one step per call (each
# fits the 10-minute limit), with the wheels of .whl carried as for scripts/h200_check.sh. Writes under $OUT.
#   probe      GPUs seen, NCCL all-reduce between them (any kind with 2 GPUs)
#   tests      pytest -m gpu tests/engine/test_gpu_tensor_parallel.py: TP=2 == TP=1 through the decode CUDA graphs
#   gate       per tiny checkpoint (dense, moe, next): scripts/tp_token_compare.py (fp32 TP=2 must equal TP=1; bf16
#              margins of every mismatch against the fp32 yardstick) and `gate tokens --dtype bfloat16 -tp 2`
#              against transformers
#   kernels    bench kernels --tp 2 at the 27B and 35B-A3B per-rank shapes
#   profile1   profile_decode at TP=1 on one GPU: the abstraction costs nothing when its numbers equal main's
#              (run the same step from a checkout of main, or compare with benchmarks/results/profile-decode-*.json)
#   profile2   profile_decode at TP=2: step time and the all-reduce share of a decode step (nccl_pct, allreduce_pct)
#   grid       benchmarks/h200_grid.sh with GRID=benchmarks/grids/h200_tp2.toml (deltaserve TP=2 vs vLLM TP=2);
#              pass grid flags after the step, e.g. `grid --models q35-35b-a3b --deadline-s 540`
# usage: OUT=... bash scripts/h200_tp.sh STEP [grid flags]
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
step=${1:?name a step}
shift || true
# NVLink multicast stays off in every process started from here (the device notes' rule; the executor forces it too)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ds_site .whl/*.whl
fi
# /tmp/ds_site: deltaserve's own pins (xgrammar 0.2.9), as h200_call.sh and the grids' deltaserve arms have them;
# the vLLM bundle last, where unpacked (xgrammar 0.2.9 imports pydantic, which the host has only from the bundle)
export PYTHONPATH="$PWD:/tmp/ds_site:/tmp/vllm_site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
dummy() { [ -f /tmp/ds_models/q35-35b-a3b/config.json ] || python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models; }
echo "=== $step ($(date +%T))"
case $step in
  probe)
    cat "$OUT/nvidia-smi.csv"
    python3 - <<'PY'
import torch, torch.distributed as dist, torch.multiprocessing as mp, os
def run(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    print("rank", rank, "all-reduce", t.tolist(), flush=True)
    dist.destroy_process_group()
print("cuda devices:", torch.cuda.device_count(), "torch", torch.__version__)
if torch.cuda.device_count() >= 2:
    mp.spawn(run, nprocs=2)
PY
    ;;
  tests)
    timeout 500 python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider --import-mode=importlib \
      tests/engine/test_gpu_tensor_parallel.py > "$OUT/pytest_gpu_tp.log" 2>&1
    echo "pytest rc $?"; grep -E "passed|failed|FAILED|Error|skipped" "$OUT/pytest_gpu_tp.log" | tail -20 ;;
  gate)
    for v in dense moe next; do
      python3 -m deltaserve.cli make-tiny "/tmp/tiny/$v" --variant "$v" > /dev/null
      timeout 170 python3 scripts/tp_token_compare.py --model "/tmp/tiny/$v" --tp 2 --dtype bfloat16 --device cuda \
        --out "$OUT/tp_compare_bf16_$v.json" 2>&1 | grep -v -i "warn\|loading weights\|falling back" \
        | tee "$OUT/tp_compare_bf16_$v.log" | tail -30
      timeout 150 python3 -m deltaserve.cli gate tokens --model "/tmp/tiny/$v" --dtype bfloat16 --device cuda -tp 2 2>&1 \
        | grep -v -i "warn\|loading weights\|falling back" | tee "$OUT/gate_bf16_tp2_$v.log" | tail -6
    done ;;
  kernels)
    ops=preamble_fused,rms_norm_residual,gated_rms_norm,silu_and_mul,store_kv,paged_attention,causal_conv1d,gdn,fused_moe
    for m in 35b-a3b 27b; do
      timeout 270 python3 -m deltaserve.cli bench kernels --tp 2 --models "$m" --ops "$ops" --tokens 1,8,64,512,2048,8192 \
        --out "$OUT/kernels-tp2-$m.json" > "$OUT/kernels-tp2-$m.log" 2>&1
      echo "kernels tp2 $m: rc $?"; grep -E "preamble_fused |fused_moe |gdn " "$OUT/kernels-tp2-$m.log" | head -12
    done ;;
  profile1|profile2)
    dummy
    tp=${step#profile}
    for m in ${PROFILE_MODELS:-35b-a3b 27b}; do
      timeout "${PROFILE_TIMEOUT_S:-270}" python3 benchmarks/profile_decode.py --model "/tmp/ds_models/q35-$m" \
        --batches "${PROFILE_BATCHES:-1,8,32,64}" --staggered 8 --steps 20 --tensor-parallel-size "$tp" \
        --out "$OUT/profile-decode-tp$tp-$m.json" 2>&1 | grep -v "USDT\|UserWarning\|_warn_once" | tail -8
    done ;;
  grid)
    GRID=benchmarks/grids/h200_tp2.toml bash benchmarks/h200_grid.sh "$@" ;;
  *)
    echo "unknown step $step"; exit 2 ;;
esac
