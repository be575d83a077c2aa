"""Tune the MoE kernels' launch configs per power-of-two token bucket on the GPU; write the table moe_configs reads.

    python3 benchmarks/tune_moe.py --shape 35b-a3b --out $OUT/moe-table.json

For each bucket T (default 1, 2, 4, ..., 8192 tokens) it times the whole MoE block op of one layer
(moe_decode_triton.moe_block_triton: router, routing, routed and shared experts, exactly what a decode step
runs) for candidate configs, on random bf16 weights of the real shape (two weight sets used alternately, 3.2
GiB, so no call finds its experts in L2) and fresh activations per call:
- the decode path (T ≤ 64): the gate/up kernel's candidates with the down kernel at its default, then the
  down kernel's candidates with the best gate/up (the two are separate launches, their times add); the down
  candidates with a fifth field split the choices over programs (CHOICES_PER_PROGRAM) and
  are timed with their combine launch; gate/up candidates with a sixth field (ROUTE_ROWS) route on fewer
  token rows than the dot tile's 16;
- the grouped path: the same coordinate search for each BLOCK_M near the mean rows per expert;
then keeps the faster path. Buckets up to 256 tokens are timed as CUDA-graph replays of 8 calls (median of
--replays), larger ones with events around eager calls. Every candidate kernel is compiled before timing, in
parallel threads (Triton's AsyncCompileMode), so compiles cost seconds, not minutes. A bucket left when
--budget-s runs out keeps the committed table's config (marked "tuned": false in the record).

The output is the table (`shape`, `source`, `buckets`) plus `measurements`; copy it to
deltaserve/kernels/configs/ under the `file` name printed last. Exit 2 without a CUDA device.

With --fp8 the block has block-FP8 experts and shared expert (moe_decode_triton.moe_block_fp8_triton, random e4m3
weights with 128 x 128 scales, x quantized by a norm before it, as served): for each bucket up to the FP8 decode
limit the decode path's candidates (gate/up with BLOCK_K the group, the choice-split down: FP8_G1 / FP8_G2) and
the composition of the FP8 ops (one measurement: its kernels' launch settings are fixed); the record's buckets are
what moe_decode_triton.FP8_DECODE_CONFIGS should hold (it is code, not a table file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUCKETS = [2**i for i in range(14)]  # 1 .. 8192
DECODE_G1 = [(16, 128, 4, 4), (32, 128, 4, 4), (32, 64, 4, 4), (64, 64, 4, 3), (16, 256, 4, 3), (32, 256, 4, 3),
             # deeper pipelines / smaller BLOCK_K (at B <= 4 a gate/up program is alone on its SM, so its
             # stages are all the bytes in flight there, and a smaller first stage lands sooner after the routing)
             (32, 128, 4, 6), (32, 64, 4, 8),
             # the in-kernel routing on next_pow2(T) rows (6th field ROUTE_ROWS = 1) instead of 16: a third of
             # the B = 1 prologue's instructions on sm_90 (kernel_resources), which every program runs first
             (32, 256, 4, 3, 0, 1), (16, 256, 4, 3, 0, 1), (32, 128, 4, 6, 0, 1), (16, 128, 4, 6, 0, 1),
             (32, 64, 4, 8, 0, 1),
             # one- and two-warp gate/up programs: the routing's reductions stay inside a warp (sm_90 compile
             # of the B = 1 kernel: 11 barriers against 66 at 4 warps), at 3 programs an SM (70 KB of stages)
             (32, 64, 1, 8, 0, 1), (16, 64, 1, 8, 0, 1), (32, 64, 2, 8, 0, 1), (16, 128, 1, 8, 0, 1)]  # fmt: skip
DECODE_G2 = [(8, 128, 4, 1), (16, 128, 4, 1), (16, 256, 4, 1), (32, 128, 4, 1), (8, 256, 2, 1), (32, 256, 8, 1),
             # the down GEMM split over the choices (5th field CHOICES_PER_PROGRAM) plus the combine launch;
             # chosen so that the B = 1 grid is resident in one wave on 132 SMs (registers from kernel_resources)
             (16, 128, 4, 1, 1), (32, 128, 4, 1, 1), (8, 128, 2, 1, 1), (16, 128, 4, 1, 2), (32, 256, 8, 1, 2),
             (16, 128, 4, 1, 4)]  # fmt: skip
# block-FP8 candidates: gate/up walks K a group (128) at a time; the down is always the choice split
FP8_G1 = [(16, 128, 1, 8, 0, 1), (16, 128, 1, 4, 0, 1), (32, 128, 1, 6, 0, 1), (16, 128, 2, 6, 0, 1),
          (32, 128, 4, 3, 0, 1), (32, 128, 4, 3), (16, 128, 4, 4), (64, 128, 4, 3)]  # fmt: skip
FP8_G2 = [(32, 128, 4, 1, 1), (16, 128, 4, 1, 1), (64, 128, 4, 1, 1), (32, 128, 2, 1, 1), (16, 128, 1, 1, 1),
          (32, 128, 4, 1, 2), (16, 128, 4, 1, 2), (64, 128, 8, 1, 1)]  # fmt: skip
GROUPED = [(32, 128, 4, 4), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 2),
           (256, 64, 8, 3)]  # fmt: skip
CALLS = 8  # calls per timed graph (fresh activations and alternating weight sets)


def _gemm(spec: tuple[int, int, int, int]) -> Any:
    from deltaserve.kernels.moe_configs import GemmConfig

    return GemmConfig(*spec)


class Problem:
    """Weights and activations of one MoE layer shape, and the timed call of the block op."""

    def __init__(self, shape: Any, dtype: torch.dtype, num_sets: int = 2) -> None:
        self.shape = shape
        self.dtype = dtype
        e, h, i, ish = shape.num_experts, shape.hidden, shape.moe_inter, shape.mlp_inter

        def w(*size: int) -> torch.Tensor:
            return (torch.randn(*size, device="cuda") * 0.02).to(dtype)  # the dummy loader's scale

        self.sets = [(w(e, h), w(e, 2 * i, h), w(e, h, i), w(2 * ish, h), w(h, ish), w(1, h)) for _ in range(num_sets)]

    def inputs(self, num_tokens: int) -> list[torch.Tensor]:
        return [torch.randn(num_tokens, self.shape.hidden, device="cuda").to(self.dtype) for _ in range(CALLS)]

    def call(self, x: torch.Tensor, index: int, config: Any) -> torch.Tensor:
        from deltaserve.kernels.moe_decode_triton import moe_block_triton

        router, w13, w2, s13, s2, gate = self.sets[index % len(self.sets)]
        return moe_block_triton(x, router, w13, w2, self.shape.top_k, True, s13, s2, gate, config=config)


class Fp8Problem(Problem):
    """The same layer with block-FP8 experts and shared expert (the router and the gate row stay bf16), x arriving
    with its quantization (Fp8Rows) as the post-attention norm gives it in an FP8 model."""

    def __init__(self, shape: Any, dtype: torch.dtype, num_sets: int = 2) -> None:
        from deltaserve.kernels.fp8 import FP8_DTYPE, GROUP, Fp8Weight

        self.shape = shape
        self.dtype = dtype
        e, h, i, ish = shape.num_experts, shape.hidden, shape.moe_inter, shape.mlp_inter

        def fp8(*size: int) -> Fp8Weight:
            values = (torch.randn(*size, device="cuda") * 16).to(FP8_DTYPE)
            scales = torch.rand(*size[:-2], -(-size[-2] // GROUP), -(-size[-1] // GROUP), device="cuda") * 1e-3
            return Fp8Weight.of(values, scales, GROUP)

        def bf16(*size: int) -> torch.Tensor:
            return (torch.randn(*size, device="cuda") * 0.02).to(dtype)

        self.sets = [(bf16(e, h), fp8(e, 2 * i, h), fp8(e, h, i), fp8(2 * ish, h), fp8(h, ish), bf16(1, h))
                     for _ in range(num_sets)]  # fmt: skip

    def inputs(self, num_tokens: int) -> list[Any]:
        from deltaserve.kernels.fp8 import Fp8Rows
        from deltaserve.kernels.fp8_triton import quantize_activation_triton

        rows = super().inputs(num_tokens)
        return [Fp8Rows(x, *quantize_activation_triton(x)) for x in rows]

    def call(self, x: Any, index: int, config: Any) -> torch.Tensor:
        from deltaserve.kernels.moe_decode_triton import moe_block_fp8_triton

        router, w13, w2, s13, s2, gate = self.sets[index % len(self.sets)]
        return moe_block_fp8_triton(x, router, w13, w2, self.shape.top_k, True, s13, s2, gate, config=config)


def time_config(problem: Problem, xs: list[torch.Tensor], config: Any, replays: int, use_graph: bool) -> float:
    """Median µs per block call."""
    from deltaserve.bench.kernels import event_times_ms

    for i, x in enumerate(xs[:2]):
        problem.call(x, i, config)
    torch.cuda.synchronize()

    def one_pass() -> None:
        for i, x in enumerate(xs):
            problem.call(x, i, config)

    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_pass()
        graph.replay()
        pass_ms = event_times_ms(graph.replay, replays)
        del graph
    else:
        pass_ms = event_times_ms(one_pass, max(3, replays // 2))
    times = sorted(ms * 1e3 / len(xs) for ms in pass_ms)
    return times[len(times) // 2]


def precompile(problem: Problem, num_tokens: int, configs: list[Any]) -> str:
    """Compile every candidate's GEMM kernels in parallel threads: the GEMM launches run as Triton warm-ups
    (compile, no launch) inside AsyncCompileMode, the other kernels (routing, align) run for real so the torch
    ops between them see valid data. Returns how it compiled."""
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    from deltaserve.kernels import moe_decode_triton, moe_triton

    gemms = {
        moe_decode_triton._moe_decode_gemm1_kernel,
        moe_decode_triton._moe_decode_gemm2_kernel,
        moe_decode_triton._moe_decode_gemm2_split_kernel,
        moe_decode_triton._moe_decode_combine_kernel,
        moe_triton._moe_gemm1_kernel,
        moe_triton._moe_gemm2_kernel,
    }
    original = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return original(self, *args, grid=grid, warmup=warmup or self in gemms, **kwargs)

    x = problem.inputs(num_tokens)[0]
    started = time.perf_counter()
    try:
        JITFunction.run = run  # type: ignore[method-assign]
        with AsyncCompileMode(ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1))):
            for config in configs:
                problem.call(x, 0, config)
        mode = "parallel"
    except Exception as exc:  # fall back: the timing loop compiles each candidate on first use
        mode = f"sequential ({type(exc).__name__}: {exc})"[:200]
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    torch.cuda.synchronize()
    return f"{mode}, {time.perf_counter() - started:.1f} s"


def _search(
    measure: Callable[[Any], float], make: Callable[[Any, Any], Any], g1s: list[Any], g2s: list[Any], deadline: float
) -> tuple[Any, float, list[dict[str, Any]]]:
    """Coordinate search: the best gate/up config with the down config at its first candidate, then the best
    down config with that gate/up. Returns (best config, its µs, every measurement)."""
    log: list[dict[str, Any]] = []
    best_g1, best_us = g1s[0], math.inf
    for g1 in g1s:
        if time.monotonic() > deadline and log:
            break
        us = measure(make(g1, g2s[0]))
        log.append({"gemm1": g1.__dict__, "gemm2": g2s[0].__dict__, "us": us})
        if us < best_us:
            best_g1, best_us = g1, us
    best = make(best_g1, g2s[0])
    for g2 in g2s[1:]:
        if time.monotonic() > deadline:
            break
        candidate = make(best_g1, g2)
        us = measure(candidate)
        log.append({"gemm1": best_g1.__dict__, "gemm2": g2.__dict__, "us": us})
        if us < best_us:
            best, best_us = candidate, us
    return best, best_us, log


def tune_fp8(shape_name: str, buckets: list[int], budget_s: float, replays: int, log: Callable[[str], None]) -> dict:
    """The --fp8 search: per bucket up to the FP8 decode limit, the decode path's coordinate search against the
    served FP8_DECODE_CONFIGS and the composition; a record of what FP8_DECODE_CONFIGS should hold."""
    from deltaserve.bench.kernel_shapes import MODELS
    from deltaserve.bench.provenance import git_state
    from deltaserve.kernels.moe_configs import MoEConfig
    from deltaserve.kernels.moe_decode_triton import FP8_DECODE_CONFIGS, FP8_DECODE_MAX_TOKENS

    shape = MODELS[shape_name]
    if not shape.num_experts:
        raise ValueError(f"{shape_name} has no MoE layers to tune")
    problem = Fp8Problem(shape, torch.bfloat16)
    deadline = time.monotonic() + budget_s
    composition = MoEConfig("grouped", _gemm((32, 128)), _gemm((32, 128)))  # the block op composes its FP8 ops
    g1s, g2s = [_gemm(s) for s in FP8_G1], [_gemm(s) for s in FP8_G2]
    make = lambda a, b: MoEConfig("decode", a, b)  # noqa: E731
    table: dict[str, Any] = {}
    measurements: dict[str, Any] = {}
    for bucket in [b for b in buckets if b <= FP8_DECODE_MAX_TOKENS]:
        served = FP8_DECODE_CONFIGS[bucket]
        if time.monotonic() > deadline:
            table[str(bucket)] = served.to_json()
            measurements[str(bucket)] = {"tuned": False}
            log(f"bucket {bucket:>5}: out of budget, keeps {served.to_json()}")
            continue
        xs = problem.inputs(bucket)
        measure = lambda c, xs=xs: time_config(problem, xs, c, replays, True)  # noqa: E731
        candidates = [make(g1, g2s[0]) for g1 in g1s] + [make(g1s[0], g2) for g2 in g2s] + [served]
        compiled = precompile(problem, bucket, candidates)
        best, best_us, search_log = _search(measure, make, g1s, g2s, deadline)
        served_us, composition_us = measure(served), measure(composition)
        table[str(bucket)] = best.to_json()
        measurements[str(bucket)] = {"tuned": True, "us": best_us, "served_us": served_us,
                                     "composition_us": composition_us, "compile": compiled,
                                     "log": search_log}  # fmt: skip
        log(f"bucket {bucket:>5}: decode {best_us:8.1f} us {json.dumps(best.to_json())}; served {served_us:8.1f} us;"
            f" composition {composition_us:8.1f} us  [{compiled}]")  # fmt: skip
    device_name = torch.cuda.get_device_name()
    return {
        "kernel": "fused_moe_block_fp8",
        "file": None,
        "shape": {
            "num_experts": shape.num_experts,
            "inter": shape.moe_inter,
            "hidden": shape.hidden,
            "top_k": shape.top_k,
            "shared_inter": shape.mlp_inter,
            "dtype": "fp8-block128/bfloat16",
            "device": device_name,
        },  # fmt: skip
        "source": f"tuned by benchmarks/tune_moe.py --fp8 on {device_name}, "
        f"{datetime.now(UTC).isoformat(timespec='seconds')}, commit {git_state(ROOT).get('commit')}; the whole FP8 "
        "MoE block op timed per candidate (median of graph replays); buckets are FP8_DECODE_CONFIGS' candidates",
        "buckets": table,
        "measurements": measurements,
    }


def tune(shape_name: str, buckets: list[int], budget_s: float, replays: int, log: Callable[[str], None]) -> dict:
    from deltaserve.bench.kernel_shapes import MODELS
    from deltaserve.bench.provenance import git_state
    from deltaserve.kernels import moe_configs
    from deltaserve.kernels.moe_configs import DECODE_MAX_TOKENS, MoEConfig

    shape = MODELS[shape_name]
    if not shape.num_experts:
        raise ValueError(f"{shape_name} has no MoE layers to tune")
    dtype = torch.bfloat16
    device_name = torch.cuda.get_device_name()
    e, i, h, k = shape.num_experts, shape.moe_inter, shape.hidden, shape.top_k
    committed = moe_configs.load_table(e, i, h, k, dtype, device_name)
    deadline = time.monotonic() + budget_s
    problem = Problem(shape, dtype)
    table: dict[str, Any] = {}
    measurements: dict[str, Any] = {}
    for bucket in buckets:
        fallback = moe_configs.lookup(committed, bucket) if committed else moe_configs.default_config(bucket, e, k)
        if time.monotonic() > deadline:
            table[str(bucket)] = fallback.to_json()
            measurements[str(bucket)] = {"tuned": False}
            log(f"bucket {bucket:>5}: out of budget, keeps {fallback.path} {fallback.to_json()}")
            continue
        xs = problem.inputs(bucket)
        use_graph = bucket <= 256
        measure = lambda c, xs=xs, g=use_graph: time_config(problem, xs, c, replays, g)  # noqa: E731
        paths: dict[str, tuple[Any, float, list]] = {}
        candidates: list[Any] = []
        plans: list[tuple[str, Callable[[Any, Any], Any], list[Any], list[Any]]] = []
        if bucket <= DECODE_MAX_TOKENS:
            g1s, g2s = [_gemm(s) for s in DECODE_G1], [_gemm(s) for s in DECODE_G2]
            plans.append(("decode", lambda a, b: MoEConfig("decode", a, b), g1s, g2s))
        default_m = moe_configs.default_config(max(bucket, 16), e, k).block_m
        for block_m in sorted({max(16, default_m // 2), default_m, min(64, default_m * 2)}):
            gs = [_gemm(s) for s in GROUPED]
            plans.append((f"grouped-m{block_m}", lambda a, b, m=block_m: MoEConfig("grouped", a, b, m), gs, gs))
        for _, make, g1s, g2s in plans:
            candidates += [make(g1, g2s[0]) for g1 in g1s] + [make(g1s[0], g2) for g2 in g2s]
        compiled = precompile(problem, bucket, candidates)
        for name, make, g1s, g2s in plans:
            paths[name] = _search(measure, make, g1s, g2s, deadline)
        name, (best, best_us, _) = min(paths.items(), key=lambda item: item[1][1])
        table[str(bucket)] = best.to_json()
        measurements[str(bucket)] = {
            "tuned": True,
            "chosen": name,
            "us": best_us,
            "fallback_us": measure(fallback),
            "compile": compiled,
            "paths": {n: {"best": c.to_json(), "us": us, "log": lg} for n, (c, us, lg) in paths.items()},
        }
        fallback_us = measurements[str(bucket)]["fallback_us"]
        log(f"bucket {bucket:>5}: {name:<12} {best_us:9.1f} us (committed/default {fallback_us:9.1f} us)"
            f"  {json.dumps(best.to_json())}  [{compiled}]")  # fmt: skip
    git = git_state(ROOT)
    return {
        "kernel": "fused_moe",
        "file": moe_configs.table_name(e, i, h, k, dtype, device_name),
        "shape": {
            "num_experts": e,
            "inter": i,
            "hidden": h,
            "top_k": k,
            "shared_inter": shape.mlp_inter,
            "dtype": "bfloat16",
            "device": device_name,
        },  # fmt: skip
        "source": f"tuned by benchmarks/tune_moe.py on {device_name}, {datetime.now(UTC).isoformat(timespec='seconds')}"
        f", commit {git.get('commit')}; the whole MoE block op timed per candidate (median of graph replays)",
        "buckets": table,
        "measurements": measurements,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="35b-a3b")
    parser.add_argument("--buckets", default=",".join(str(b) for b in DEFAULT_BUCKETS))
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop tuning new buckets after this long")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--fp8", action="store_true", help="the block-FP8 block's decode path (buckets up to 8)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON record (default: benchmarks/results/kernels/tune-moe-<UTC time>.json)",
    )
    args = parser.parse_args()
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        args.out = Path(__file__).resolve().parent / "results" / "kernels" / f"tune-moe-{stamp}.json"
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("tune_moe: no CUDA device (or TRITON_INTERPRET is set): nothing to tune", file=sys.stderr)
        return 2
    buckets = [int(b) for b in args.buckets.split(",") if b]
    if any(b < 1 or b & (b - 1) for b in buckets):
        print(f"tune_moe: buckets must be powers of two, got {buckets}", file=sys.stderr)
        return 2
    search = tune_fp8 if args.fp8 else tune
    result = search(args.shape, buckets, args.budget_s, args.replays, lambda line: print(line, flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    tuned = sum(1 for m in result["measurements"].values() if m.get("tuned"))
    where = f"commit it as deltaserve/kernels/configs/{result['file']}" if result["file"] else "FP8_DECODE_CONFIGS"
    print(f"tuned {tuned}/{len(result['measurements'])} buckets; table -> {args.out}; {where}")
    return 0 if tuned else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
