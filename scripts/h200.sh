#!/usr/bin/env bash
# scripts/h200.sh: the one runner for the offline H200. One step per device call, each named by what it measures.
#
# usage: bash scripts/h200.sh STEP [ARGS...]          (from the repo root of the device's copy of the tree)
#
# A device call (the `run` tool; each call <= 600 s, its command <= 2000 characters):
#   command: DELTASERVE_GIT_COMMIT=<sha> bash scripts/h200.sh decode-step --batches 1,32,128 --shapes 27b,35b-a3b
#   carry:   [".whl"] (deltaserve's pins), plus one vLLM bundle piece (".vllm_chunk", ".vllm_chunk2", ...) per call
#            until all are stored; the call that brings the last piece sets SHA256=<bundle sha256> too.
# The machine keeps /tmp while warm (30 s after a call), never the checkout: bundle pieces, the unpacked bundle
# (/tmp/vllm_site), the pins (/tmp/ds_site), the dummy checkpoints (/tmp/ds_models) and the grid store (/tmp/ds_grid)
# carry over to the next call only on the same warm machine.
#
# steps (every step runs `setup` first; it costs nothing once done):
#   setup                        store the vLLM / FlashInfer bundle pieces this call carried (.vllm_chunk*/,
#                                .fi_chunk*/) and unpack a bundle once all its pieces are there and SHA256 is set
#                                (benchmarks/oracle/unpack.sh); install .whl/*.whl into /tmp/ds_site; write the
#                                dummy 35B-A3B and 27B checkpoints (benchmarks/oracle/make_dummy_models.py)
#   tests [PYTEST ARGS]          pytest -v -m gpu (default: tests/ without tests/api and tests/bench, whose imports
#                                the host lacks); the log comes back as pytest-gpu-TAG.log; WITH_FLASHINFER=1 puts
#                                the FlashInfer bundle on the path too (--gdn-prefill-backend flashinfer's GPU tests)
#   gates [fp32]                 the fp32 token gates on cuda: make-tiny dense / moe / next against transformers,
#                                STRICT 32/32 each (gate-fp32-tiny-V-cuda-TAG.json)
#   gates bf16 STAGE             the bf16 gates on the trained checkpoints, side by side on one GPU
#                                (benchmarks/oracle/gates_shared.sh; STAGE: transformers, vllm-refs, then vllm)
#   gates media [MEDIA]          the bf16 image / multi-image / video gates on the vision variants
#                                (benchmarks/oracle/media_gate_runs.sh; MEDIA default image)
#   gates prefix-cache [FLAGS]   `deltaserve gate prefix-cache` in bf16 on cuda on the trained dense / moe / next
#                                checkpoints: greedy tokens with the prefix cache on vs off, STRICT n/N each
#                                (gate-prefix-cache-V-bf16-TAG.json); FLAGS are the gate's own
#   gates mtp [FLAGS]            the bf16 MTP gates on cuda (deltaserve gate mtp: with MTP vs without, and vs vLLM's
#                                MTP arm in process: tokens and acceptance) on the trained dense / moe / next
#                                checkpoints, side by side on one GPU (--share-gpu); FLAGS are the gate's own
#                                (-k 1, --max-tokens, ...); gate-mtp-V-bf16-TAG.json
#   gates fp8 [FLAGS]            the FP8 token gates on cuda (deltaserve gate fp8: deltaserve against vLLM 0.26 in
#                                process, both serving the FP8 copy the gate writes of the dense-w128 / moe-w128 /
#                                next-w128 checkpoints, greedy, bf16), side by side on one GPU (--share-gpu). Those
#                                checkpoints are not shipped: train.py trains them on the GPU first (--device cuda,
#                                three at once) into $DS_W128 (kept for the next call on a warm machine; the
#                                record names the training device and the sha256s); FLAGS are the gate's own
#                                (--prompts text: held-out text instead of the random prompts); gate-fp8-V-w128-TAG.json
#   decode-step [FLAGS]          benchmarks/decode_step.py (FLAGS are its own: --batches, --shapes, --variants, ...),
#                                then graph_ms against the newest committed decode-step record
#                                (scripts/decode_step_compare.py; `--against RECORD` names another). FP8 shapes
#                                (--shapes 35b-a3b-fp8,27b-fp8,122b-a10b-fp8) write their FP8 dummies first, as the
#                                grid step does; the 122B-A10B needs an H200 and --batches up to 64
#                                (docs/fp8.md#the-h200-plan)
#   kernel-ab BASELINE [FLAGS]   a kernel against a baseline, timed in one call. BASELINE is an earlier kernel file
#                                (`git show REV:deltaserve/kernels/X.py > ab/X.py`: an untracked file travels with the
#                                tree) that replaces deltaserve's file of that name in a copy of the package, or a
#                                whole baseline tree (a folder holding deltaserve/); decode_step.py --baseline times
#                                both. A conv_triton.py goes to benchmarks/conv_prefill_sweep.py --baseline (the
#                                prefill conv, both kernels interleaved in one process)
#   mixed-step [FLAGS]           benchmarks/mixed_step.py (--shapes, --cases, --reps)
#   tune-moe [FLAGS]             benchmarks/tune_moe.py (--shape, --buckets, --budget-s; --fp8: the block-FP8 block's
#                                decode path against its served configs and the composition), tune-moe-TAG.json
#   verify-rows [FLAGS]          benchmarks/verify_rows.py on the trained dense / moe / next checkpoints in bf16 on
#                                cuda, eager: the first module whose verify row differs from the decode row, per
#                                prompt (verify-rows-V-TAG.json); FLAGS are its own (--num-prompts, --dtype, -k)
#   profile-decode [SHAPE] [FLAGS]  benchmarks/profile_decode.py on the dummy q35-SHAPE (default 35b-a3b)
#   vision-encode [FLAGS]        benchmarks/vision_encode.py on the image dummy q35-35b-a3b-mm (written if absent):
#                                host and GPU ms, kernels and ops of one tower call of 1 and 6 512x512 images
#                                (docs/multimodal.md#speed-under-image-traffic); vision-encode-TAG.json. Before /
#                                after in one call: `git show 717fa9e:deltaserve/model/vision.py > ab/vision.py`
#                                (an untracked file travels with the tree), then `vision-encode --baseline ab/vision.py`
#   profile-prefill [SHAPES] [FLAGS]  benchmarks/profile_prefill.py (one long prefill at a time: TTFT, GPU ms, per-op
#                                profile against the ceilings) on the dummy q35-SHAPE of each of the comma list SHAPES
#                                (default 27b,35b-a3b), one process and record each (profile-prefill-SHAPE-TAG.json),
#                                at h200_long.toml's --max-model-len 66560 unless FLAGS give one. Sized for one call: both
#                                shapes at the default --prompt-lens 16384, or one shape with --prompt-lens 65536
#   kernels [FLAGS]              deltaserve bench kernels (--models, --ops, --tokens)
#   fp8-ab [FLAGS]               benchmarks/fp8_ab.py: block-FP8 dense GEMMs and the FP8 fused MoE, deltaserve against
#                                vLLM's CUTLASS and Triton kernels, FlashInfer's fp8_blockscale_gemm_sm90 and DeepGEMM
#                                (each one that imports), with the FlashInfer bundle and the vLLM bundle on the path;
#                                FLAGS are its own (--models 35b-a3b,27b,122b-a10b, --ops dense,moe, --tokens,
#                                --arms, --check-only); --deadline-s defaults to what the budget leaves, so a cut
#                                call still returns the cases it timed (fp8-ab-TAG.json) and names the rest
#   attention-ab [FLAGS]         benchmarks/attention_ab.py: paged attention prefill at 2K-64K context, deltaserve
#                                against vLLM's FlashAttention 3 and FlashInfer's paged prefill (each one that
#                                imports), both bundles on the path; FLAGS are its own (--shapes 35b-a3b,27b,
#                                --cases 2048@57344,8x1024@0, --arms, --library-block-sizes 16,vllm, --check-only);
#                                --deadline-s defaults to what the budget leaves (attention-ab-TAG.json keeps the
#                                cases timed and names the rest)
#   gdn-prefill-ab [FLAGS]       benchmarks/oracle/gdn_prefill_kernels.py: the GDN prefill kernel alone, deltaserve's
#                                against vLLM's Triton/FLA and FlashInfer's CuTe-DSL ones, both shapes, ISL 1024 /
#                                3072 / 8 x 1024 / 16384, both bundles on the path; FLAGS are its own (--backends,
#                                ours-flashinfer: deltaserve's FlashInfer path as served, triton-served /
#                                flashinfer-served: vLLM's layer path; --cases 2048,4096,4x2048; --iters;
#                                --same-values; --profile); --deadline-s defaults to what the budget leaves
#                                (gdn-prefill-ab-TAG.json)
#   grid GRID [FLAGS]            deltaserve bench grid GRID (a path, or NAME for benchmarks/grids/NAME.toml or
#                                h200_NAME.toml) with FLAGS of `bench grid`; a --record-name whose record a cut call
#                                left in /tmp/ds_grid is resumed (--resume), and --deadline-s defaults to what the
#                                call's budget leaves. Returns the record, its console log and its -raw.tgz. A grid
#                                that names q35-*-fp8 models (h200_fp8.toml) writes those FP8 dummies first. On an
#                                H100 (nvidia-smi) it adds --card h100 unless FLAGS name a card: vLLM's peers then
#                                run at their h100-* sites (--max-num-seqs 256, deltaserve/bench/deviations.py).
#                                With the vLLM bundle unpacked and not FlashInfer's it adds --no-flashinfer: the
#                                peers at their Triton/FLA GDN prefill twins (the gdn-prefill-triton deviation)
#   tp SUBSTEP [FLAGS]           the two-GPU plan (kind nvidia-h200-x2): probe (NCCL all-reduce), tests
#                                (test_gpu_tensor_parallel), gate (scripts/tp_token_compare.py, the bf16 gate and
#                                the bf16 MTP gate, with MTP vs without, at -tp 2), kernels (bench kernels --tp 2),
#                                profile1 / profile2 (profile_decode at TP=1 / 2), grid (benchmarks/grids/h200_tp2.toml,
#                                grid FLAGS after it)
#
# env:  OUT                    where records come back (the device tool sets it; at most 8 files come back, so
#                              logs travel in one logs-STEP.tgz and many records in one archive)
#       DELTASERVE_GIT_COMMIT  the commit records name (the device's copy of the tree has no .git)
#       SHA256                 the vLLM bundle's sha256, in the call that carries its last piece
#       SHA256_FI              the FlashInfer bundle's sha256 (benchmarks/oracle/build_flashinfer_bundle.sh), likewise:
#                              the registry's production site (h200-offline) needs both bundles unpacked
#       CALL_BUDGET_S          seconds this call may use (default 570: the tool's 600 less saving and returning)
#       RECORD_TAG             the suffix of record names (default CARD-YYYYMMDD, UTC; CARD h200 or h100 as
#                              nvidia-smi names the GPU; a grid's --record-name h200_... / h100_... is renamed likewise)
#       DS_MODELS              the dummy checkpoints (default /tmp/ds_models)
#       DS_WORK                where logs are written before they are tarred (default /tmp/ds_run)
#       DS_W128                where `gates fp8` trains the -w128 checkpoints, or finds them (default /tmp/ds_w128)
#       DRY_RUN=1              print each command instead of running it (a check of the arguments, on any machine)
# Back in the repo: move the records into benchmarks/results/<kind>/ (benchmarks/results/INDEX.md says which
# kind) and run `deltaserve bench report`.
set -uo pipefail
cd "$(dirname "$0")/.."
step=${1:-}
if [ -z "$step" ] || [ "$step" = -h ] || [ "$step" = --help ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  [ -z "$step" ] && exit 2
  exit 0
fi
shift
: "${OUT:?set OUT: the folder whose files come back (the device tool sets it)}"
PY=${PY:-python3}
budget=${CALL_BUDGET_S:-570}
models=${DS_MODELS:-/tmp/ds_models}
w128=${DS_W128:-/tmp/ds_w128}
# the card the call got (calls that ask for an H200 may get an H100): records are named by it, so an H100's record
# is never filed as an H200's; without nvidia-smi (a dry run here) the historical h200
card=h200
if gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1) && [ -n "$gpu_name" ]; then
  case $gpu_name in
    *H100*) card=h100 ;;
    *H200*) card=h200 ;;
    *) card=gpu ;;
  esac
fi
tag=${RECORD_TAG:-$card-$(date -u +%Y%m%d)}
W=${DS_WORK:-/tmp/ds_run}/$step-$(date -u +%H%M%S)  # logs, tarred into $OUT at exit
mkdir -p "$W" "$OUT"
touch "$W/.start"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# NVLink multicast stays off in every process started from here (it can take the host's shared GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# deltaserve's own pins before the bundle; the bundle last (xgrammar 0.2.9 imports pydantic, which only it has)
export PYTHONPATH=$PWD:/tmp/ds_site:/tmp/vllm_site

say() { tee -a "$OUT/summary.txt"; }
mark() { echo "=== $* (${SECONDS} s)" | say; }
# seconds a command may take, keeping $1 (default 10) for what follows; never under 10
left() {
  local s=$((budget - SECONDS - ${1:-10}))
  echo $((s < 10 ? 10 : s))
}
# run LOG CMD...: CMD with its output in LOG (or, under DRY_RUN, the command line printed)
run() {
  local log=$1
  shift
  if [ -n "${DRY_RUN:-}" ]; then
    echo "+ $* > $log" | say
    return 0
  fi
  "$@" > "$log" 2>&1
}
trap 'tar -czf "$OUT/logs-$step.tgz" -C "$W" . 2>/dev/null' EXIT

setup() {
  local bundle
  for bundle in vllm fi; do
    if compgen -G ".${bundle}_chunk*" > /dev/null; then
      if [ $bundle = fi ]; then  # each bundle its own sha256: a call may carry the last pieces of both
        SHA256=${SHA256_FI:-} run "$W/unpack-$bundle.log" bash benchmarks/oracle/unpack.sh flashinfer
      else
        run "$W/unpack-$bundle.log" bash benchmarks/oracle/unpack.sh vllm
      fi
      tail -3 "$W/unpack-$bundle.log" 2> /dev/null | say
    fi
  done
  if compgen -G ".whl/*.whl" > /dev/null; then
    run "$W/pip.log" $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/ds_site .whl/*.whl || echo "wheel install failed: $(tail -2 "$W/pip.log")" | say
  fi
  if [ ! -f "$models/q35-35b-a3b/config.json" ] || [ ! -f "$models/q35-27b/config.json" ]; then
    run "$W/dummies.log" timeout 150 $PY benchmarks/oracle/make_dummy_models.py "$models" --only q35-35b-a3b,q35-27b
  fi
  local vllm=none fi=none
  [ -d /tmp/vllm_site/vllm ] && vllm=unpacked
  [ -d /tmp/flashinfer_site/flashinfer ] && fi=unpacked
  [ -d /tmp/store-vllm ] && [ "$vllm" = none ] && vllm="$(ls /tmp/store-vllm/part.* 2> /dev/null | wc -l) pieces stored"
  local gpus pins
  gpus=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2> /dev/null | sort | uniq -c | xargs)
  pins=$(ls /tmp/ds_site 2> /dev/null | wc -l)
  echo "setup: commit ${DELTASERVE_GIT_COMMIT:-unset}, vLLM bundle $vllm, FlashInfer bundle $fi, $pins pinned entries, dummies in $models," \
    "GPUs: ${gpus:-none}" | say
}

# stop a server that a grid killed outright (SIGKILL) left running: the grid notes its process group here
stop_leftover_server() {
  local pidf=${DELTASERVE_GRID_PIDFILE:-/tmp/deltaserve-grid-server.pgid} pg
  [ -f "$pidf" ] || return 0
  pg=$(cat "$pidf")
  echo "stopping the server a killed grid left behind (process group $pg)" | say
  [ -n "${DRY_RUN:-}" ] && return 0  # a dry run stops nothing
  kill -TERM -- "-$pg" 2> /dev/null
  sleep 10
  kill -KILL -- "-$pg" 2> /dev/null
  rm -f "$pidf"
}

grid() {  # GRID [bench grid flags]
  local file=$1 store=${GRID_STORE:-/tmp/ds_grid} name="" has_deadline="" has_resume="" has_card="" has_fi_flag="" prev=""
  shift
  for candidate in "$file" "benchmarks/grids/$file.toml" "benchmarks/grids/h200_$file.toml"; do
    [ -f "$candidate" ] && file=$candidate && break
  done
  [ -f "$file" ] || { echo "no grid file $file" | say; return 2; }
  for word in "$@"; do
    [ "$prev" = --record-name ] && name=$word
    [ "$word" = --deadline-s ] && has_deadline=1
    [ "$word" = --resume ] && has_resume=1
    [ "$word" = --card ] && has_card=1
    [ "$word" = --no-flashinfer ] && has_fi_flag=1
    prev=$word
  done
  local extra=()
  # a record name that names a card (h200_..., h100_...) names the one this call got
  if [ -n "$name" ] && [[ $name =~ ^h[0-9]+_ ]] && [ "${name%%_*}" != "$card" ] && [ "$card" != gpu ]; then
    local renamed=${card}_${name#*_} args=() word
    echo "record name $name names another card: $renamed" | say
    for word in "$@"; do [ "$word" = "$name" ] && args+=("$renamed") || args+=("$word"); done
    set -- "${args[@]}"
    name=$renamed
  fi
  # an 80 GB card (no H200 lent): the peers at their h100-* sites (vLLM's --max-num-seqs 256, deviations.py)
  if [ -z "$has_card" ] && [ "$card" = h100 ]; then
    echo "an H100: --card h100" | say
    extra+=(--card h100)
  fi
  # the vLLM bundle unpacked, FlashInfer's not (its pieces still to come): vLLM's own choice, FlashInfer's GDN
  # prefill, would fail at the first prefill, so the peers run at their Triton/FLA twins and say so (gdn-prefill-triton)
  if [ -d "${VLLM_SITE:-/tmp/vllm_site}/vllm" ] && [ ! -d "${FI_SITE:-/tmp/flashinfer_site}/flashinfer" ] \
    && [ -z "$has_fi_flag" ]; then
    echo "no FlashInfer bundle: --no-flashinfer" | say
    extra+=(--no-flashinfer)
  fi
  if [ -n "$name" ] && [ -z "$has_resume" ] && [ -f "$store/$name.json" ]; then
    echo "resuming $store/$name.json (a cut call left it)" | say
    extra+=(--resume "$store/$name.json")
  fi
  # deltaserve's servers and the client need fastapi / uvicorn: the vLLM bundle has them, and so do the pins when
  # .whl carries them (a deltaserve-only grid can then run while the bundle's pieces are still arriving)
  if [ ! -d /tmp/vllm_site/vllm ] && [ ! -d /tmp/ds_site/uvicorn ] && [ -z "${DRY_RUN:-}" ]; then
    echo "no /tmp/vllm_site/vllm and no uvicorn in /tmp/ds_site: carry the bundle pieces or .whl first (setup)" | say
    return 3
  fi
  local fp8
  fp8=$(grep -oE "q35-[a-z0-9-]+-fp8" "$file" | sort -u | paste -sd, -)
  if [ -n "$fp8" ]; then
    fp8_dummies "$fp8" || return 3
  fi
  if grep -q "q35-35b-a3b-mm" "$file"; then  # image traffic: the image dummy, checked as both servers read it
    run "$W/dummy-mm.log" timeout 120 $PY benchmarks/oracle/make_dummy_models.py "$models" --only q35-35b-a3b-mm \
      --check || { echo "the image dummy failed its checks: $(tail -3 "$W/dummy-mm.log")" | say; return 3; }
  fi
  stop_leftover_server
  mkdir -p "$store/raw"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv \
    > "$W/nvidia-smi.csv" 2>&1
  [ -n "$has_deadline" ] || extra+=(--deadline-s "$(left 40)")  # no launch that would end after the budget
  mark "grid $file $*"
  # the grid process: this tree, the pins and the bundle (fastapi, uvicorn: either has them) on its path
  PYTHONPATH=$PWD:/tmp/ds_site:/tmp/vllm_site DELTASERVE_MODELS=$models run "$W/grid.log" \
    timeout --signal=TERM --kill-after=20 "$(left 25)" $PY -m deltaserve.cli bench grid "$file" \
    --result-dir "$store" --raw-dir "$store/raw" "$@" "${extra[@]}"
  local rc=$?
  grep -E "^\[grid\]|rror" "$W/grid.log" 2> /dev/null | tail -16 | say
  local record=""
  for record in $(find "$store" -maxdepth 1 -name '*.json' -newer "$W/.start" 2> /dev/null); do
    local stem
    stem=$(basename "$record" .json)
    cp "$record" "$OUT/"
    cp "$W/grid.log" "$OUT/$stem.log"
  done
  # the run's client JSON and server logs (the records' `log` paths, relative to the store): this call's alone
  local raw
  raw=$(cd "$store" && find raw -type f -newer "$W/.start" 2> /dev/null | sort)
  [ -n "$record" ] && [ -n "$raw" ] && (cd "$store" && tar -czf "$OUT/$(basename "$record" .json)-raw.tgz" $raw)
  echo "grid rc $rc" | say
  return $rc
}

# fp8_dummies NAMES (comma list): the block-FP8 dummy folders (config.json with the releases' quantization_config,
# no weights), written by make_dummy_models.py into $models
fp8_dummies() {
  run "$W/dummy-fp8.log" timeout 150 $PY benchmarks/oracle/make_dummy_models.py "$models" --only "$1" \
    || { echo "the FP8 dummies failed: $(tail -3 "$W/dummy-fp8.log")" | say; return 3; }
}

decode_step() {  # RECORD [decode_step.py flags]: the run, its table in the summary
  local out=$1 prev="" word shapes="" fp8="" name
  shift
  for word in "$@"; do  # the shapes asked for (--shapes A,B or --shapes=A,B)
    [ "$prev" = --shapes ] && shapes=$word
    [[ $word == --shapes=* ]] && shapes=${word#--shapes=}
    prev=$word
  done
  # an FP8 shape (a decode_step.py key such as 27b-fp8, or its folder q35-27b-fp8) that make_dummy_models.py writes:
  # its dummy first, as the grid step writes it
  for name in ${shapes//,/ }; do
    name=q35-${name#q35-}
    if [[ $name == *-fp8 ]] && grep -q "\"$name\":" benchmarks/oracle/make_dummy_models.py; then
      fp8=${fp8:+$fp8,}$name
    fi
  done
  if [ -n "$fp8" ]; then
    fp8_dummies "$fp8" || return 3
  fi
  run "$W/$(basename "$out" .json).log" timeout "$(left 20)" $PY benchmarks/decode_step.py --models "$models" \
    --label after --out "$out" "$@"
  local rc=$?
  echo "decode_step rc $rc" | say
  grep -A16 "graph_ms by batch size" "$W/$(basename "$out" .json).log" 2> /dev/null | say
  return $rc
}

gpu_pytest() {  # LOG [pytest args]: verbose, so a run cut by the budget still names what passed
  local log=$1
  shift
  run "$log" timeout "$(left)" $PY -m pytest -v -m gpu -o addopts="" -p no:cacheprovider --import-mode=importlib "$@"
  local rc=$?
  local last
  last=$(grep -E "passed|failed|deselected|no tests ran" "$log" 2> /dev/null | tail -1)
  echo "pytest rc $rc: $(grep -cE " PASSED" "$log" 2> /dev/null) passed; $last" | say
  grep -E "(FAILED|ERROR)" "$log" 2> /dev/null | head -40 | say
  return $rc
}

gate_fp32() {  # the fp32 token gates on cuda: STRICT n/N first in each log
  local v rc status=0
  for v in ${VARIANTS:-dense moe next}; do
    run "$W/make-tiny-$v.log" $PY -m deltaserve.cli make-tiny "/tmp/tiny/$v" --variant "$v"
    run "$W/gate-fp32-$v.log" timeout "$(left)" $PY -m deltaserve.cli gate tokens --model "/tmp/tiny/$v" \
      --dtype float32 --device cuda --record "$OUT/gate-fp32-tiny-$v-cuda-$tag.json"
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "gate fp32 $v rc $rc: $(grep -m1 STRICT "$W/gate-fp32-$v.log" 2> /dev/null)" | say
  done
  return $status
}

library_ab() {  # NAME SCRIPT SUMMARY_PATTERN CASE_PATTERN [FLAGS]: benchmarks/SCRIPT.py, ours against the libraries
  local name=$1 script=$2 summary=$3 cases=$4 has_deadline="" word timed
  shift 4
  for word in "$@"; do [ "$word" = --deadline-s ] && has_deadline=1; done
  local deadline=()
  [ -n "$has_deadline" ] || deadline=(--deadline-s "$(left 40)")  # no case that would end after the budget
  # the FlashInfer bundle before vLLM's, as the registry's h200-offline-flashinfer site; its JIT build under /tmp
  # so a second call on the warm machine reuses it (a cut build resumes)
  run "$W/$name.log" env \
    PYTHONPATH="$PWD:/tmp/ds_site:/tmp/flashinfer_site:/tmp/flashinfer_site/nvidia_cutlass_dsl/dsl_packages:/tmp/vllm_site" \
    FLASHINFER_WORKSPACE_BASE=/tmp/fi_jit PYTHONUNBUFFERED=1 timeout --kill-after=10 "$(left 15)" $PY "benchmarks/$script.py" \
    --out "$OUT/$name-$tag.json" "${deadline[@]}" "$@" || status=$?
  grep -E "$summary" "$W/$name.log" 2> /dev/null | head -60 | say
  cp "$W/$name.log" "$OUT/$name-$tag.log" 2> /dev/null  # the record's console log, filed beside it
  timed=$(grep -cE "$cases" "$W/$name.log" 2> /dev/null)
  echo "$name rc $status: ${timed:-0} cases timed" | say
}

gate_prefix_cache() {  # cache on vs off, bf16 on cuda, the trained checkpoints shipped with the package
  local v rc status=0
  for v in ${VARIANTS:-dense moe next}; do
    run "$W/gate-prefix-cache-$v.log" timeout "$(left)" $PY -m deltaserve.cli gate prefix-cache \
      --model "deltaserve/tiny/trained/$v" --dtype bfloat16 --device cuda \
      --record "$OUT/gate-prefix-cache-$v-bf16-$tag.json" "$@"
    rc=$?
    [ $rc -ne 0 ] && status=$rc
    echo "gate prefix-cache $v rc $rc: $(grep -m1 STRICT "$W/gate-prefix-cache-$v.log" 2> /dev/null)" | say
    grep -E "^  mismatch|^hits|yardstick" "$W/gate-prefix-cache-$v.log" 2> /dev/null | say
  done
  return $status
}

gate_mtp() {  # [FLAGS]: the three bf16 MTP gates at once on one GPU, each against vLLM's MTP arm in process
  if [ ! -d /tmp/vllm_site/vllm ] && [ -z "${DRY_RUN:-}" ]; then
    echo "no /tmp/vllm_site/vllm: carry the bundle pieces first (setup); the gate's vLLM reference needs it" | say
    return 3
  fi
  local v i rc status=0 limit variants=(${VARIANTS:-dense moe next}) pids=()
  limit=$(left 20)
  for v in "${variants[@]}"; do
    run "$W/gate-mtp-$v.log" timeout "$limit" $PY -m deltaserve.cli gate mtp --model "deltaserve/tiny/trained/$v" \
      --dtype bfloat16 --device cuda --reference vllm --share-gpu --record "$OUT/gate-mtp-$v-bf16-$tag.json" "$@" &
    pids+=($!)
    [ -n "${DRY_RUN:-}" ] || sleep 2  # staggered starts: the CUDA contexts and first compiles do not all land at once
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "gate mtp ${variants[$i]} rc $rc:" | say
    grep -E "^STRICT|^acceptance|^per-position|^against vLLM|^yardstick|REFUSED" "$W/gate-mtp-${variants[$i]}.log" 2> /dev/null | say
  done
  return $status
}

gate_fp8() {  # [FLAGS]: the three FP8 token gates at once on one GPU, each against vLLM in process
  if [ ! -d /tmp/vllm_site/vllm ] && [ -z "${DRY_RUN:-}" ]; then
    echo "no /tmp/vllm_site/vllm: carry the bundle pieces first (setup); the gate's vLLM reference needs it" | say
    return 3
  fi
  local v i rc status=0 limit variants=(${VARIANTS:-dense moe next}) pids=() trained=() ready=()
  # the -w128 checkpoints are trained here, not shipped (docs/fp8.md: the tree and a bundle piece must fit one carry)
  limit=$(left 30)
  for v in "${variants[@]}"; do
    if [ -f "$w128/$v-w128/training.json" ]; then  # train.py installs a folder whole (staging, then rename)
      echo "train $v-w128: reusing $w128/$v-w128 (trained by an earlier call on this machine)" | say
      continue
    fi
    run "$W/train-$v-w128.log" timeout "$limit" $PY -m deltaserve.tiny.train "$w128/$v-w128" \
      --variant "$v-w128" --device cuda &
    pids+=($!)
    trained+=("$v")
  done
  for ((i = 0; i < ${#pids[@]}; i++)); do
    wait "${pids[$i]}"
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "train ${trained[$i]}-w128 on cuda rc $rc: $(grep -m1 '^train\[' "$W/train-${trained[$i]}-w128.log" 2> /dev/null)" | say
  done
  for v in "${variants[@]}"; do  # a variant whose training failed has no checkpoint to gate
    if [ -f "$w128/$v-w128/training.json" ] || [ -n "${DRY_RUN:-}" ]; then
      ready+=("$v")
    else
      echo "gate fp8 $v-w128: not run, its training failed (logs-gates.tgz: train-$v-w128.log)" | say
    fi
  done
  [ ${#ready[@]} -eq 0 ] && return 1
  variants=("${ready[@]}")
  pids=()
  limit=$(left 20)
  for v in "${variants[@]}"; do
    run "$W/gate-fp8-$v.log" timeout "$limit" $PY -m deltaserve.cli gate fp8 --model "$w128/$v-w128" \
      --fp8-dir "/tmp/ds_fp8/$v-w128" --dtype bfloat16 --device cuda --share-gpu \
      --record "$OUT/gate-fp8-$v-w128-$tag.json" "$@" &
    pids+=($!)
    [ -n "${DRY_RUN:-}" ] || sleep 2  # staggered starts: the CUDA contexts and first compiles do not all land at once
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "gate fp8 ${variants[$i]}-w128 rc $rc:" | say
    grep -E "^STRICT|^  prompt|REFUSED|nothing to check" "$W/gate-fp8-${variants[$i]}.log" 2> /dev/null | say
  done
  return $status
}

mark "$step $* (commit ${DELTASERVE_GIT_COMMIT:-unset}, $(date -u +%FT%TZ), budget ${budget} s)"
setup
status=0
case $step in
  setup) ;;
  tests)
    [ $# -gt 0 ] || set -- tests --ignore=tests/api --ignore=tests/bench
    # WITH_FLASHINFER=1: the FlashInfer bundle on the path too (the -m gpu tests of --gdn-prefill-backend flashinfer
    # skip without it); off by default, so no other test finds a FlashInfer it did not ask for
    if [ -n "${WITH_FLASHINFER:-}" ]; then
      echo "tests: the FlashInfer bundle on the path (WITH_FLASHINFER)" | say
      PYTHONPATH=$PWD:/tmp/ds_site:/tmp/flashinfer_site:/tmp/flashinfer_site/nvidia_cutlass_dsl/dsl_packages:/tmp/vllm_site \
        FLASHINFER_WORKSPACE_BASE=/tmp/fi_jit gpu_pytest "$OUT/pytest-gpu-$tag.log" "$@" || status=$?
    else
      gpu_pytest "$OUT/pytest-gpu-$tag.log" "$@" || status=$?
    fi ;;
  gates)
    what=${1:-fp32}
    shift || true
    case $what in
      fp32) gate_fp32 || status=$? ;;
      prefix-cache) gate_prefix_cache "$@" || status=$? ;;
      mtp) gate_mtp "$@" || status=$? ;;
      fp8) gate_fp8 "$@" || status=$? ;;
      bf16 | media)
        script=benchmarks/oracle/gates_shared.sh
        [ "$what" = media ] && script=benchmarks/oracle/media_gate_runs.sh
        run "$W/$what.log" env OUT="$W/$what" STAGE="${1:-transformers}" MEDIA="${1:-image}" \
          GATE_TIMEOUT_S="$(left 20)" timeout "$(left 10)" bash "$script" || status=$?
        grep -E "^===|^STRICT|^rc|REFUSED|Error" "$W/$what.log" 2> /dev/null | say
        tar -czf "$OUT/gates-$what-${1:-all}-$tag.tgz" -C "$W/$what" . 2> /dev/null ;;
      *) echo "gates: fp32, bf16 STAGE, media MEDIA, prefix-cache [FLAGS], mtp [FLAGS] or fp8 [FLAGS], not $what" | say; status=2 ;;
    esac ;;
  decode-step)
    against=()
    args=()
    while [ $# -gt 0 ]; do
      case $1 in
        --against) against=(--against "$2"); shift 2 ;;
        *) args+=("$1"); shift ;;
      esac
    done
    decode_step "$OUT/decode-step-$tag.json" "${args[@]}" || status=$?
    run "$W/compare.log" $PY scripts/decode_step_compare.py "$OUT/decode-step-$tag.json" "${against[@]}"
    compare=$?
    cat "$W/compare.log" 2> /dev/null | say
    [ $status -eq 0 ] && status=$compare ;;
  kernel-ab)
    base=${1:?kernel-ab: name the baseline (an earlier kernel file, or a tree holding deltaserve/)}
    shift
    if [ ! -f "$base" ] && [ ! -d "$base/deltaserve" ]; then
      echo "kernel-ab: $base is neither a kernel file nor a tree holding deltaserve/ (an ignored path needs carry)" \
        | say
      exit 2
    fi
    if [ "$(basename "$base")" = conv_triton.py ] && [ -f "$base" ]; then
      run "$W/conv-ab.log" timeout "$(left)" $PY benchmarks/conv_prefill_sweep.py --baseline "$base" --only-baseline \
        --out "$OUT/conv-prefill-ab-$tag.json" "$@" || status=$?
      grep -v Warn "$W/conv-ab.log" 2> /dev/null | tail -20 | say
    else
      tree=$base
      if [ -f "$base" ]; then
        targets=$(find deltaserve -name "$(basename "$base")" -path '*.py' -not -path '*/__pycache__/*')
        if [ "$(echo "$targets" | grep -c .)" -ne 1 ]; then
          echo "kernel-ab: $(basename "$base") names $(echo "$targets" | grep -c .) files under deltaserve/" | say
          exit 2
        fi
        tree=${DS_WORK:-/tmp/ds_run}/ab-$(basename "$base" .py)
        rm -rf "$tree" && mkdir -p "$tree" && cp -r deltaserve "$tree/" && cp "$base" "$tree/$targets"
        echo "kernel-ab: baseline tree $tree: this tree's deltaserve/ with $targets from $base" | say
      fi
      decode_step "$OUT/decode-step-ab-$tag.json" --baseline "$tree" "$@" || status=$?
    fi ;;
  verify-rows)
    for v in ${VARIANTS:-dense moe next}; do
      run "$W/verify-rows-$v.log" timeout "$(left)" $PY benchmarks/verify_rows.py --model "deltaserve/tiny/trained/$v" \
        --dtype bfloat16 --device cuda --out "$OUT/verify-rows-$v-$tag.json" "$@"
      rc=$?
      [ $rc -eq 1 ] || [ $rc -eq 0 ] || status=$rc
      grep -E "^verify rows" "$W/verify-rows-$v.log" 2> /dev/null | say
    done ;;
  mixed-step)
    run "$W/mixed-step.log" timeout "$(left)" $PY benchmarks/mixed_step.py --models "$models" \
      --out "$OUT/mixed-step-$tag.json" "$@" || status=$?
    grep -E "^  |FAILED|case," "$W/mixed-step.log" 2> /dev/null | say ;;
  tune-moe)
    run "$W/tune-moe.log" timeout "$(left)" $PY benchmarks/tune_moe.py --out "$OUT/tune-moe-$tag.json" "$@" \
      || status=$?
    grep -E "^bucket|^tuned" "$W/tune-moe.log" 2> /dev/null | say ;;
  vision-encode)
    [ -f "$models/q35-35b-a3b-mm/config.json" ] \
      || run "$W/dummy-mm.log" timeout 120 $PY benchmarks/oracle/make_dummy_models.py "$models" --only q35-35b-a3b-mm \
      || { echo "the image dummy failed: $(tail -3 "$W/dummy-mm.log")" | say; status=3; }
    if [ "$status" -eq 0 ]; then
      run "$W/vision-encode.log" timeout "$(left)" $PY benchmarks/vision_encode.py --model "$models/q35-35b-a3b-mm" \
        --out "$OUT/vision-encode-$tag.json" "$@" || status=$?
      grep -E "^  |record" "$W/vision-encode.log" 2> /dev/null | say
    fi ;;
  profile-decode)
    shape=35b-a3b
    [ $# -gt 0 ] && [ "${1#-}" = "$1" ] && shape=$1 && shift
    run "$W/profile-decode.log" timeout "$(left)" $PY benchmarks/profile_decode.py --model "$models/q35-$shape" \
      --out "$OUT/profile-decode-$shape-$tag.json" "$@" || status=$?
    grep -v "USDT\|UserWarning\|_warn_once" "$W/profile-decode.log" 2> /dev/null | tail -12 | say ;;
  fp8-ab) library_ab fp8-ab fp8_ab "^arm |DISAGREES|ERROR|^adopt |^skipped|^record|Traceback|Error:" '^(dense|moe) ' \
    "$@" ;;
  attention-ab)
    library_ab attention-ab attention_ab "^arm |DISAGREES|ERROR|^adopt |^range |^skipped|^record|Traceback|Error:" \
      '^attention ' "$@" ;;
  gdn-prefill-ab)
    library_ab gdn-prefill-ab oracle/gdn_prefill_kernels '^\{|^skipped|Traceback|Error:' '^\{' \
      --backends ours,triton,flashinfer --commit "${DELTASERVE_GIT_COMMIT:-unset}" "$@" ;;
  profile-prefill)
    shapes=27b,35b-a3b
    [ $# -gt 0 ] && [ "${1#-}" = "$1" ] && shapes=$1 && shift
    IFS=, read -ra names <<< "$shapes"
    for i in "${!names[@]}"; do
      m=${names[$i]}
      # the time left is shared evenly by the shapes still to run; --max-model-len is benchmarks/grids/h200_long.toml's
      # (where the long-prompt TTFT is measured), and one in FLAGS wins (argparse keeps the last)
      run "$W/profile-prefill-$m.log" timeout "$(($(left) / (${#names[@]} - i)))" $PY benchmarks/profile_prefill.py \
        --model "$models/q35-$m" --max-model-len 66560 --out "$OUT/profile-prefill-$m-$tag.json" "$@" || status=1
      grep -E "^(engine ready|prompt|prefill of|CHECK)|^  [a-z]" "$W/profile-prefill-$m.log" 2> /dev/null | head -80 | say
    done ;;
  kernels)
    run "$W/kernels.log" timeout "$(left)" $PY -m deltaserve.cli bench kernels --out "$OUT/kernels-$tag.json" "$@" \
      || status=$?
    tail -30 "$W/kernels.log" 2> /dev/null | say ;;
  grid)
    grid "${1:?grid: name a grid file}" "${@:2}" || status=$? ;;
  tp)
    sub=${1:?tp: probe, tests, gate, kernels, profile1, profile2 or grid}
    shift
    case $sub in
      probe)
        run "$W/probe.log" timeout 120 $PY - << 'PY' || status=$?
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    print("rank", rank, "all-reduce", t.tolist(), flush=True)
    dist.destroy_process_group()


print("cuda devices:", torch.cuda.device_count(), "torch", torch.__version__)
if torch.cuda.device_count() >= 2:
    mp.spawn(run, nprocs=2)
PY
        cat "$W/probe.log" 2> /dev/null | say ;;
      tests) gpu_pytest "$OUT/pytest-gpu-tp2-$tag.log" tests/runner/test_gpu_tensor_parallel.py "$@" || status=$? ;;
      gate)
        for v in ${VARIANTS:-dense moe next}; do
          run "$W/make-tiny-$v.log" $PY -m deltaserve.cli make-tiny "/tmp/tiny/$v" --variant "$v"
          run "$W/tp-compare-$v.log" timeout 170 $PY scripts/tp_token_compare.py --model "/tmp/tiny/$v" --tp 2 \
            --dtype bfloat16 --device cuda --out "$OUT/tp-compare-bf16-$v-$tag.json" || status=1
          tail -4 "$W/tp-compare-$v.log" 2> /dev/null | say
          run "$W/gate-tp2-$v.log" timeout 150 $PY -m deltaserve.cli gate tokens --model "/tmp/tiny/$v" \
            --dtype bfloat16 --device cuda -tp 2 || status=1
          echo "gate bf16 -tp 2 $v: $(grep -m1 STRICT "$W/gate-tp2-$v.log" 2> /dev/null)" | say
          run "$W/gate-mtp-tp2-$v.log" timeout 170 $PY -m deltaserve.cli gate mtp --model "deltaserve/tiny/trained/$v" \
            --dtype bfloat16 --device cuda -tp 2 || status=1
          echo "gate mtp bf16 -tp 2 $v: $(grep -m1 STRICT "$W/gate-mtp-tp2-$v.log" 2> /dev/null)" | say
        done ;;
      kernels)
        for m in 35b-a3b 27b; do
          run "$W/kernels-tp2-$m.log" timeout 270 $PY -m deltaserve.cli bench kernels --tp 2 --models "$m" \
            --out "$OUT/kernels-tp2-$m-$tag.json" "$@" || status=1
          tail -12 "$W/kernels-tp2-$m.log" 2> /dev/null | say
        done ;;
      profile1 | profile2)
        for m in ${PROFILE_SHAPES:-35b-a3b 27b}; do
          run "$W/profile-tp${sub#profile}-$m.log" timeout 270 $PY benchmarks/profile_decode.py \
            --model "$models/q35-$m" --batches "${PROFILE_BATCHES:-1,8,32,64}" --staggered 8 --steps 20 \
            --tensor-parallel-size "${sub#profile}" --out "$OUT/profile-decode-tp${sub#profile}-$m-$tag.json" \
            "$@" || status=1
          tail -8 "$W/profile-tp${sub#profile}-$m.log" 2> /dev/null | say
        done ;;
      grid) grid benchmarks/grids/h200_tp2.toml "$@" || status=$? ;;
      *) echo "tp: probe, tests, gate, kernels, profile1, profile2 or grid, not $sub" | say; status=2 ;;
    esac ;;
  *) echo "unknown step $step (bash scripts/h200.sh --help)" | say; status=2 ;;
esac
mark "done, status $status"
exit $status
