#!/usr/bin/env bash
# On the H200 host, from the repo root: store the bundle piece(s) this call carried, and unpack the bundle once
# all its pieces are stored. /tmp persists between calls while the machine stays warm (30 s after a call); the
# checkout does not, so the pieces go in consecutive calls.
#   bash benchmarks/oracle/unpack.sh [vllm|flashinfer]      (default vllm)
#   vllm:       pieces in .vllm_chunk*/ (shared/tools/vllm-oracle/build_bundle.sh), unpacked into /tmp/vllm_site
#   flashinfer: pieces in .fi_chunk*/ (benchmarks/oracle/build_flashinfer_bundle.sh), into /tmp/flashinfer_site
# Each piece folder holds part.NN and parts.count (how many pieces the bundle has). The sha256 check is
# mandatory: without SHA256 set, the pieces are kept and nothing is unpacked.
set -euo pipefail
bundle=${1:-vllm}
case $bundle in
  vllm) pattern=.vllm_chunk; dest=/tmp/vllm_site ;;
  flashinfer) pattern=.fi_chunk; dest=/tmp/flashinfer_site ;;
  *) echo "unknown bundle $bundle (vllm or flashinfer)"; exit 2 ;;
esac
store=/tmp/store-$bundle
mkdir -p "$store"
for d in "$pattern"*; do
  if [ -d "$d" ]; then cp "$d"/part.* "$store"/; [ -f "$d"/parts.count ] && cp "$d"/parts.count "$store"/; fi
done
want=$(cat "$store"/parts.count 2>/dev/null || echo 2)
have=$(ls "$store"/part.* 2>/dev/null | wc -l)
echo "$bundle bundle pieces stored: $have of $want"
if [ "$have" -lt "$want" ]; then
  echo "send the next piece in the next call (within 30 s)"
  exit 0
fi
if [ -z "${SHA256:-}" ]; then
  echo "all pieces stored; set SHA256=<bundle sha256> to check and unpack"
  exit 0
fi
cat "$store"/part.* > /tmp/b-$bundle.tar.xz
echo "$SHA256  /tmp/b-$bundle.tar.xz" | sha256sum -c
rm -rf "$dest" && mkdir "$dest" && tar -xJf /tmp/b-$bundle.tar.xz -C "$dest"
rm -f /tmp/b-$bundle.tar.xz "$store"/part.* "$store"/parts.count
du -sh "$dest"
