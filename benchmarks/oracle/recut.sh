#!/usr/bin/env bash
# Here, before a device session: cut a bundle's pieces again at another size, so that fewer calls carry it.
#   bash benchmarks/oracle/recut.sh vllm|flashinfer MIB SHA256
# A piece travels beside the working tree and a call carries at most 64 MiB in all (benchmarks/README.md, "Running on
# the H200"): with the tree at 28.7 MiB the pieces are 34 MiB (vLLM 4 pieces, FlashInfer 3); with
# benchmarks/results/kernels/ moved out of the checkout for the session (10.3 MiB of records no step reads but
# decode-step's comparison) they can be 42 MiB (vLLM 3, FlashInfer 2). The bundle is joined from the pieces in
# .vllm_chunk*/ (or .fi_chunk*/), checked against SHA256, cut into MIB-MiB pieces in the git-ignored
# .vllm_chunk_0/, _1/, ... (or .fi_chunk_N/), each with parts.count; the old folders are left as they are, and
# unpack.sh on the device reads any .vllm_chunk* folder a call carries, so carry either set, never both.
set -euo pipefail
bundle=${1:?vllm or flashinfer}
mib=${2:?piece size in MiB}
sha=${3:?the bundle sha256}
case $bundle in
  vllm) prefix=.vllm_chunk ;;
  flashinfer) prefix=.fi_chunk ;;
  *) echo "unknown bundle $bundle (vllm or flashinfer)"; exit 2 ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the original pieces only (folders without "_"), in piece order
cat $(ls "$prefix"/part.* "$prefix"[0-9]*/part.* 2> /dev/null | sort -t/ -k2) > "$tmp/bundle"
echo "$sha  $tmp/bundle" | sha256sum -c
rm -rf "$prefix"_[0-9]*
(cd "$tmp" && split -b "$((mib * 1024 * 1024))" -d -a 2 bundle part.)
n=$(ls "$tmp"/part.* | wc -l)
i=0
for part in "$tmp"/part.*; do
  mkdir -p "${prefix}_$i"
  mv "$part" "${prefix}_$i/"
  echo "$n" > "${prefix}_$i/parts.count"
  i=$((i + 1))
done
ls -l "$prefix"_*/part.*
