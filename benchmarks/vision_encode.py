"""The vision tower's cost in one engine step: one `VisionTower.encode` call of N images of one size, eager and from
host patch rows, as the runner makes it (docs/multimodal.md#speed-under-image-traffic).

Run on the H200 from the repo root (no server; dummy weights; `bash scripts/h200.sh vision-encode` wraps it):
    python3 benchmarks/vision_encode.py --model /tmp/ds_models/q35-35b-a3b-mm --images 1,6
For each image count (random-mm's 512x512 by default: 1024 patches, 256 tokens each), medians over --reps, each rep
starting on an idle GPU: `host_ms`, the wall time until the call returns (the host has issued every launch);
`gpu_ms`, CUDA events around the call (first launch to last kernel's end); then one call under torch.profiler:
`kernels` (CUDA kernels launched), `ops` (top-level torch ops) and `kernel_ms` (the kernels' summed GPU time). A
call whose `gpu_ms` is near its `host_ms` and well above its `kernel_ms` is launch-bound: the GPU waits on the host.
The weights are U(-1e-3, 1e-3) (the timing does not depend on their values). The record goes to --out (default
benchmarks/results/kernels/vision-encode-<UTC time>.json). `--baseline FILE` times an earlier `model/vision.py` too
(`git show REV:deltaserve/model/vision.py > ab/vision.py`), with the same weights, in the same process, arm by arm
per image count, and checks that both give the same output bits. `--device cpu` checks the plumbing on a reduced
--depth (host timer only, no kernels). Exits 2 without CUDA unless --device cpu, 1 if the arms' outputs differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_step as ds  # noqa: E402  (same folder: record paths)

from deltaserve.config import ModelConfig  # noqa: E402
from deltaserve.model.vision import VisionTower  # noqa: E402


def load_tower_class(path: Path) -> type:
    """VisionTower from an earlier copy of deltaserve/model/vision.py."""
    spec = importlib.util.spec_from_file_location("baseline_vision", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.VisionTower


def build_tower(
    model_dir: Path, device: torch.device, dtype: torch.dtype, depth: int | None, cls: type = VisionTower
) -> VisionTower:
    vision = ModelConfig.from_pretrained(model_dir).vision
    if vision is None:
        raise SystemExit(f"{model_dir} has no vision_config")
    if depth is not None:
        vision = dataclasses.replace(vision, depth=depth)
    tower = cls(vision, dtype, device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in tower.parameters():
            param.uniform_(-1e-3, 1e-3, generator=generator)
    return tower


def measure(tower: VisionTower, num_images: int, side: int, reps: int) -> tuple[dict[str, Any], torch.Tensor]:
    """The row of one tower at one image count, and the output of its last call."""
    config = tower.config
    grid = (1, side // config.patch_size, side // config.patch_size)
    rows = grid[1] * grid[2]
    generator = torch.Generator().manual_seed(num_images)
    pixels = torch.randn(num_images * rows, config.patch_dim, generator=generator)  # fp32 host rows, as the runner's
    items = [(pixels[i * rows : (i + 1) * rows], grid) for i in range(num_images)]
    is_cuda = tower.patch_weight.is_cuda
    host_ms, gpu_ms = [], []
    with torch.inference_mode():
        for rep in range(reps + 2):  # two untimed calls first: cuBLAS handles, allocator, pinned blocks
            if is_cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            began = time.perf_counter()
            tower.encode(items)
            issued = time.perf_counter()
            if is_cuda:
                end.record()
                end.synchronize()
            if rep >= 2:
                host_ms.append((issued - began) * 1e3)
                if is_cuda:
                    gpu_ms.append(start.elapsed_time(end))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
        with profile(activities=activities) as prof:
            output = torch.cat(tower.encode(items))
            if is_cuda:
                torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "images": num_images,
        "side": side,
        "patches": num_images * rows,
        "host_ms": statistics.median(host_ms),
        "gpu_ms": statistics.median(gpu_ms) if gpu_ms else None,
        "ops": sum(1 for e in events if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU),
        "kernels": len(kernels),
        "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3 if is_cuda else None,
    }, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint folder with a vision_config")
    parser.add_argument("--images", default="1,6", help="comma list of image counts per call")
    parser.add_argument("--side", type=int, default=512, help="image side in pixels (a multiple of 32)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--depth", type=int, default=None, help="fewer blocks than the config (CPU plumbing)")
    parser.add_argument("--baseline", type=Path, default=None, help="an earlier model/vision.py, timed too")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for the plumbing check)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tower = build_tower(args.model, device, dtype, args.depth)
    arms = {"current": tower}
    if args.baseline is not None:
        baseline = build_tower(args.model, device, dtype, args.depth, load_tower_class(args.baseline))
        baseline.load_state_dict(tower.state_dict())
        arms["baseline"] = baseline
    record: dict[str, Any] = {
        "kind": "vision-encode",
        "model": str(args.model),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "depth": tower.config.depth,
        "baseline": None if args.baseline is None else str(args.baseline),
        "rows": [],
    }
    out = args.out or ds.default_out("vision-encode")
    status = 0
    for count in (int(v) for v in args.images.split(",")):
        outputs = {}
        for arm, model in arms.items():
            row, outputs[arm] = measure(model, count, args.side, args.reps)
            row = {"arm": arm, **row}
            if arm == "baseline":
                row["is_bit_equal"] = bool(torch.equal(outputs["current"], outputs["baseline"]))
                status = status or (0 if row["is_bit_equal"] else 1)
            record["rows"].append(row)
            print("  " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=1) + "\n")  # after every row: a cut run keeps what it measured
    print(f"record: {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
