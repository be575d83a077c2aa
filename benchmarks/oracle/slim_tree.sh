#!/usr/bin/env bash
# Here, around a device session's calls: move the tracked files no device step of a grid reads out of the checkout, so
# that more of a call's 64 MiB carries bundle pieces (benchmarks/oracle/recut.sh), and back before any commit or test.
#   bash benchmarks/oracle/slim_tree.sh out [ASIDE]     (default ASIDE: ../aside, outside the checkout)
#   bash benchmarks/oracle/slim_tree.sh back [ASIDE]
# out: benchmarks/results/ (the records; only decode-step's comparison reads one), deltaserve/tiny/trained/ (the
# trained tiny checkpoints: GPU tests and gates read them, grids do not) and docs/ (no device step reads it), ~25.8
# MiB, leaving ~4.6 MiB of tracked files: room beside .whl and a 56 MiB bundle piece (session 29's tree with docs/
# in it was over 64 MiB with the first piece and .whl). A call that runs GPU tests or gates needs the trained
# checkpoints back (`mv ../aside/deltaserve/tiny/trained deltaserve/tiny/`) and carries no piece. Nothing is moved
# while ASIDE already holds them, and back refuses to overwrite: `git status` shows the moved paths as deleted until
# they are back, so never `git add -A` between the two.
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:?out or back}
aside=${2:-../aside}
paths=(benchmarks/results deltaserve/tiny/trained docs)
case $what in
  out)
    for p in "${paths[@]}"; do
      [ -e "$aside/$p" ] && { echo "$aside/$p exists: bring it back first"; exit 1; }
    done
    for p in "${paths[@]}"; do
      mkdir -p "$aside/$(dirname "$p")"
      mv "$p" "$aside/$p"
    done
    # (stat fails on the moved files: xargs then exits 123)
    git ls-files -z | xargs -0 stat -c %s 2> /dev/null | awk '{s += $1} END {printf "tracked files left: %.2f MiB\n", s / 1048576}' || true ;;
  back)
    for p in "${paths[@]}"; do
      [ -e "$p" ] && { echo "$p is in the checkout already: not overwritten"; exit 1; }
      mv "$aside/$p" "$p"
    done
    git status --short -- "${paths[@]}" | head -5
    echo "back: ${paths[*]}" ;;
  *) echo "out or back, not $what"; exit 2 ;;
esac
