#!/usr/bin/env bash
# The bf16 image (and video) token gates of issue 14 on the H200, from the repo root, after
# `bash benchmarks/oracle/unpack.sh vllm` unpacked vLLM 0.26.0 into /tmp/vllm_site. For each vision variant
# (dense-vl, moe-vl: deltaserve/tiny/trained/<variant> when it exists, else a make-tiny checkpoint in /tmp):
#   deltaserve bf16 vs vLLM 0.26 bf16 (in process, built by the oracle registry for media traffic: vision tower
#   kept, no language_model_only), then deltaserve bf16 vs transformers bf16; both print the yardstick (each
#   engine against transformers-fp32), so a random checkpoint's own bf16 chaos is visible; then the four-op check
#   (DELTASERVE_FUSE_ATTN_PREAMBLE=0: the refusal only).
# Each run writes $OUT/gate-bf16-<media>-<reference>-<variant>.json and its log next to it.
# usage: OUT=... MEDIA=image bash benchmarks/oracle/media_gate_runs.sh [dense-vl] [moe-vl]   (MEDIA: image,
#        multi-image, video, all or a comma list; default image; about 2-3 min per variant on a warm machine)
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT}"
media=${MEDIA:-image}
variants=${*:-dense-vl moe-vl}
if [ ! -d /tmp/vllm_site/vllm ]; then
  echo "no /tmp/vllm_site/vllm: unpack the vLLM bundle first (benchmarks/oracle/unpack.sh vllm)"
  exit 3
fi
export PYTHONPATH="$PWD:/tmp/vllm_site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
status=0
tag=${media//,/+}
for v in $variants; do
  model=deltaserve/tiny/trained/$v
  if [ ! -f "$model/config.json" ]; then
    model=/tmp/ds_media_models/$v
    [ -f "$model/config.json" ] || python3 -m deltaserve.cli make-tiny "$model" --variant "$v" > /dev/null
  fi
  for reference in vllm transformers four-op; do
    name=gate-bf16-$tag-$reference-$v
    echo "=== $name on $model ($(date +%T))"
    ref=$reference preamble=1
    [ "$reference" = four-op ] && ref=transformers preamble=0
    DELTASERVE_FUSE_ATTN_PREAMBLE=$preamble timeout 420 python3 -m deltaserve.cli gate tokens --model "$model" \
      --media "$media" --reference "$ref" --dtype bfloat16 --device cuda --record "$OUT/$name.json" \
      > "$OUT/$name.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    grep -E "^STRICT|^  prompt|^yardstick|^logits|^prefill|^per kind|^prompt expansion|^four-op|REFUSED|Error" \
      "$OUT/$name.log" | head -24
    echo "rc $rc"
  done
done
exit $status
