#!/usr/bin/env bash
# The next session's device calls (planned 2026-12-02 after session 8; 1800 device-seconds), one warm nvidia-h200,
# each issued within 30 s of the last (session 8 lost a warm machine between two calls: if a summary says "pieces
# stored: 1 of 3" where 2 were expected, send the missing piece in a short call, `bash benchmarks/oracle/unpack.sh vllm`).
# Session 8's bundle sum: e88e87446666ddee2baadc0a82df143139d3e2ebb6c4f97614a44c965604a33b (a checkout without the
# pieces rebuilds them with /work/shared/tools/vllm-oracle/build_bundle.sh: check the new sum).
#   1  carry .vllm_chunk        dummies; pytest -m gpu tests/kernels/test_gdn.py (the w / u fix at dk 64 / dv 32 has
#                               not run on the H200), scripts/diag_gdn_prefill.py (bf16 variants), diag_gdn_stages.py
#                               --time (w / u at 4 and 8 warps at the served heads); the mixed-step profile (the
#                               35B-A3B eager prefill steps are host-bound: what moved)            (~250 s)
#   2  carry .vllm_chunk2       pytest -m gpu tests/kernels (everything, ~180 s)
#   3  carry .vllm_chunk3 .whl  h200_core2 on the 35B-A3B shape at c1/8/32/64 (~490 s; did not run in session 8)
#   4                           h200_core2 on the 27B shape at c1/8/32/64 (~520 s) if the budget still holds it
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=570] bash scripts/h200_s9.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1..4}
SESSION=s9
BUNDLE_CALLS="1 2 3"
source scripts/h200_call.sh
export PYTHONPATH=$PWD
case $CALL in
  1)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1
    mark "pytest -m gpu test_gdn"
    timeout 120 python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels/test_gdn.py > "$W/pytest-gpu-gdn.log" 2>&1
    echo "pytest -m gpu test_gdn: $(tail -1 "$W/pytest-gpu-gdn.log")" | tee -a "$OUT/summary.txt"
    mark "GDN diag (bf16 variants, w / u timing)"
    timeout 60 python3 scripts/diag_gdn_prefill.py > "$W/diag-gdn.txt" 2>&1
    timeout 40 python3 scripts/diag_gdn_stages.py --time > "$W/diag-gdn-time.txt" 2>&1
    grep -v Warn "$W/diag-gdn-time.txt" | tee -a "$OUT/summary.txt"
    mark "mixed-step profile (27B, 35B-A3B)"
    timeout $((budget - 10 - SECONDS)) python3 benchmarks/mixed_step.py --models /tmp/ds_models \
      --shapes 27b,35b-a3b --cases 2048@0,0@32,2048@32,8x1024@0,1024@0 --reps 5 \
      --out "$W/mixed-step.json" > "$W/mixed-step.log" 2>&1
    echo "mixed_step rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^  |FAILED|case," "$W/mixed-step.log" | tee -a "$OUT/summary.txt"
    ;;
  2)
    mark "pytest -m gpu tests/kernels"
    timeout $((budget - 10 - SECONDS)) python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels \
      > "$W/pytest-gpu-kernels.log" 2>&1
    echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu-kernels.log")" | tee -a "$OUT/summary.txt"
    ;;
  3) mark "h200_core2, 35B-A3B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-35b-a3b-$day" --models q35-35b-a3b --concurrencies 1,8,32,64 ;;
  4) mark "h200_core2, 27B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-27b-$day" --models q35-27b --concurrencies 1,8,32,64 ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
