#!/usr/bin/env bash
# The bf16 token gates of issues 13 and 14 on the H200, side by side on one GPU (`gate tokens --share-gpu`: each
# deltaserve engine at gpu_memory_utilization 0.05, each vLLM oracle with a fixed 1 GiB KV cache; cache sizes
# only, no computation changes), so one vLLM start per checkpoint costs one start of wall time in all. From the
# repo root (`bash scripts/h200.sh gates bf16 STAGE` runs it); media_gate_runs.sh runs the media gates one by one.
#   STAGE=transformers  deltaserve bf16 vs transformers bf16 on the trained dense / moe / next checkpoints (fused
#                       preamble and DELTASERVE_FUSE_ATTN_PREAMBLE=0), and the image gate on the vision variants
#                       (dense-vl / moe-vl: make-tiny checkpoints in /tmp/ds_media_models) vs transformers, plus
#                       the four-op refusal check. No vLLM needed.
#   STAGE=vllm-refs     vLLM 0.26's runs alone (--reference-only), all five checkpoints at once, saved in
#                       /tmp/gate_cache (needs /tmp/vllm_site: benchmarks/oracle/unpack.sh vllm)
#   STAGE=vllm          deltaserve bf16 vs those saved vLLM runs (text: both preamble settings; image: fused)
# Each gate writes $OUT/gates/<name>.json and <name>.log; the summary (STRICT lines, margins, yardsticks) goes to
# stdout. Every gate has its own time limit (GATE_TIMEOUT_S, default 420). TEXT_VARIANTS (default "dense moe next")
# and MEDIA_VARIANTS (default "dense-vl moe-vl") choose the checkpoints; an empty one leaves that kind out.
# usage: OUT=... STAGE=transformers|vllm-refs|vllm bash benchmarks/oracle/gates_shared.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT}"
stage=${STAGE:?set STAGE to transformers, vllm-refs or vllm}
limit=${GATE_TIMEOUT_S:-420}
export PYTHONPATH="$PWD:/tmp/vllm_site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
trained=${TRAINED_DIR:-deltaserve/tiny/trained}
media_models=/tmp/ds_media_models
cache=/tmp/gate_cache
mkdir -p "$OUT/gates" "$cache"
if [ "$stage" != transformers ] && [ ! -d /tmp/vllm_site/vllm ]; then
  echo "no /tmp/vllm_site/vllm: unpack the vLLM bundle first (benchmarks/oracle/unpack.sh vllm)"
  exit 3
fi
for v in ${MEDIA_VARIANTS-dense-vl moe-vl}; do
  [ -f "$media_models/$v/config.json" ] || python3 -m deltaserve.cli make-tiny "$media_models/$v" --variant "$v" \
    > /dev/null
done

names=() pids=()
# launch NAME PREAMBLE ARGS...: one gate in the background, its record and log under $OUT/gates
launch() {
  local name=$1 preamble=$2
  shift 2
  DELTASERVE_FUSE_ATTN_PREAMBLE=$preamble timeout "$limit" python3 -m deltaserve.cli gate tokens --dtype bfloat16 \
    --device cuda --share-gpu "$@" > "$OUT/gates/$name.log" 2>&1 &
  names+=("$name") pids+=($!)
  sleep 1  # staggered starts: the CUDA contexts and first compiles do not all land at once
}
for v in ${TEXT_VARIANTS-dense moe next}; do
  model=$trained/$v
  case $stage in
    transformers)
      launch "gate-bf16-transformers-$v" 1 --model "$model" --reference transformers \
        --record "$OUT/gates/gate-bf16-transformers-$v.json"
      launch "gate-bf16-transformers-$v-unfused" 0 --model "$model" --reference transformers \
        --record "$OUT/gates/gate-bf16-transformers-$v-unfused.json" ;;
    vllm-refs)
      launch "ref-vllm-$v" 1 --model "$model" --reference vllm --reference-only --reference-cache "$cache/vllm-$v.json" ;;
    vllm)
      launch "gate-bf16-vllm-$v" 1 --model "$model" --reference vllm --reference-cache "$cache/vllm-$v.json" \
        --record "$OUT/gates/gate-bf16-vllm-$v.json"
      launch "gate-bf16-vllm-$v-unfused" 0 --model "$model" --reference vllm --reference-cache "$cache/vllm-$v.json" \
        --record "$OUT/gates/gate-bf16-vllm-$v-unfused.json" ;;
    *) echo "unknown STAGE $stage"; exit 2 ;;
  esac
done
for v in ${MEDIA_VARIANTS-dense-vl moe-vl}; do
  model=$media_models/$v
  case $stage in
    transformers)
      launch "gate-bf16-image-transformers-$v" 1 --model "$model" --media image --reference transformers \
        --record "$OUT/gates/gate-bf16-image-transformers-$v.json"
      launch "gate-bf16-image-four-op-$v" 0 --model "$model" --media image --reference transformers \
        --record "$OUT/gates/gate-bf16-image-four-op-$v.json" ;;
    vllm-refs)
      launch "ref-vllm-image-$v" 1 --model "$model" --media image --reference vllm --reference-only \
        --reference-cache "$cache/vllm-image-$v.json" ;;
    vllm)
      launch "gate-bf16-image-vllm-$v" 1 --model "$model" --media image --reference vllm \
        --reference-cache "$cache/vllm-image-$v.json" --record "$OUT/gates/gate-bf16-image-vllm-$v.json" ;;
  esac
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  [ $rc -ne 0 ] && status=1
  echo "=== ${names[$i]}: rc $rc ($SECONDS s)"
  grep -E "^STRICT|^  prompt|^yardstick|^logits|^prefill|^per kind|^prompt expansion|^four-op|REFUSED|Error|no verdict" \
    "$OUT/gates/${names[$i]}.log" | head -24
done
exit $status
