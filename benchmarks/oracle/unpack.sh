#!/usr/bin/env bash
# On the H200 host, from the repo root: store the vLLM bundle piece(s) found in .vllm_chunk*/ in /tmp/store
# (which persists between runs on a live host; the checkout does not); once both are there, check them against
# SHA256 (env, printed by build_bundle.sh) and unpack into /tmp/vllm_site.
# Copied from shared/tools/vllm-oracle/unpack.sh (shared/ is not sent to the device); the sha256 check is
# mandatory here: without SHA256 set the pieces are kept and nothing is unpacked.
set -euo pipefail
mkdir -p /tmp/store
for d in .vllm_chunk .vllm_chunk2; do
  if [ -d "$d" ]; then cp "$d"/part.* /tmp/store/; fi
done
ls -l /tmp/store
if [ ! -f /tmp/store/part.00 ] || [ ! -f /tmp/store/part.01 ]; then
  echo "one chunk stored; send the other next"
  exit 0
fi
if [ -z "${SHA256:-}" ]; then
  echo "both chunks stored; set SHA256=<bundle sha256> to check and unpack"
  exit 0
fi
cat /tmp/store/part.0* > /tmp/b.tar.xz
echo "$SHA256  /tmp/b.tar.xz" | sha256sum -c
rm -rf /tmp/vllm_site && mkdir /tmp/vllm_site && tar -xJf /tmp/b.tar.xz -C /tmp/vllm_site
rm -f /tmp/b.tar.xz /tmp/store/part.*
du -sh /tmp/vllm_site
