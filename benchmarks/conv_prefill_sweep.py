"""Tile sweep of the GDN prefill conv (`_causal_conv1d_prefill_kernel`) at the served shapes, on the H200.

The kernel is one [BLOCK_T, BLOCK_C] tile a program: it is bound by instructions, not bytes, so its tile and warps
matter. For each case (the conv input as the layer passes it: a [T, conv_dim] column slice of the in_proj output)
this times the committed configuration through `causal_conv1d_prefill_triton` (both launches: conv and history
write-back), then the conv launch alone at every (BLOCK_T, BLOCK_C, warps) of the sweep, checks each output is
bit-equal to the committed one, and reports microseconds and achieved bandwidth against a copy of the same bytes
measured in the run. Picks the configuration with the smallest sum over the cases.

    python3 benchmarks/conv_prefill_sweep.py --out $OUT/conv-prefill-sweep.json

With --baseline FILE (an earlier conv_triton.py, e.g. `git show REV:deltaserve/kernels/conv_triton.py > FILE`)
it also times that file's conv kernel at the committed tile, interleaved with the current one, and checks the two
outputs are bit-equal: a before / after of a kernel change in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltaserve.bench.kernels import event_times_ms  # noqa: E402
from deltaserve.kernels import conv_triton  # noqa: E402

KERNEL_SIZE = 4
# (label, conv channels, in_proj output width (the row stride the layer passes), sequence lengths)
CASES = (
    ("27b-1x2048", 10240, 16480, (2048,)),
    ("27b-2x1024", 10240, 16480, (1024, 1024)),
    ("35b-a3b-1x2048", 8192, 12352, (2048,)),
    ("35b-a3b-8x1024", 8192, 12352, (1024,) * 8),
)
BLOCK_TS = (16, 32, 64)
BLOCK_CS = (128, 256, 512)
WARPS = (4, 8)


def time_us(fn: Any, reps: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean CUDA-event time of `reps` back-to-back calls, in microseconds."""
    fn()
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(reps):
            fn()

    return statistics.median(ms * 1000.0 / reps for ms in event_times_ms(run, repeats))


def load_module(path: Path) -> Any:
    """A kernel module from a file (the baseline of an A/B)."""
    spec = importlib.util.spec_from_file_location("conv_triton_baseline", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_conv(
    case: dict[str, Any], out: torch.Tensor, block_t: int, block_c: int, num_warps: int, module: Any = conv_triton
) -> None:
    """The conv launch alone (no history write-back), at the given tile, of `module`'s kernel."""
    conv_triton.launch_prefill_conv(
        module._causal_conv1d_prefill_kernel, case["x"], case["weight"], case["states"], case["qsl"], case["slots"],
        case["init"], out, block_t, block_c, num_warps,
    )  # fmt: skip


def make_case(channels: int, width: int, lengths: tuple[int, ...], seed: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_tokens = sum(lengths)
    full = torch.randn(num_tokens, width, generator=gen, device="cuda").to(torch.bfloat16)
    num_slots = len(lengths) + 4
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return {
        "x": full[:, :channels],  # [T, conv_dim] column slice, row stride `width`
        "weight": (torch.randn(channels, KERNEL_SIZE, generator=gen, device="cuda") * 0.5).to(torch.bfloat16),
        "states": torch.randn(num_slots, KERNEL_SIZE - 1, channels, generator=gen, device="cuda").to(torch.bfloat16),
        "qsl": torch.tensor(starts, dtype=torch.int32, device="cuda"),
        "slots": torch.arange(len(lengths), dtype=torch.int32, device="cuda") + 2,
        "init": torch.tensor([i % 2 == 0 for i in range(len(lengths))], device="cuda"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON record (default: benchmarks/results/kernels/conv-prefill-<UTC time>.json)",
    )
    parser.add_argument("--baseline", type=Path, help="an earlier conv_triton.py to time against, same tile")
    parser.add_argument("--only-baseline", action="store_true", help="skip the tile sweep")
    args = parser.parse_args()
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        args.out = Path(__file__).resolve().parent / "results" / "kernels" / f"conv-prefill-{stamp}.json"
    if not torch.cuda.is_available():
        print("conv_prefill_sweep: needs a CUDA GPU")
        return 2
    committed = conv_triton.prefill_blocks
    baseline = load_module(args.baseline) if args.baseline else None
    configs = list(itertools.product(BLOCK_TS, BLOCK_CS, WARPS))
    results: dict[str, Any] = {}
    num_mismatches = 0
    for index, (label, channels, width, lengths) in enumerate(CASES):
        case = make_case(channels, width, lengths, seed=index)
        num_bytes = 2 * case["x"].numel() * 2  # bf16 read once and written once
        src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_us = time_us(lambda: dst.copy_(src), args.reps)  # noqa: B023
        ceiling_gbps = num_bytes / copy_us / 1e3
        states = case["states"].clone()
        ref = torch.empty_like(case["x"], memory_format=torch.contiguous_format)
        conv_triton.causal_conv1d_prefill_triton(
            case["x"], case["weight"], case["states"], case["qsl"], case["slots"], case["init"], out=ref
        )
        case["states"].copy_(states)
        call_args = (case["x"], case["weight"], case["states"], case["qsl"], case["slots"], case["init"])
        # Both launches back to back from Python: at 2048 tokens this reads the host's launch time, not the GPU's
        # (27B 82-90 us against 53 for the conv alone on the H200); the sweep's figures below are the kernel's.
        committed_us = time_us(lambda: conv_triton.causal_conv1d_prefill_triton(*call_args), args.reps)  # noqa: B023
        case["states"].copy_(states)  # the write-back above moved the histories on: the sweep reads the originals
        ab: dict[str, Any] = {}
        if baseline is not None:
            tile = committed(channels)
            out_new = torch.full_like(ref, float("nan"))
            out_old = torch.full_like(ref, float("nan"))
            launch_conv(case, out_new, *tile)
            launch_conv(case, out_old, *tile, module=baseline)
            is_equal = bool(torch.equal(out_new, ref)) and bool(torch.equal(out_old, ref))
            num_mismatches += int(not is_equal)
            new_us, old_us = [], []
            for _ in range(3):  # interleaved, so clocks and L2 drift hit both alike
                old_us.append(time_us(lambda: launch_conv(case, out_old, *tile, module=baseline), args.reps))  # noqa: B023
                new_us.append(time_us(lambda: launch_conv(case, out_new, *tile), args.reps))  # noqa: B023
            ab = {
                "tile": list(tile),
                "baseline_us": round(statistics.median(old_us), 2),
                "current_us": round(statistics.median(new_us), 2),
                "is_equal": is_equal,
            }
            print(
                f"{label}: baseline {ab['baseline_us']:.2f} us, current {ab['current_us']:.2f} us at tile {tile}, "
                f"bit-equal to the committed launch: {is_equal}"
            )
        rows = []
        for block_t, block_c, num_warps in [] if args.only_baseline else configs:
            out = torch.full_like(ref, float("nan"))
            launch_conv(case, out, block_t, block_c, num_warps)
            is_equal = bool(torch.equal(out, ref))
            num_mismatches += int(not is_equal)
            us = time_us(lambda: launch_conv(case, out, block_t, block_c, num_warps), args.reps)  # noqa: B023
            rows.append(
                {"block_t": block_t, "block_c": block_c, "num_warps": num_warps, "us": round(us, 2),
                 "gbps": round(num_bytes / us / 1e3, 1), "is_equal": is_equal}
            )  # fmt: skip
        rows.sort(key=lambda r: r["us"])
        results[label] = {
            "channels": channels,
            "row_stride": width,
            "lengths": list(lengths),
            "bytes": num_bytes,
            "copy_us": round(copy_us, 2),
            "copy_gbps": round(ceiling_gbps, 1),
            "committed": list(committed(channels)),
            "committed_us_with_writeback": round(committed_us, 2),
            "ab": ab,
            "sweep": rows,
        }
        print(
            f"{label}: T {sum(lengths)} C {channels}, {num_bytes / 1e6:.1f} MB, copy {copy_us:.1f} us "
            f"({ceiling_gbps:.0f} GB/s); committed {committed(channels)} {committed_us:.1f} us (with write-back)"
        )
        for r in rows[:6]:
            print(f"  BLOCK_T {r['block_t']:3d} BLOCK_C {r['block_c']:4d} warps {r['num_warps']}: {r['us']:7.2f} us "
                  f"{r['gbps']:7.1f} GB/s equal {r['is_equal']}")  # fmt: skip
        here = [r for r in rows if (r["block_t"], r["block_c"], r["num_warps"]) == committed(channels)]
        print(f"  committed tile, conv alone: {here[0]['us']:.2f} us" if here else "  committed tile not in the sweep")
    swept = [] if args.only_baseline else configs
    totals = {
        cfg: sum(next(r["us"] for r in res["sweep"] if (r["block_t"], r["block_c"], r["num_warps"]) == cfg)
                 for res in results.values())
        for cfg in swept
    }  # fmt: skip
    best = min(totals, key=totals.get) if totals else None
    if best is not None:
        print(f"best over the cases: BLOCK_T {best[0]} BLOCK_C {best[1]} warps {best[2]}: {totals[best]:.1f} us in all")
    num_checked = len(swept) * len(CASES) + (len(CASES) if baseline is not None else 0)
    print(f"outputs bit-equal to the committed launch: {num_checked - num_mismatches}/{num_checked}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "kind": "conv-prefill-sweep",
        "command": " ".join(sys.argv),
        "commit": commit,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cases": results,
        "totals_us": {f"{t}x{c}x{w}": round(v, 2) for (t, c, w), v in totals.items()},
        "best": list(best) if best is not None else None,
        "num_mismatches": num_mismatches,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    return 1 if num_mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
