#!/usr/bin/env bash
# The image-traffic grid (issue 14 item 6; benchmarks/grids/h200_image.toml) in ONE device call: deltaserve against
# vLLM 0.26.0 serving the 35B-A3B dummy WITH its vision tower (the registry builds vLLM's launch without
# --language-model-only for image traffic), random-mm traffic (1024 text tokens + one 512x512 image / 128 out) at
# c1 / c8 / c32, then the drift re-run of deltaserve at c8 if the deadline leaves room. Runs from the repo root on
# the offline H200 after benchmarks/oracle/unpack.sh has unpacked the vLLM bundle into /tmp/vllm_site.
#
# usage: OUT=... DELTASERVE_GIT_COMMIT=<sha> bash scripts/h200_image_grid.sh [bench grid flags, e.g. --no-drift]
# env:   DELTASERVE_MODELS  dummy checkpoints (default /tmp/ds_models); q35-35b-a3b-mm is (re)written here (~15 s)
#        GRID_STORE         records and raw files between calls (default /tmp/ds_grid_image), for a later
#                           `--resume $GRID_STORE/<record>.json` on the same live host
#        DEADLINE_S         the grid starts no launch expected to end later (default 505 s after the grid starts)
#        GRID_TIMEOUT_S     SIGTERM the grid after this long (default 515 s): it stops its server and saves its record
# Every step is time-limited: ~20 s before the grid + at most GRID_TIMEOUT_S (+20 s to stop) = at most ~555 s;
# expected ~440-500 s. $OUT gets the record(s) (h200_image-*.json; one on a fresh host), raw.tgz (per-run client JSON
# and server logs), nvidia-smi.csv and image_grid.log (this script's output, also on stdout).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the output folder}"
export DELTASERVE_MODELS=${DELTASERVE_MODELS:-/tmp/ds_models}
GRID_STORE=${GRID_STORE:-/tmp/ds_grid_image}
DEADLINE_S=${DEADLINE_S:-505}
GRID_TIMEOUT_S=${GRID_TIMEOUT_S:-515}
mkdir -p "$OUT" "$GRID_STORE/raw"
exec > >(tee -a "$OUT/image_grid.log") 2>&1
t0=$(date +%s)

# A grid killed outright on a previous call leaves its server running; the grid notes its process group here.
pidf=${DELTASERVE_GRID_PIDFILE:-/tmp/deltaserve-grid-server.pgid}
if [ -f "$pidf" ]; then
  pg=$(cat "$pidf")
  echo "stopping the server a killed grid left behind (process group $pg)"
  kill -TERM -- "-$pg" 2>/dev/null || true
  sleep 10
  kill -KILL -- "-$pg" 2>/dev/null || true
  rm -f "$pidf"
fi

if [ ! -d /tmp/vllm_site/vllm ]; then
  echo "no /tmp/vllm_site/vllm: send .vllm_chunk, then .vllm_chunk2 with SHA256 set, through benchmarks/oracle/unpack.sh"
  exit 3
fi
export PYTHONPATH="$PWD:/tmp/vllm_site"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 60 python3 -c "import aiohttp, numpy, tqdm, fastapi, uvicorn, PIL, deltaserve.bench.grid" \
  || { echo "missing Python packages for the grid (see above)"; exit 3; }

# The image dummy, then the checks that both servers will read it as intended with this host's transformers
# (AutoConfig, AutoTokenizer with the image placeholder, deltaserve's config and processor); exit 3 on a failure.
timeout 120 python3 benchmarks/oracle/make_dummy_models.py "$DELTASERVE_MODELS" --only q35-35b-a3b-mm --check \
  || { echo "the image dummy failed its checks (above): no server started"; exit 3; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv \
  > "$OUT/nvidia-smi.csv" 2>&1 || true
# For the log: vLLM's production command for image traffic as the registry builds it (the grid builds the same).
echo "registry: $(timeout 60 python3 -m deltaserve.bench.registry --model "$DELTASERVE_MODELS/q35-35b-a3b-mm" \
  --input-len 1024 --serves-media -- --max-model-len 4096 --gpu-memory-utilization 0.85)"
echo "pre-grid steps: $(( $(date +%s) - t0 )) s"

record="h200_image-$(date +%Y%m%d-%H%M%S)"
status=0
timeout --signal=TERM --kill-after=20 "$GRID_TIMEOUT_S" \
  python3 -m deltaserve.cli bench grid benchmarks/grids/h200_image.toml --result-dir "$GRID_STORE" \
    --raw-dir "$GRID_STORE/raw" --record-name "$record" --deadline-s "$DEADLINE_S" "$@" \
  || status=$?

# this call's record, or the one it resumed (--resume), and any earlier image record kept in the store
cp "$GRID_STORE"/h200_image-*.json "$OUT"/ 2>/dev/null || echo "no record was written"
tar -czf "$OUT/raw.tgz" -C "$GRID_STORE" raw
echo "wall $(( $(date +%s) - t0 )) s, grid exit status $status"
exit $status
