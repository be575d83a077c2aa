"""`deltaserve bench kernels`: time every Triton kernel at the Qwen3.5-27B and 35B-A3B shapes on one GPU.

For each model and token count it builds the op's real-shape inputs (bf16 activations, fp32 GDN states and
routing weights), times the public dispatcher (which routes to Triton on CUDA), counts the bytes the op
must move at least (inputs read once, outputs written once; weights of the experts actually routed to),
and reports the achieved bandwidth as a share of the device's copy bandwidth, measured in the same run
with a large device-to-device copy (bytes read + written). Token counts up to --decode-up-to run the
decode forms (paged attention over --context cached tokens per sequence, conv update, GDN decode, one
sequence per token); larger counts run the prefill forms on one sequence. `moe_block` times the whole MoE
block op (router, routing, routed and shared experts) beside `fused_moe`, `gdn_verify_conv`, `gdn_verify` and
`spec_commit` the speculative verify step's conv, delta rule and commit (at decode token counts: that many sequences
of 1 + k = 4 tokens; the commit of one layer, every token accepted), and `linear`
kernels.linear on the GDN input projection (the register GEMV at one row, cuBLAS beyond); `fp8_linear` and
`fp8_fused_moe` the same projection and the routed experts with block-FP8 weights (docs/fp8.md). The decode
step as a whole, per batch size, is benchmarks/decode_step.py.

Timing: the op's inputs are replicated until the sets together exceed three times the L2 cache and used in
rotation, so no call finds its inputs in L2. The primary number is GPU time per call from replaying a CUDA
graph of one pass over the sets (no launch overhead); `eager_us` is triton.testing.do_bench's median of
plain calls, which includes Python launch overhead where an op is launch-bound (the four-op preamble).
A table goes to stdout, then one JSON line last. On a machine without CUDA it exits 2: nothing to measure.

`--tp N` times the shapes one rank of an N-way tensor-parallel engine runs (model/parallel.py's split: query, KV,
GDN key and value heads, the dense / shared-expert width and each expert's width divided by N; KV heads replicated
below N; with --expert-parallel whole experts divided instead), so the fused preamble and every kernel are covered
at their per-rank shapes.

Where the parts are: kernel_shapes.py (the model shapes, --tp's per-rank shapes, the ops), kernel_cases.py (each
attention and GDN op's inputs, bytes and FLOPs, and the input builders) and kernel_gemm_cases.py (the MoE, linear and
FP8 ops'); this module assembles the cases (build_cases), times them and prints the table and the record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from deltaserve.bench.kernel_cases import (
    DEVICE,
    Case,
    attention_cases,
    gdn_cases,
    norm_cases,
    preamble_cases,
    verify_cases,
)
from deltaserve.bench.kernel_gemm_cases import fp8_cases, linear_cases, moe_cases
from deltaserve.bench.kernel_shapes import MODELS, OPS, ModelShapes, per_rank
from deltaserve.bench.provenance import git_state

DEFAULT_TOKENS = "1,8,64,512,2048,8192"


def build_cases(m: ModelShapes, tokens: int, args: argparse.Namespace, dtype: torch.dtype) -> list[Case]:
    is_decode = tokens <= args.decode_up_to
    cases = [
        *preamble_cases(m, tokens, dtype),
        *norm_cases(m, tokens, dtype),
        *attention_cases(m, tokens, dtype, is_decode, args.context, args.page_size),
        *gdn_cases(m, tokens, dtype, is_decode),
        *verify_cases(m, tokens, dtype, is_decode),
        *moe_cases(m, tokens, dtype),
        *linear_cases(m, tokens, dtype),
        *fp8_cases(m, tokens, dtype),
    ]
    return [c for c in cases if c.op in args.ops]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def event_times_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """GPU ms of each of `repeats` calls of fn (a graph replay, a pass of eager calls), between two CUDA events,
    each call waited for."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_case(case: Case, l2_bytes: int, replays: int) -> dict[str, Any]:
    """GPU µs per call from CUDA-graph replays over rotating input sets, plus do_bench's eager median."""
    import triton.testing

    num_sets = int(min(4096, max(1, math.ceil(3 * l2_bytes / max(case.bytes, 1)))))
    sets = [case.make() for _ in range(num_sets)]
    for s in sets[: min(3, num_sets)]:
        case.call(s)  # compiles, autotunes (never inside capture) and warms up
    torch.cuda.synchronize()
    cursor = [0]

    def eager_call() -> None:
        cursor[0] = (cursor[0] + 1) % num_sets
        case.call(sets[cursor[0]])

    eager_us = 1e3 * triton.testing.do_bench(eager_call, warmup=10, rep=50, return_mode="median")
    graph_us, note = None, case.note
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            case.call(sets[0])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for s in sets:
                case.call(s)
        graph.replay()
        torch.cuda.synchronize()
        graph_us = _median([ms * 1e3 / num_sets for ms in event_times_ms(graph.replay, replays)])
    except Exception as exc:  # a capture failure is a finding, not a crash of the whole bench
        torch.cuda.synchronize()
        note = f"{note}; no graph: {type(exc).__name__}: {exc}".strip("; ")[:160]
    return {"graph_us": graph_us, "eager_us": eager_us, "rotations": num_sets, "note": note}


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Device copy bandwidth: bytes read + written by a large D2D copy, per second (do_bench median)."""
    import triton.testing

    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="27b,35b-a3b", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma list of token counts per step")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    parser.add_argument("--decode-up-to", type=int, default=64, help="token counts up to this run decode forms")
    parser.add_argument("--context", type=int, default=4096, help="cached tokens per sequence for decode attention")
    parser.add_argument("--page-size", type=int, default=64, help="KV cache block size in tokens")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--replays", type=int, default=10, help="CUDA-graph replays per measurement (median)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON record here")
    parser.add_argument("--tp", type=int, default=1, help="time one rank's shapes of an N-way tensor-parallel engine")
    parser.add_argument("--expert-parallel", action="store_true", help="with --tp: whole experts per rank")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "deltaserve bench kernels: no CUDA device (or TRITON_INTERPRET is set): nothing to measure. "
            "It times the Triton kernels on a GPU; on a CPU run `pytest tests/kernels` for correctness.",
            file=sys.stderr,
        )
        return 2
    import triton

    if args.tp < 1:
        print(f"deltaserve bench kernels: --tp must be at least 1, got {args.tp}", file=sys.stderr)
        return 2
    try:
        models = [
            per_rank(MODELS[name.strip().lower()], args.tp, args.expert_parallel)
            for name in args.models.split(",")
            if name.strip()
        ]
    except ValueError as exc:
        print(f"deltaserve bench kernels: {exc}", file=sys.stderr)
        return 2
    token_counts = [int(t) for t in args.tokens.split(",") if t.strip()]
    args.ops = {op.strip() for op in args.ops.split(",") if op.strip()}
    unknown = args.ops - set(OPS)
    if unknown:
        print(f"deltaserve bench kernels: unknown ops {sorted(unknown)}; choose from {', '.join(OPS)}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20))
    copy_gbps = copy_bandwidth_gbps()
    torch.cuda.empty_cache()
    print(f"{props.name}: copy bandwidth {copy_gbps:.0f} GB/s (read + write), L2 {l2_bytes >> 20} MiB")
    header = f"{'model':<16} {'op':<18} {'mode':<8} {'T':>6} {'graph_us':>10} {'eager_us':>10} "
    header += f"{'MB':>9} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8}  note"
    print(header)
    results = []
    for model in models:
        for tokens in token_counts:
            for case in build_cases(model, tokens, args, dtype):
                timing = time_case(case, l2_bytes, args.replays)
                torch.cuda.empty_cache()
                best_us = timing["graph_us"] if timing["graph_us"] is not None else timing["eager_us"]
                gbps = case.bytes / (best_us * 1e-6) / 1e9
                tflops = case.flops / (best_us * 1e-6) / 1e12 if case.flops else None
                row = {
                    "model": model.name,
                    "op": case.op,
                    "mode": case.mode,
                    "tokens": tokens,
                    "graph_us": timing["graph_us"],
                    "eager_us": timing["eager_us"],
                    "bytes": case.bytes,
                    "gbps": gbps,
                    "copy_share": gbps / copy_gbps,
                    "tflops": tflops,
                    "rotations": timing["rotations"],
                    "note": timing["note"],
                }
                results.append(row)
                print(
                    f"{model.name:<16} {case.op:<18} {case.mode:<8} {tokens:>6} {_fmt(timing['graph_us'], '10.2f')} "
                    f"{timing['eager_us']:>10.2f} {case.bytes / 1e6:>9.2f} {gbps:>8.0f} "
                    f"{100 * gbps / copy_gbps:>5.0f}% {_fmt(tflops, '8.1f')}  {timing['note']}",
                    flush=True,
                )
    record = {
        "kind": "kernel_bench",
        "gpu": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_state(Path(__file__).resolve().parents[2])["commit"],
        "command": shlex.join(["deltaserve", *sys.argv[1:]]) if sys.argv else "deltaserve bench kernels",
        "dtype": args.dtype,
        "tensor_parallel_size": args.tp,
        "expert_parallel": args.expert_parallel,
        "copy_bandwidth_gbps": copy_gbps,
        "l2_bytes": l2_bytes,
        "results": results,
    }
    line = json.dumps(record)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(line)
    return 0
