#!/usr/bin/env bash
# Session of 2026-12-01 17:16, call 2 of 4 (the machine kept warm since call 1: /tmp/trained, /tmp/ds_site and
# /tmp/ds_models are still there):
#   1. store bundle piece 2
#   2. issue 18: the TP=1 decode profile (35B-A3B dummy, B=1, 32, 128) against the committed records, alone on the
#      GPU (scripts/h200_tp1_check.sh with TP1_TESTS=0: its tests ran in call 1)
#   3. issue 13: the bf16 token gate against transformers on the checkpoints call 1 trained, fused preamble and
#      DELTASERVE_FUSE_ATTN_PREAMBLE=0, the six runs at once (correctness only); beside them, on the host's CPUs,
#      transformers' bf16 vs fp32 conditioning on the CPU (the configuration CI checks)
# Back: $OUT/s3call2.tgz and $OUT/summary.txt.
# usage: OUT=... bash scripts/h200_s3_call2.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
W=/tmp/s3
L=$W/call2
mkdir -p "$L/tp1" "$L/gates" "$OUT"
export PYTHONPATH="$PWD:/tmp/ds_site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mark() { echo "=== $1 (${SECONDS}s)" | tee -a "$L/timeline.txt"; }
finish() {
  tar -czf "$OUT/s3call2.tgz" -C "$W" call2
  cp "$L/timeline.txt" "$OUT/summary.txt"
}
trap finish EXIT
mark "start commit ${DELTASERVE_GIT_COMMIT:-unknown} $(date -u +%FT%TZ)"
bash benchmarks/oracle/unpack.sh vllm | tee -a "$L/timeline.txt"

mark "tp1 profile"
OUT=$L/tp1 TP1_TESTS=0 TP1_BUDGET_S=${TP1_BUDGET_S:-160} bash scripts/h200_tp1_check.sh > "$L/tp1/console.txt" 2>&1
echo "tp1 check rc $?" | tee -a "$L/timeline.txt"
grep -E "^ +[0-9]+ |PASS|FAIL|rc " "$L/tp1/console.txt" | tee -a "$L/timeline.txt"

mark "bf16 gates vs transformers (six at once) + CPU conditioning"
pids=()
for v in dense moe next; do
  for p in 1 0; do
    OUT=$L/gates TRAINED_DIR=/tmp/trained REFERENCES=transformers PREAMBLES=$p \
      timeout "${GATE_TIMEOUT_S:-220}" bash benchmarks/oracle/gate_runs.sh "$v" > "$L/gates/console-$v-$p.txt" 2>&1 &
    pids+=($!)
  done
  OMP_NUM_THREADS=2 timeout "${GATE_TIMEOUT_S:-220}" python3 -m deltaserve.gates.conditioning "/tmp/trained/$v" \
    --device cpu > "$L/conditioning-cpu-$v.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
cat "$L"/gates/console-*.txt | grep -E "^===|^STRICT|^yardstick|^rc " | tee -a "$L/timeline.txt"
grep -h "^conditioning" "$L"/conditioning-cpu-*.log | tee -a "$L/timeline.txt"
mark done
