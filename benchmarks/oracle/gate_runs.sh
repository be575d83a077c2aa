#!/usr/bin/env bash
# The bf16 token gates of issue 13 on the H200, from the repo root, after `bash benchmarks/oracle/unpack.sh vllm`
# unpacked vLLM 0.26.0 into /tmp/vllm_site: for each trained tiny checkpoint (deltaserve/tiny/trained/VARIANT)
#   deltaserve bf16 vs vLLM 0.26 bf16 (in process, built by the oracle registry), fused attention preamble and
#   DELTASERVE_FUSE_ATTN_PREAMBLE=0 (one vLLM run serves both, --reference-cache), then
#   deltaserve bf16 vs transformers bf16, both preamble settings.
# Each run writes its record to $OUT/gate-bf16-<reference>-<variant>[-unfused].json and its log next to it.
# TRAINED_DIR (default deltaserve/tiny/trained) holds the checkpoints, e.g. freshly trained ones on the device.
# usage: OUT=... [REFERENCES="vllm transformers"] [PREAMBLES="1 0"] bash benchmarks/oracle/gate_runs.sh [dense] [moe] [next]
#        (default: all three variants, both references, both preamble settings; one vLLM start per variant, about
#        2-3 min each on a warm machine, so one variant per call is the safe split). REFERENCES=transformers needs no
#        vLLM bundle.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT}"
variants=${*:-dense moe next}
references=${REFERENCES:-vllm transformers}
preambles=${PREAMBLES:-1 0}
if [[ " $references " == *" vllm "* ]] && [ ! -d /tmp/vllm_site/vllm ]; then
  echo "no /tmp/vllm_site/vllm: unpack the vLLM bundle first (benchmarks/oracle/unpack.sh vllm)"
  exit 3
fi
export PYTHONPATH="$PWD:/tmp/vllm_site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT" /tmp/gate_cache
status=0
for v in $variants; do
  model=${TRAINED_DIR:-deltaserve/tiny/trained}/$v
  for reference in $references; do
    for preamble in $preambles; do
      name=gate-bf16-$reference-$v$([ "$preamble" = 0 ] && echo -unfused)
      echo "=== $name ($(date +%T))"
      cache=()
      [ "$reference" = vllm ] && cache=(--reference-cache "/tmp/gate_cache/vllm-$v.json")
      DELTASERVE_FUSE_ATTN_PREAMBLE=$preamble timeout 420 python3 -m deltaserve.cli gate tokens --model "$model" \
        --reference "$reference" --dtype bfloat16 --device cuda "${cache[@]}" \
        --record "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      rc=$?
      [ $rc -ne 0 ] && status=1
      grep -E "^STRICT|^  prompt|^yardstick|^logits|^prefill|REFUSED|Error" "$OUT/$name.log" | head -20
      echo "rc $rc"
    done
  done
done
exit $status
