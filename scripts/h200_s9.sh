#!/usr/bin/env bash
# Session 9's device calls (2026-12-02; 1800 device-seconds), one warm nvidia-h200, each issued within 30 s of the
# last. Calls 1-3 carry the three vLLM bundle pieces (benchmarks/oracle/unpack.sh); call 3 needs SHA256 of the
# bundle (session 9's rebuild: c62076ceff0a46e37484c40bc5eb8c0a62f51bac675debe2f35522bd3dc5f876; a checkout without
# the pieces rebuilds them with /work/shared/tools/vllm-oracle/build_bundle.sh: check the new sum) and carries .whl.
# If a summary says "pieces stored: 1 of 3" where 2 were expected, the machine changed between calls: send the
# missing piece in a short call (`bash benchmarks/oracle/unpack.sh vllm`).
#   1  carry .vllm_chunk        pytest -m gpu on the kernels this session and session 8 changed (the w / u warps
#                               fix at dk 64 / dv 32 has not run on the H200; C19's chunked alignment; C20's out
#                               views: test_gdn, test_conv, test_out_views, test_moe_align_router);
#                               diag_gdn_stages --time (w / u at 4 and 8 warps at the served
#                               heads, the blocked inverse alone); the align bench (C19 against torch and the
#                               one-program kernel); the mixed-step profile at 2048@0 / 2048@32 (C19 / C20)  (~300 s)
#   2  carry .vllm_chunk2       diag_gdn_prefill (the bf16 one-factor variants around dk 64 / dv 32)        (~60 s)
#   3  carry .vllm_chunk3 .whl  h200_core2 on the 35B-A3B shape at c1/8/32/64                               (~490 s)
#   4                           h200_core2 on the 27B shape at c1/8/32/64                                   (~520 s)
# After call 1 the machine was lost (budget 1052 s left), so the rest ran as:
#   5  carry .vllm_chunk        store the piece, nothing else                                               (~5 s)
#   6  carry .vllm_chunk2       the GDN and alignment GPU tests with the w / u kernel at 8 warps everywhere and
#                               the align switch at 1024 entries                                             (~120 s)
#   7  carry .vllm_chunk3 .whl  h200_core2 on the 27B shape at c1/8/32/64                                   (~540 s)
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> [SHA256=...] [CALL_BUDGET_S=570] [RECORD_DATE=20261202-s9] bash scripts/h200_s9.sh CALL
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
CALL=${1:?which call: 1..7}
SESSION=s9
BUNDLE_CALLS="1 2 3 5 6 7"
source scripts/h200_call.sh
export PYTHONPATH=$PWD
case $CALL in
  1)
    timeout 120 python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models > "$W/dummies.log" 2>&1 &
    mark "pytest -m gpu (gdn, conv, out views, align/router)"
    timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels/test_gdn.py tests/kernels/test_conv.py \
      tests/kernels/test_out_views.py tests/kernels/test_moe_align_router.py > "$W/pytest-gpu.log" 2>&1
    echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu.log")" | tee -a "$OUT/summary.txt"
    grep -E "^FAILED|^ERROR" "$W/pytest-gpu.log" | head -20 | tee -a "$OUT/summary.txt"
    mark "GDN timing (w / u warps, blocked inverse alone)"
    timeout 60 python3 scripts/diag_gdn_stages.py --time > "$W/diag-gdn-time.txt" 2>&1
    grep -v Warn "$W/diag-gdn-time.txt" | tee -a "$OUT/summary.txt"
    mark "align / router bench"
    timeout 60 python3 benchmarks/align_router_bench.py --reps 10 --replays 10 --out "$W/align-router.json" \
      > "$W/align-router.log" 2>&1
    echo "align_router_bench rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^align N=( 1024| 2048| 4096| 8192|16384|32768|65536) M= 16" "$W/align-router.log" | tee -a "$OUT/summary.txt"
    wait
    mark "mixed-step profile (27B, 35B-A3B)"
    timeout $((budget - 10 - SECONDS)) python3 benchmarks/mixed_step.py --models /tmp/ds_models \
      --shapes 27b,35b-a3b --cases 2048@0,2048@32 --reps 5 \
      --out "$W/mixed-step.json" > "$W/mixed-step.log" 2>&1
    echo "mixed_step rc $?" | tee -a "$OUT/summary.txt"
    grep -E "^  |FAILED|case," "$W/mixed-step.log" | tee -a "$OUT/summary.txt"
    ;;
  2)
    mark "GDN bf16 variants"
    timeout 100 python3 scripts/diag_gdn_prefill.py > "$W/diag-gdn.txt" 2>&1
    grep -v Warn "$W/diag-gdn.txt" | tail -30 | tee -a "$OUT/summary.txt"
    ;;
  5) ;;
  6) mark "pytest -m gpu (GDN prefill, chunked alignment)"
     timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rA tests/kernels/test_gdn.py \
       tests/kernels/test_moe_align_router.py tests/kernels/test_out_views.py -k "prefill or chunked or halves" \
       > "$W/pytest-gpu.log" 2>&1
     echo "pytest -m gpu: $(tail -1 "$W/pytest-gpu.log")" | tee -a "$OUT/summary.txt"
     grep -E "^FAILED|^ERROR" "$W/pytest-gpu.log" | head -20 | tee -a "$OUT/summary.txt" ;;
  7) mark "h200_core2, 27B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-27b-$day" --models q35-27b --concurrencies 1,8,32,64 ;;
  3) mark "h200_core2, 35B-A3B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-35b-a3b-$day" --models q35-35b-a3b --concurrencies 1,8,32,64 ;;
  4) mark "h200_core2, 27B, c1/8/32/64"
     grid benchmarks/grids/h200_core2.toml "h200_core2-27b-$day" --models q35-27b --concurrencies 1,8,32,64 ;;
  *) echo "unknown call $CALL"; exit 2 ;;
esac
mark done
