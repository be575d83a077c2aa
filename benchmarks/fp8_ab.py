"""Block-FP8 W8A8 side by side with the field's libraries (issue 37 item 2; docs/fp8.md#the-h200-plan).

In one process on one GPU, bf16 in and bf16 out, activations quantized per token and group of 128 to e4m3, weights
in 128 x 128 blocks: deltaserve's dense GEMM (kernels.linear with an Fp8Weight, the served path, its activation
quantization included) against vLLM 0.26's CUTLASS `cutlass_scaled_mm` and Triton `w8a8_triton_block_scaled_mm`,
FlashInfer's `fp8_blockscale_gemm_sm90` and DeepGEMM's `fp8_gemm_nt` (benchmarks/fp8_ab_arms.py says how each is
called); and deltaserve's fused MoE with FP8 experts against vLLM's Triton `fused_experts` (fp8_w8a8, [128, 128]).
A library that does not import is recorded as missing, with its import error.

Shapes: every distinct [N, K] of the FP8 projections deltaserve builds for Qwen3.5-35B-A3B, 27B and 122B-A10B
(attention q|gate|k|v and o, GDN in_proj_qkvz and out_proj, the dense MLP's or the shared expert's gate|up and down;
the configs are benchmarks/oracle/make_dummy_models.py's), at M = 1 .. 256, 2048 and 8192 tokens; the routed experts
(E, I, H, top-k) of the 35B-A3B and the 122B-A10B at T = 1 .. 256 and 2048.

Before timing, every arm is checked at each shape against deltaserve's plain-torch twin (`fp8_linear_ref` in fp32,
`fused_moe_fp8_ref` in bf16): the largest error over the largest reference value. An arm beyond TOLERANCE is
reported (printed and recorded); it is still timed but never wins. Timing: the inputs (and, for a weight L2 could
hold, copies of the weight) are rotated until a pass reads three times the L2 cache; each arm's pass is a CUDA graph,
warmed up first; the arms are replayed interleaved, in a rotating order, and each arm's figure is the median over
--reps of GPU time per call by CUDA events. Achieved bandwidth counts the bytes the op must move (weights and their
scales read once, experts actually routed to, activations in and out) against the copy ceiling measured in the
same run. A library arm becomes the served kernel for a shape range only when it beats deltaserve there by more
than --adopt-margin (docs/fp8.md#the-h200-plan); each case records which arm wins and by how much, and `ranges`
what serves each op over decode (M <= 256) and prefill (M >= 2048) sizes, from the times summed over the range.
`--summarize RECORD...` prints that verdict over several records (one device call per model) and runs nothing.

On a machine without CUDA (`--device cpu`) ours runs its torch twin and is timed by the wall clock: the CPU test's
check of discovery and the record. The record (JSON) goes to --out, by default
benchmarks/results/kernels/fp8-ab-<UTC>.json. Exit 0, or 1 when deltaserve's own arm disagrees with its twin, 2 when
there is nothing to measure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from fp8_ab_arms import Arm, dense_arms, dense_config_file, moe_arms, moe_config_file  # noqa: E402

from deltaserve.bench.provenance import git_state  # noqa: E402
from deltaserve.kernels.fp8 import FP8_DTYPE, GROUP, Fp8Weight, fp8_linear_ref  # noqa: E402
from deltaserve.kernels.fp8_moe import fused_moe_fp8_ref  # noqa: E402

STARTED = time.monotonic()  # --deadline-s counts from here, the library imports and the copy ceiling included
MODELS = {"35b-a3b": "q35-35b-a3b-fp8", "27b": "q35-27b-fp8", "122b-a10b": "q35-122b-a10b-fp8"}
DENSE_TOKENS = "1,2,4,8,16,32,64,128,256,2048,8192"
MOE_TOKENS = "1,2,4,8,16,32,64,128,256,2048"
TOLERANCE = 1e-2  # max |arm - ref| / max |ref|: about 2.5 bf16 roundings at the largest output
MAX_SETS = 256  # rotation sets per pass, at most
RANGES = {"decode": (1, 256), "prefill": (2048, 1 << 30)}  # the ranges of M a served dispatch is decided for


def _make_dummy_models() -> Any:
    spec = importlib.util.spec_from_file_location("make_dummy_models", ROOT / "benchmarks/oracle/make_dummy_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def text_config(model: str) -> dict[str, Any]:
    """The text config of the FP8 dummy `model` (a key of MODELS), as make_dummy_models writes it."""
    dummies = _make_dummy_models()
    return {**dummies.COMMON, **dummies.FP8_SHAPES[MODELS[model]][2]}


def dense_shapes(text: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(projections, N, K) for every distinct FP8 projection shape deltaserve builds from `text`: attention
    q (with its output gate) | k | v and o; GDN in_proj_qkv | z and out_proj; the dense MLP's or the shared
    expert's gate | up and down. Projections of one shape are timed once, named together."""
    hidden, d = text["hidden_size"], text["head_dim"]
    q, kv = text["num_attention_heads"] * d, text["num_key_value_heads"] * d
    keys = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    values = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    inter = text.get("shared_expert_intermediate_size") if text.get("num_experts") else text["intermediate_size"]
    mlp = "shared_expert" if text.get("num_experts") else "mlp"
    found: dict[tuple[int, int], list[str]] = {}
    for name, rows, cols in (
        ("qkv_proj", 2 * q + 2 * kv, hidden),
        ("o_proj", hidden, q),
        ("in_proj_qkvz", 2 * keys + 2 * values, hidden),
        ("out_proj", hidden, values),
        (f"{mlp}.gate_up", 2 * inter, hidden),
        (f"{mlp}.down", hidden, inter),
    ):
        found.setdefault((rows, cols), []).append(name)
    return [("+".join(names), rows, cols) for (rows, cols), names in found.items()]


def moe_shape(text: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """(experts, expert width I, hidden H, top-k) of the routed experts, or None for a dense model."""
    if not text.get("num_experts"):
        return None
    return text["num_experts"], text["moe_intermediate_size"], text["hidden_size"], text["num_experts_per_tok"]


def random_fp8_weight(*shape: int, device: str) -> Fp8Weight:
    """float8 values N(0, 1) and a different fp32 scale per 128 x 128 block (K^-0.5 times 2^U(-2, 2)), so an arm
    that reads a scale from the wrong block, or the scales transposed, disagrees with the twin."""
    weight = Fp8Weight(*shape, device=device)
    weight.weight.copy_(torch.randn(*shape, device=device).to(FP8_DTYPE))
    spread = torch.rand(weight.scale.shape, device=device) * 4 - 2
    weight.scale.copy_(shape[-1] ** -0.5 * torch.exp2(spread))
    return weight


def random_activation(rows: int, cols: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """x [rows, cols] whose groups of 128 differ in magnitude (2^U(-3, 3)), so every group scale matters."""
    groups = math.ceil(cols / GROUP)
    spread = torch.exp2(torch.rand(rows, groups, device=device) * 6 - 3).repeat_interleave(GROUP, dim=1)[:, :cols]
    return (torch.randn(rows, cols, device=device) * spread).to(dtype)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """The largest error over the largest reference value, and the relative RMSE; NaN or inf never agree."""
    diff = (out.float() - ref.float()).abs()
    peak = ref.float().abs().max().item()
    max_abs = diff.max().item()
    rel = max_abs / peak if peak > 0 else math.inf
    rmse = (diff.square().mean().sqrt() / ref.float().square().mean().sqrt().clamp_min(1e-30)).item()
    finite = math.isfinite(rel) and bool(torch.isfinite(out.float()).all())
    return {
        "max_abs": max_abs if math.isfinite(max_abs) else None,
        "max_rel": rel if math.isfinite(rel) else None,
        "rel_rmse": rmse if math.isfinite(rmse) else None,
        "agrees": finite and rel <= TOLERANCE,
    }


class Timer:
    """GPU time of `fn()` by CUDA events on CUDA, wall-clock time on the CPU (after the device is idle)."""

    def __init__(self, device: str) -> None:
        self.is_cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.is_cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3


def _graph_pass(fn: Callable[[int], object], num_sets: int, timer: Timer) -> tuple[Callable[[], object], str]:
    """One pass over the rotation sets: a CUDA graph where it captures (how both engines serve decode), else eager
    calls (noted)."""

    def eager() -> None:
        for i in range(num_sets):
            fn(i)

    if not timer.is_cuda:
        return eager, "eager (cpu)"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        graph.replay()
        torch.cuda.synchronize()
        return graph.replay, "graph"
    except Exception as exc:  # a library that cannot be captured is timed eagerly, and says so
        torch.cuda.synchronize()
        return eager, f"eager: capture failed: {type(exc).__name__}: {exc}"[:200]


def time_arms(
    calls: dict[str, Callable[[int], object]], num_sets: int, reps: int, timer: Timer
) -> dict[str, dict[str, Any]]:
    """Per arm: median / p10 / p90 µs per call over `reps` interleaved passes (rotating order), or its error."""
    passes: dict[str, Callable[[], object]] = {}
    out: dict[str, dict[str, Any]] = {}
    for name, fn in calls.items():
        try:
            for i in range(min(2, num_sets)):
                fn(i)  # compiles / JIT-builds / autotunes, never inside a capture
            timer.sync()
            passes[name], mode = _graph_pass(fn, num_sets, timer)
            out[name] = {"mode": mode}
        except Exception as exc:
            timer.sync()
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    samples: dict[str, list[float]] = {name: [] for name in passes}
    names = list(passes)
    for rep in range(reps + 1):  # the first round warms every pass once more
        for name in names[rep % len(names) :] + names[: rep % len(names)] if names else []:
            us = timer(passes[name]) / num_sets
            if rep:
                samples[name].append(us)
    for name, values in samples.items():
        ordered = sorted(values)
        out[name].update(
            us=statistics.median(ordered),
            p10=ordered[len(ordered) // 10],
            p90=ordered[min(len(ordered) - 1, (9 * len(ordered)) // 10)],
        )
    return out


def fp8_bytes(*shape: int) -> int:
    """Bytes of a block-FP8 weight: one a value, plus an fp32 scale per 128 x 128 block."""
    return math.prod(shape[:-2]) * (
        shape[-2] * shape[-1] + 4 * math.ceil(shape[-2] / GROUP) * math.ceil(shape[-1] / GROUP)
    )


def num_sets(set_bytes: int, l2_bytes: int | None) -> int:
    """Rotation sets so a pass reads three times the L2 cache (one on the CPU)."""
    if not l2_bytes:
        return 1
    return int(min(MAX_SETS, max(1, math.ceil(3 * l2_bytes / max(set_bytes, 1)))))


def check_arms(arms: list[Arm], run: Callable[[Arm], torch.Tensor], ref: torch.Tensor) -> dict[str, dict[str, Any]]:
    """Each available arm's output against the twin's `ref`, or the error it raised."""
    checks: dict[str, dict[str, Any]] = {}
    for arm in arms:
        if not arm.available:
            continue
        try:
            checks[arm.name] = compare(run(arm), ref)
        except Exception as exc:
            checks[arm.name] = {"agrees": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return checks


def routing(tokens: int, experts: int, top_k: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(topk_weights fp32, ids int64 for deltaserve, the same ids int32 for vLLM) from random router logits."""
    from deltaserve.kernels import moe_route

    weights, ids = moe_route(torch.randn(tokens, experts, device=device).to(dtype), top_k, True)
    return weights, ids, ids.to(torch.int32)


class Context:
    """What every case shares: the device, the timer, the L2 size and copy ceiling, the record and the deadline."""

    def __init__(self, args: argparse.Namespace, record: dict[str, Any], importer: Callable[[str], Any]) -> None:
        self.args, self.record, self.importer = args, record, importer
        self.device, self.dtype = args.device, getattr(torch, args.dtype)
        self.timer = Timer(self.device)
        self.l2_bytes: int | None = record["l2_bytes"]
        self.copy_gbps: float | None = record["copy_bandwidth_gbps"]
        self.start = STARTED
        self.last_case_s = 0.0

    def out_of_time(self) -> bool:
        """Whether the next case, taking as long as the last one did, would end past --deadline-s."""
        deadline = self.args.deadline_s
        return deadline is not None and time.monotonic() - self.start + self.last_case_s > deadline

    def skip_all(self, base: dict[str, Any], tokens: list[int]) -> bool:
        """Past the deadline: every case of this shape goes to the record's `skipped`, and no check runs."""
        if not self.out_of_time():
            return False
        self.record["skipped"] += [{**base, "M": m, "why": "deadline"} for m in tokens]
        return True

    def save(self) -> None:
        """The record as it stands (after every case, so a call cut short still returns what it measured)."""
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.record, indent=2) + "\n")

    def add_case(
        self, case: dict[str, Any], bytes_moved: int, flops: int, timings: dict[str, Any], checks: dict[str, Any]
    ) -> None:
        """One row per arm (µs, GB/s and share of the copy ceiling, TFLOP/s), then the case's verdict."""
        rows = []
        for arm, timing in timings.items():
            row = {**case, "arm": arm, **timing, "agrees": checks.get(arm, {}).get("agrees")}
            if "us" in timing:
                gbps = bytes_moved / (timing["us"] * 1e-6) / 1e9
                row.update(
                    gbps=gbps,
                    copy_share=gbps / self.copy_gbps if self.copy_gbps else None,
                    tflops=flops / (timing["us"] * 1e-6) / 1e12,
                )
            rows.append(row)
        self.record["results"] += rows
        self.record["winners"].append(verdict(case, rows, self.args.adopt_margin))
        line = "  ".join(f"{r['arm']}={r['us']:.1f}" + ("(!)" * (r["agrees"] is False)) for r in rows if "us" in r)
        print(f"{case['op']:<5} {case['model']:<10} {case['shape']:<32} M={case['M']:<5} {line}  "
              f"-> {self.record['winners'][-1]['adopt']}", flush=True)  # fmt: skip


def verdict(case: dict[str, Any], rows: list[dict[str, Any]], margin: float) -> dict[str, Any]:
    """The fastest arm that agreed with the twin; the best library's gain over deltaserve; the arm to serve: the
    library only when it beats deltaserve by more than `margin`."""
    timed = [r for r in rows if "us" in r and r["agrees"]]
    ours = next((r["us"] for r in timed if r["arm"] == "deltaserve"), None)
    libraries = [r for r in timed if r["arm"] != "deltaserve"]
    best = min(libraries, key=lambda r: r["us"]) if libraries else None
    gain = ours / best["us"] - 1 if best and ours else None
    adopt = best["arm"] if best and (ours is None or (gain is not None and gain > margin)) else "deltaserve"
    return {
        **case,
        "winner": min(timed, key=lambda r: r["us"])["arm"] if timed else None,
        "deltaserve_us": ours,
        "best_library": best["arm"] if best else None,
        "best_library_us": best["us"] if best else None,
        "library_gain": gain,
        "adopt": adopt if timed else None,
    }


def range_verdict(
    rows: list[dict[str, Any]], case_of: Callable[[dict[str, Any]], Any], margin: float
) -> dict[str, Any] | None:
    """The verdict over one range's timed rows (this tool's and attention_ab.py's): each arm's time summed over the
    cases deltaserve agreed at (`case_of` names a row's case); a library is eligible only if it agreed with the
    twin and was timed at every such case, and serves the range when its sum is more than `margin` below
    deltaserve's. None when deltaserve has no such case."""
    cases = {case_of(r) for r in rows if r["arm"] == "deltaserve" and r["agrees"]}
    if not cases:
        return None
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for r in rows:
        if r["agrees"] and case_of(r) in cases:
            totals[r["arm"]] = totals.get(r["arm"], 0.0) + r["us"]
            counts[r["arm"]] = counts.get(r["arm"], 0) + 1
    ours = totals.pop("deltaserve")
    libraries = {
        arm: {"us": total, "gain": ours / total - 1, "eligible": counts[arm] == len(cases)}
        for arm, total in totals.items()
    }
    eligible = {arm: v for arm, v in libraries.items() if v["eligible"]}
    best = min(eligible, key=lambda arm: eligible[arm]["us"]) if eligible else None
    serve = best if best and eligible[best]["gain"] > margin else "deltaserve"
    return {"cases": len(cases), "deltaserve_us": ours, "libraries": libraries, "serve": serve}


def range_verdicts(results: list[dict[str, Any]], margin: float) -> list[dict[str, Any]]:
    """What serves each op over each range of M (RANGES), from timed rows of one record or several
    (range_verdict's rule)."""
    verdicts = []
    for op in dict.fromkeys(r["op"] for r in results):
        for name, (low, high) in RANGES.items():
            rows = [r for r in results if r["op"] == op and low <= r["M"] <= high and "us" in r]
            verdict = range_verdict(rows, lambda r: (r["model"], r["shape"], r["M"]), margin)
            if verdict is not None:
                verdicts.append({"op": op, "range": name, **verdict})
    return verdicts


def summarize(paths: list[Path], margin: float) -> int:
    """Print and return 0 after the range verdicts over the records at `paths` (the per-model calls together)."""
    results = [row for path in paths for row in json.loads(path.read_text())["results"]]
    verdicts = range_verdicts(results, margin)
    for v in verdicts:
        others = ", ".join(
            f"{arm} {100 * lib['gain']:+.0f} %" + ("" if lib["eligible"] else " (not at every case)")
            for arm, lib in sorted(v["libraries"].items())
        )
        print(f"{v['op']} {v['range']}: {v['cases']} cases; serve {v['serve']} (libraries over deltaserve: "
              f"{others or 'none timed'})")  # fmt: skip
    return 0 if verdicts else 2


def _record_checks(ctx: Context, case: dict[str, Any], checks: dict[str, Any]) -> None:
    for arm, check in checks.items():
        ctx.record["checks"].append({**case, "arm": arm, **check})
        status = "ok" if check["agrees"] else "DISAGREES" if "error" not in check else "ERROR"
        detail = check.get("error") or f"max abs {check['max_abs']:.3g}, max rel {check['max_rel']:.3g}, " \
            f"rel RMSE {check['rel_rmse']:.3g}"  # fmt: skip
        print(f"check {case['op']} {case['model']} {case['shape']} M={case['M']} {arm}: {status} ({detail})")
    ctx.save()  # a JIT build that runs past the call's limit still leaves the checks before it


def run_dense(ctx: Context, model: str, shape: tuple[str, int, int], arms: list[Arm]) -> None:
    """Check every arm at --check-tokens, then time the arms that ran at each M of --tokens."""
    names, rows, cols = shape
    device, dtype = ctx.device, ctx.dtype
    base = {"op": "dense", "model": model, "shape": names, "N": rows, "K": cols}
    if ctx.skip_all(base, ctx.args.tokens):
        return
    weight = random_fp8_weight(rows, cols, device=device)
    live = [arm for arm in arms if arm.available]
    merged: dict[str, dict[str, Any]] = {}
    for tokens in ctx.args.check_tokens:
        x = random_activation(tokens, cols, device, dtype)
        ref = fp8_linear_ref(x.float(), weight)  # fp32, unrounded
        checks = check_arms(live, lambda arm, x=x: arm.call(x, arm.prepare(weight)), ref)
        _record_checks(ctx, {**base, "M": tokens}, checks)
        for arm, check in checks.items():  # an arm agrees at this shape only if it agreed at every check
            merged[arm] = check if not check["agrees"] else merged.get(arm, check)
    ctx.record["vllm_triton_tables"].setdefault(f"{rows}x{cols}", dense_config_file(ctx.importer, rows, cols))
    ran = [arm for arm in live if "error" not in merged.get(arm.name, {})]
    for tokens in ctx.args.tokens:
        case = {**base, "M": tokens}
        if ctx.out_of_time():
            ctx.record["skipped"].append({**case, "why": "deadline"})
            continue
        began = time.monotonic()
        moved = fp8_bytes(rows, cols) + dtype.itemsize * tokens * (rows + cols)
        count = num_sets(moved, ctx.l2_bytes)
        weights = [weight] + [Fp8Weight.of(weight.weight.clone(), weight.scale.clone(), weight.block_n)
                              for _ in range(count - 1)]  # fmt: skip
        xs = [random_activation(tokens, cols, device, dtype) for _ in range(count)]
        calls = {}
        for arm in ran:
            prepared = [arm.prepare(w) for w in weights]
            calls[arm.name] = lambda i, arm=arm, prepared=prepared, xs=xs: arm.call(xs[i], prepared[i])
        timings = time_arms(calls, count, ctx.args.reps, ctx.timer)
        ctx.add_case({**case, "rotations": count}, moved, 2 * tokens * rows * cols, timings, merged)
        del weights, xs, calls
        _free(ctx)
        ctx.last_case_s = time.monotonic() - began
        ctx.save()


def run_moe(ctx: Context, model: str, shape: tuple[int, int, int, int], arms: list[Arm]) -> None:
    """Check every arm at --check-moe-tokens, then time the arms that ran at each T of --moe-tokens."""
    experts, inter, hidden, top_k = shape
    device, dtype = ctx.device, ctx.dtype
    base = {"op": "moe", "model": model, "shape": f"E={experts} I={inter} H={hidden} top-{top_k}"}
    base |= {"E": experts, "I": inter, "H": hidden, "top_k": top_k}
    if ctx.skip_all(base, ctx.args.moe_tokens):
        return
    w13 = random_fp8_weight(experts, 2 * inter, hidden, device=device)  # [E, gate | up rows, H]
    w2 = random_fp8_weight(experts, hidden, inter, device=device)
    live = [arm for arm in arms if arm.available]
    prepared = {arm.name: arm.prepare(w13, w2) for arm in live}

    def inputs(tokens: int) -> tuple[torch.Tensor, ...]:
        return (random_activation(tokens, hidden, device, dtype), *routing(tokens, experts, top_k, device, dtype))

    s = inputs(ctx.args.check_moe_tokens)
    ref = fused_moe_fp8_ref(s[0], w13, w2, s[1], s[2])  # the served rounding points, in the activation dtype
    checks = check_arms(live, lambda arm: arm.call(s, prepared[arm.name]), ref)
    _record_checks(ctx, {**base, "M": ctx.args.check_moe_tokens}, checks)
    ctx.record["vllm_moe_tables"].setdefault(base["shape"], moe_config_file(ctx.importer, experts, inter))
    ran = [arm for arm in live if "error" not in checks.get(arm.name, {})]
    for tokens in ctx.args.moe_tokens:
        case = {**base, "M": tokens}
        if ctx.out_of_time():
            ctx.record["skipped"].append({**case, "why": "deadline"})
            continue
        began = time.monotonic()
        sets = [inputs(tokens)]
        active = int(torch.unique(sets[0][2]).numel())  # experts this routing reads
        moved = (
            active * (fp8_bytes(2 * inter, hidden) + fp8_bytes(hidden, inter)) + 2 * dtype.itemsize * tokens * hidden
        )
        count = num_sets(moved, ctx.l2_bytes)
        sets += [inputs(tokens) for _ in range(count - 1)]  # fresh routing each: no call finds its experts in L2
        calls = {arm.name: lambda i, arm=arm, sets=sets: arm.call(sets[i], prepared[arm.name]) for arm in ran}
        timings = time_arms(calls, count, ctx.args.reps, ctx.timer)
        flops = 2 * tokens * top_k * 3 * inter * hidden
        ctx.add_case({**case, "rotations": count, "experts_hit": active}, moved, flops, timings, checks)
        del sets, calls
        _free(ctx)
        ctx.last_case_s = time.monotonic() - began
        ctx.save()


def _free(ctx: Context) -> None:
    if ctx.timer.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--ops", default="dense,moe", help="dense, moe or both")
    parser.add_argument("--tokens", type=_ints, default=_ints(DENSE_TOKENS), help="dense M values")
    parser.add_argument("--moe-tokens", type=_ints, default=_ints(MOE_TOKENS), help="MoE token counts")
    parser.add_argument("--arms", default=None, help="comma list of arm names to run (deltaserve always runs)")
    parser.add_argument("--check-tokens", type=_ints, default=[8, 256], help="M of the dense checks")
    parser.add_argument("--check-moe-tokens", type=int, default=32, help="T of the MoE check")
    parser.add_argument("--reps", type=int, default=20, help="interleaved passes per case (median)")
    parser.add_argument("--deadline-s", type=float, default=None, help="start no case that would end after this")
    parser.add_argument("--adopt-margin", type=float, default=0.10, help="a library serves where it beats ours by more")
    parser.add_argument("--dense-shape", action="append", default=[], metavar="NxK", help="instead of the models'")
    parser.add_argument("--moe-shape", action="append", default=[], metavar="E,I,H,TOPK", help="instead of the models'")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16",), default="bfloat16")
    parser.add_argument("--check-only", action="store_true", help="discover and check the arms; time nothing")
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default benchmarks/results/kernels/)")
    parser.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="RECORD",
                        help="print what serves each op and range of M over these records; run nothing")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device (--device cpu times the torch twin)")
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if set(args.ops) - {"dense", "moe"}:
        parser.error(f"--ops: dense and/or moe, not {args.ops}")
    unknown = [m for m in args.models.split(",") if m.strip() and m.strip() not in MODELS]
    if unknown and not (args.dense_shape or args.moe_shape):
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        args.out = ROOT / "benchmarks" / "results" / "kernels" / f"fp8-ab-{stamp}.json"
    if args.check_only:
        args.tokens, args.moe_tokens = [], []
    return args


def work(args: argparse.Namespace) -> list[tuple[str, str, Any]]:
    """(op, model, shape) in order: the --dense-shape / --moe-shape overrides, else each model's shapes."""
    items: list[tuple[str, str, Any]] = []
    if args.dense_shape or args.moe_shape:
        for text in args.dense_shape:
            rows, cols = (int(v) for v in text.lower().split("x"))
            items.append(("dense", "custom", ("custom", rows, cols)))
        items += [("moe", "custom", tuple(_ints(text))) for text in args.moe_shape]
        return [item for item in items if item[0] in args.ops]
    for model in (m.strip() for m in args.models.split(",") if m.strip()):
        text = text_config(model)
        if "dense" in args.ops:
            items += [("dense", model, shape) for shape in dense_shapes(text)]
        if "moe" in args.ops and moe_shape(text):
            items.append(("moe", model, moe_shape(text)))
    return items


def new_record(args: argparse.Namespace, arms: list[Arm], argv: list[str]) -> dict[str, Any]:
    is_cuda = args.device.startswith("cuda")
    l2_bytes = copy_gbps = None
    if is_cuda:
        from deltaserve.bench.kernels import copy_bandwidth_gbps

        l2_bytes = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
        copy_gbps = copy_bandwidth_gbps()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "kind": "fp8_ab",
        "gpu": torch.cuda.get_device_name(0) if is_cuda else None,
        "device": args.device,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_state(ROOT)["commit"],
        "command": shlex.join(["python", "benchmarks/fp8_ab.py", *argv]),
        "dtype": args.dtype,
        "copy_bandwidth_gbps": copy_gbps,
        "l2_bytes": l2_bytes,
        "tolerance": f"max |arm - ref| <= {TOLERANCE} * max |ref| (ref: fp8_linear_ref in fp32, fused_moe_fp8_ref)",
        "adopt_margin": args.adopt_margin,
        "arms": {f"{arm.op}/{arm.name}": arm.describe() for arm in arms},
        "missing": {f"{arm.op}/{arm.name}": arm.error for arm in arms if not arm.available},
        "checks": [],
        "results": [],
        "winners": [],
        "skipped": [],
        "ranges": [],
        "vllm_triton_tables": {},
        "vllm_moe_tables": {},
    }


def main(argv: list[str] | None = None, importer: Callable[[str], Any] = importlib.import_module) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.adopt_margin)
    items = work(args)
    if not items:
        print("fp8_ab: nothing to measure (no shape for these --models / --ops)", file=sys.stderr)
        return 2
    wanted = None if args.arms is None else {a.strip() for a in args.arms.split(",")} | {"deltaserve"}
    by_op = {"dense": dense_arms(importer), "moe": moe_arms(importer)}
    by_op = {op: [a for a in arms if wanted is None or a.name in wanted] for op, arms in by_op.items()}
    arms = [arm for op in args.ops for arm in by_op[op]]
    for arm in arms:
        state = "available" if arm.available else arm.error
        quant = "includes" if arm.quantizes_activation else "excludes"
        print(f"arm {arm.op}/{arm.name} ({arm.library}): {state}; {quant} the activation quantization")
    record = new_record(args, arms, argv)
    ctx = Context(args, record, importer)
    if ctx.copy_gbps:
        print(f"{record['gpu']}: copy ceiling {ctx.copy_gbps:.0f} GB/s (read + write), L2 {ctx.l2_bytes >> 20} MiB")
    for op, model, shape in items:
        (run_dense if op == "dense" else run_moe)(ctx, model, shape, by_op[op])
        ctx.save()
    return finish(ctx, range_verdicts, lambda row: f"{row['op']} {row['model']} {row['shape']} M={row['M']}",
                  lambda v: f"{v['op']} {v['range']}")  # fmt: skip


def finish(
    ctx: Any, ranges: Callable[[list[dict[str, Any]], float], list[dict[str, Any]]],
    case_label: Callable[[dict[str, Any]], str], range_label: Callable[[dict[str, Any]], str],
) -> int:  # fmt: skip
    """The end of a run (this tool's and attention_ab.py's): the cases a library wins, the verdict per range, the
    cases the deadline cut; saves the record. Exit code 1 when deltaserve's own arm disagreed with its twin."""
    record, args = ctx.record, ctx.args
    for row in record["winners"]:
        if row["adopt"] not in (None, "deltaserve"):
            print(f"adopt {row['adopt']}: {case_label(row)} (+{100 * row['library_gain']:.0f} % over deltaserve)")
    record["ranges"] = ranges(record["results"], args.adopt_margin)
    for v in record["ranges"]:
        print(f"range {range_label(v)} ({v['cases']} cases): serve {v['serve']}")
    if record["skipped"]:
        print(f"skipped {len(record['skipped'])} cases at the deadline (--deadline-s {args.deadline_s})")
    ctx.save()
    print(f"record: {args.out}")
    ours_bad = [c for c in record["checks"] if c["arm"] == "deltaserve" and not c["agrees"]]
    return 1 if ours_bad else 0


if __name__ == "__main__":
    sys.exit(main())
