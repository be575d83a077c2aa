"""GPU time of the MoE expert alignment and the router logits launch alone, against their torch twins.

    python3 benchmarks/align_router_bench.py

For each size the op is captured REPS times into one CUDA graph (inputs on the device, no host work) and the replay
timed with CUDA events; the per-call figure (median of --replays replays / REPS) is what a decode-step graph pays,
launch gaps included. Alignment: moe_align_triton against moe_align_ref (the torch path the grouped MoE took above
ALIGN_DISPATCH_MAX_ENTRIES before the chunked kernels) and, from 1024 entries, moe_align_chunked_triton (three launches)
at N = 8 ... 65536 entries on the 35B-A3B routing (E = 256, top-8, BLOCK_M 16 and the table's 32 / 64); the one-program
kernel runs up to ALIGN_MAX_ENTRIES. Router: router_logits_triton (GEMV up to ROUTER_GEMV_MAX_TOKENS, tl.dot above)
against router_logits_ref (two cuBLAS GEMMs and a cat) at T = 1 ... 256 on W_r [256, 2048] plus the shared gate row,
bf16. The record also carries the module constants (ALIGN_MAX_ENTRIES, ROUTER_*), so a later run with other switch
points says which ones it measured.
Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

ALIGN_ENTRIES = (8, 64, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
ROUTER_TOKENS = (1, 2, 4, 5, 8, 9, 16, 17, 24, 32, 33, 48, 64, 65, 96, 128, 192, 256)


def graph_us(fn: Callable[[], object], reps: int, replays: int) -> float:
    """Per-call µs of fn, captured reps times into one CUDA graph (median over replays). An op that cannot be
    captured is timed eagerly instead (reps back-to-back calls between two events), and the figure is negative
    so the record shows it (launch overhead included)."""
    from deltaserve.bench.kernels import event_times_ms

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run, sign = graph.replay, 1.0
    except RuntimeError as err:
        print(f"  (not capturable, timed eagerly: {str(err).splitlines()[0]})", flush=True)
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(reps):
                fn()

        sign = -1.0
    run()
    torch.cuda.synchronize()
    return sign * statistics.median(ms * 1000.0 / reps for ms in event_times_ms(run, replays))


def bench_align(reps: int, replays: int) -> list[dict[str, float | int]]:
    from deltaserve.kernels.moe_align import moe_align_ref
    from deltaserve.kernels.moe_routing_triton import ALIGN_MAX_ENTRIES, moe_align_chunked_triton, moe_align_triton

    rows: list[dict[str, float | int]] = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for num_entries in ALIGN_ENTRIES:
        num_tokens = max(1, num_entries // 8)
        scores = torch.rand(num_tokens, 256, device="cuda", generator=generator)
        ids = torch.topk(scores, min(8, num_entries), dim=-1).indices
        for block_m in (16, 32, 64):
            row: dict[str, float | int] = {"entries": ids.numel(), "block_m": block_m}
            row["ref_us"] = round(graph_us(lambda i=ids, m=block_m: moe_align_ref(i, 256, m), reps, replays), 2)
            if ids.numel() <= ALIGN_MAX_ENTRIES:
                row["triton_us"] = round(
                    graph_us(lambda i=ids, m=block_m: moe_align_triton(i, 256, m), reps, replays), 2
                )
                got, want = moe_align_triton(ids, 256, block_m), moe_align_ref(ids, 256, block_m)
                row["equal"] = int(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))
            if ids.numel() >= 1024:
                row["chunked_us"] = round(
                    graph_us(lambda i=ids, m=block_m: moe_align_chunked_triton(i, 256, m), reps, replays), 2
                )
                got, want = moe_align_chunked_triton(ids, 256, block_m), moe_align_ref(ids, 256, block_m)
                row["chunked_equal"] = int(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))
            rows.append(row)
            print(f"align N={row['entries']:>6} M={block_m:>3}: triton {row.get('triton_us', '-'):>8} µs, "
                  f"chunked {row.get('chunked_us', '-'):>8} µs, torch {row['ref_us']:>8} µs, "
                  f"equal {row.get('equal', '-')} / {row.get('chunked_equal', '-')}", flush=True)  # fmt: skip
    return rows


def bench_router(reps: int, replays: int) -> list[dict[str, float | int]]:
    from deltaserve.kernels.moe import router_logits_ref
    from deltaserve.kernels.moe_decode_triton import router_logits_triton

    rows: list[dict[str, float | int]] = []
    bf16 = torch.bfloat16
    router = (torch.randn(256, 2048, device="cuda") * 2048**-0.5).to(bf16)
    gate = (torch.randn(1, 2048, device="cuda") * 2048**-0.5).to(bf16)
    for num_tokens in ROUTER_TOKENS:
        x = torch.randn(num_tokens, 2048, device="cuda").to(bf16)
        row: dict[str, float | int] = {"tokens": num_tokens}
        row["triton_us"] = round(graph_us(lambda x=x: router_logits_triton(x, router, gate), reps, replays), 2)
        row["ref_us"] = round(graph_us(lambda x=x: router_logits_ref(x, router, gate), reps, replays), 2)
        got, want = router_logits_triton(x, router, gate).float(), router_logits_ref(x, router, gate).float()
        row["max_abs_diff"] = float((got - want).abs().max())
        rows.append(row)
        print(f"router T={num_tokens:>4}: triton {row['triton_us']:>7} µs, torch {row['ref_us']:>7} µs, "
              f"max |diff| {row['max_abs_diff']:.3g}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="calls captured per graph")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON record (default: benchmarks/results/kernels/align-router-<UTC time>.json)",
    )
    args = parser.parse_args()
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        args.out = Path(__file__).resolve().parent / "results" / "kernels" / f"align-router-{stamp}.json"
    if not torch.cuda.is_available():
        print("align_router_bench: no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    from deltaserve.kernels import moe_decode_triton, moe_routing_triton

    constants = {k: v for k, v in vars(moe_decode_triton).items() if k.startswith("ROUTER_") and isinstance(v, int)}
    for name in ("ALIGN_MAX_ENTRIES", "ALIGN_DISPATCH_MAX_ENTRIES", "ALIGN_CHUNK_MIN", "ALIGN_CHUNKED_MAX_ENTRIES"):
        constants[name] = getattr(moe_routing_triton, name)
    record = {
        "kind": "align_router", "gpu": torch.cuda.get_device_name(), "constants": constants,
        "align": bench_align(args.reps, args.replays), "router": bench_router(args.reps, args.replays),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    bad = [r for r in record["align"] if r.get("equal") == 0 or r.get("chunked_equal") == 0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
