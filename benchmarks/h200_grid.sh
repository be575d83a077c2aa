#!/usr/bin/env bash
# The H200 grid harness (benchmarks/grids/h200_first.toml): deltaserve against vLLM 0.26.0 in its production
# configuration. Runs on the offline H200 from the repo root, after benchmarks/oracle/unpack.sh has unpacked
# the vLLM bundle into /tmp/vllm_site. Peer commands come from the oracle registry through the grid; this
# script never spells out a server launch.
#
# usage: OUT=... bash benchmarks/h200_grid.sh [bench grid flags...]
#   e.g. --models q35-35b-a3b --arms deltaserve,vllm --deadline-s 540
# env:   OUT                    where the record, per-run JSON and server logs go (the device tool's $OUT)
#        DELTASERVE_MODELS      dummy checkpoints (default /tmp/ds_models; made here when missing; /tmp persists)
#        DELTASERVE_GIT_COMMIT  the project commit to record (the device copy has no .git)
#        GRID                   grid file (default benchmarks/grids/h200_first.toml)
#        GRID_TIMEOUT_S         SIGTERM the grid after this long (default 570), so it stops its server and
#                               saves its record before the device tool's own 600 s limit
#        GRID_STORE             where records and raw files live between calls (default /tmp/ds_grid: /tmp
#                               persists on a live host, so a later call can `--resume $GRID_STORE/NAME.json`)
# $OUT gets back every record, raw.tgz (per-run client JSON and server logs) and nvidia-smi.csv: the device
# returns at most 8 files.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the output folder}"
export DELTASERVE_MODELS=${DELTASERVE_MODELS:-/tmp/ds_models}
GRID=${GRID:-benchmarks/grids/h200_first.toml}
GRID_STORE=${GRID_STORE:-/tmp/ds_grid}
mkdir -p "$OUT" "$GRID_STORE/raw"

# A grid killed outright (SIGKILL) on a previous call leaves its server running; its process group id is noted
# here by the grid itself, so stop exactly that group before starting.
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
# The grid process itself needs aiohttp/tqdm/transformers (host) and finds fastapi/uvicorn in the bundle.
export PYTHONPATH="$PWD:/tmp/vllm_site"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

for m in q35-35b-a3b q35-27b; do
  if [ ! -f "$DELTASERVE_MODELS/$m/config.json" ]; then
    python3 benchmarks/oracle/make_dummy_models.py "$DELTASERVE_MODELS"
    break
  fi
done

# (transformers is checked by the grid itself, which loads every tokenizer before starting a server)
python3 -c "import aiohttp, numpy, tqdm, fastapi, uvicorn, deltaserve.bench.grid" \
  || { echo "missing Python packages for the grid (see above)"; exit 3; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv \
  > "$OUT/nvidia-smi.csv" 2>&1 || true

# For the log: the production commands the registry builds (the grid builds the same ones).
for m in q35-35b-a3b q35-27b; do
  echo "registry: $(python3 -m deltaserve.bench.registry --model "$DELTASERVE_MODELS/$m" --input-len 1024 \
    -- --max-model-len 4096 --gpu-memory-utilization 0.85)"
done

status=0
timeout --signal=TERM --kill-after=20 "${GRID_TIMEOUT_S:-570}" \
  python3 -m deltaserve.cli bench grid "$GRID" --result-dir "$GRID_STORE" --raw-dir "$GRID_STORE/raw" "$@" \
  || status=$?

# The report is regenerated locally from the committed records (`deltaserve bench report`).
cp "$GRID_STORE"/*.json "$OUT"/ 2>/dev/null || true
tar -czf "$OUT/raw.tgz" -C "$GRID_STORE" raw
exit $status
