#!/usr/bin/env bash
# Here, before a device session: cut a bundle's pieces again at other sizes, so that fewer calls carry it.
#   bash benchmarks/oracle/recut.sh vllm|flashinfer SIZES SHA256 [SOURCE]
# SIZES: one size in MiB (every piece that size, the last the rest), or a comma list (the first pieces those sizes,
# fractions allowed, the last piece the rest; a list of one ends in ",rest"): `recut.sh vllm 49.5,56 <sha>` gives
# 49.5 + 56 + the rest, `recut.sh flashinfer 39,rest <sha>` 39 + the rest.
# A piece travels beside the working tree and a call carries at most 64 MiB in all (benchmarks/README.md, "Running on
# the H200"): with the tree at ~29 MiB the pieces are 34 MiB (vLLM 4 pieces, FlashInfer 3); with
# benchmarks/results/kernels/ moved out of the checkout for the session, 42 MiB (vLLM 3, FlashInfer 2); with
# benchmarks/results/ and deltaserve/tiny/trained/ moved out (benchmarks/oracle/slim_tree.sh; a tree of ~6.6 MiB)
# both bundles and .whl fit four calls: `recut.sh vllm 49.5,56` (the first piece with .whl, the last small one with
# the first FlashInfer piece) and `recut.sh flashinfer 39,rest` (session 26).
# The bundle is SOURCE (the built tarball) when given, else joined from the pieces in .vllm_chunk*/ (or .fi_chunk*/:
# the original folders, without "_"), checked against SHA256, cut into the git-ignored .vllm_chunk_0/, _1/, ... (or
# .fi_chunk_N/), each with parts.count; the old folders are left as they are, and unpack.sh on the device reads any
# .vllm_chunk* folder a call carries, so carry either set, never both.
set -euo pipefail
bundle=${1:?vllm or flashinfer}
sizes=${2:?piece sizes in MiB: one size, or a comma list}
sha=${3:?the bundle sha256}
source=${4:-}
case $bundle in
  vllm) prefix=.vllm_chunk ;;
  flashinfer) prefix=.fi_chunk ;;
  *) echo "unknown bundle $bundle (vllm or flashinfer)"; exit 2 ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -n "$source" ]; then
  cp "$source" "$tmp/bundle"
else  # the original pieces only (folders without "_"), in piece order
  cat $(ls "$prefix"/part.* "$prefix"[0-9]*/part.* 2> /dev/null | sort -t/ -k2) > "$tmp/bundle"
fi
echo "$sha  $tmp/bundle" | sha256sum -c
total=$(stat -c %s "$tmp/bundle")
# the piece boundaries in bytes: a comma list as given, one size repeated until the bundle ends
cuts=$(python3 - "$sizes" "$total" << 'PY'
import sys
words, total = sys.argv[1].split(","), int(sys.argv[2])
mib = 1024 * 1024
if words[-1] == "rest":  # "39,rest": the first pieces as given, the last the rest
    words = words[:-1]
sizes = [float(w) for w in words]
lengths = [int(s * mib) for s in sizes] if len(sizes) > 1 or sys.argv[1].endswith("rest") else []
if not lengths:  # one size: pieces of at most that size
    lengths = [int(sizes[0] * mib)] * (total // int(sizes[0] * mib))
rest = total - sum(lengths)
if rest < 0 or any(n <= 0 for n in lengths):
    sys.exit(f"pieces of {sizes} MiB do not fit a bundle of {total} bytes")
print(" ".join(str(n) for n in lengths + ([rest] if rest else [])))
PY
)
rm -rf "$prefix"_[0-9]*
n=$(echo $cuts | wc -w)
i=0
offset=0
for length in $cuts; do
  mkdir -p "${prefix}_$i"
  dd if="$tmp/bundle" of="${prefix}_$i/part.$(printf %02d $i)" bs=1M iflag=skip_bytes,count_bytes skip="$offset" \
    count="$length" status=none
  echo "$n" > "${prefix}_$i/parts.count"
  offset=$((offset + length))
  i=$((i + 1))
done
cat "$prefix"_*/part.* | sha256sum | sed "s|-|(the pieces, joined)|"
ls -l "$prefix"_*/part.*
