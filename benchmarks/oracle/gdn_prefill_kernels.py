"""GDN prefill kernel time of vLLM 0.26.0's two backends, in isolation, on the H200 (issue 17, the magnitude).

vLLM's production configuration on SM90 runs FlashInfer's chunk_gated_delta_rule; the offline oracle runs
vLLM's Triton/FLA one (`--gdn-prefill-backend triton`, registry deviation gdn-prefill-triton). This script times
both of vLLM's own entry points (qwen_gdn_linear_attn.fi_chunk_gated_delta_rule and fla_chunk_gated_delta_rule)
on the inputs vLLM gives them (l2-normalised bf16 q/k, bf16 v, fp32 log-decay g and beta, an fp32 state
[N, HV, dv, dk], in-kernel l2norm off), per layer, for the Qwen3.5-35B-A3B (HK 16, HV 32, 30 GDN layers) and
27B (HK 16, HV 48, 48 GDN layers) shapes, at ISL 1024 and 3072 as one sequence and as a batch of 8 x 1024 (one
8192-token step). It prints per-layer milliseconds (median of --iters after warm-up, CUDA events), the
whole-model GDN prefill estimate (x layers) and the Triton/FlashInfer ratio, and writes JSON to --out.

    PYTHONPATH=/tmp/flashinfer_site:/tmp/flashinfer_site/nvidia_cutlass_dsl/dsl_packages:/tmp/vllm_site \\
        python3 benchmarks/oracle/gdn_prefill_kernels.py --out $OUT/gdn-prefill-kernels.json

With --backends triton it runs without FlashInfer (the Triton half alone). `--backends ours,triton,flashinfer` also
times deltaserve's own GDN prefill (deltaserve.kernels.gdn_prefill, the served Triton chunked kernel) on inputs of the
same shapes, side by side: the rule that a kernel of our own stays only where it beats the field's library. Ours is
timed as the served op runs, so it also does what vLLM runs in separate launches before its kernel (the q/k l2norm,
the decay and beta gates from a, b): its time is an upper bound on the like-for-like kernel. The isl16384 case is
issue 35's long prompt. `ours-flashinfer` times deltaserve's FlashInfer path as served (gdn_prefill with
backend="flashinfer": the prep, the state gather and scatter and FlashInfer's kernel; docs/kernels.md). --cases
picks the sizes as LEN or NxLEN (default: the four above; 2048,4096,8192,4x2048 place the crossover between the
kernels). --same-values gives the peers our inputs' values (our prep's plain-torch twin applied to them), so that
every backend times one set of values; --profile adds each backend's GPU kernels per call (torch.profiler), which
locates a path's overhead beside its main kernel (ours-flashinfer measured x1.4-2.2 the bare kernel on the H100);
the profiles run after every case is timed, as a second pass over the same values.
`triton-served` and `flashinfer-served` time vLLM's layer path on our inputs' values (its fused post-conv prep, the
state gather and write-back around each kernel): the like-for-like peers of `ours` and `ours-flashinfer`.
`--baseline FILE` (an earlier deltaserve/kernels/gdn_triton.py, e.g. `git show REV:deltaserve/kernels/gdn_triton.py >
ab/gdn_triton.py`) adds `ours-baseline`: that file's gdn_prefill_triton on our inputs, before / after a change to
our kernel in one process. `--variant FILE` (repeatable) adds `ours@STEM` for each further gdn_triton.py (a
candidate, or an ablation that drops one phase of a kernel to see what that phase costs), without naming it in
--backends. With only `ours` backends vLLM need not be importable. `--scan-configs
BVxWARPSxSTAGES,...` times our scan launch alone at each launch configuration (gdn_triton.scan_launch replaced
for the call, so the served rule's pick is overridden; GPU time of `_gdn_chunk_scan_kernel` by torch.profiler):
the configuration FLA autotunes and ours fixes.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# (name, HK, HV, number of GDN layers): the two benchmark shapes (benchmarks/oracle/make_dummy_models.py).
SHAPES = (("35b-a3b", 16, 32, 30), ("27b", 16, 48, 48))
HEAD_DIM = 128
# (label, sequence lengths): one prompt at each ISL, and one 8192-token step of 8 prompts.
CASES = (("isl1024", (1024,)), ("isl3072", (3072,)), ("8x1024", (1024,) * 8), ("isl16384", (16384,)))


def parse_cases(spec: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """`--cases`: a comma list of LEN (one sequence of LEN tokens) or NxLEN (N sequences of LEN), e.g.
    "2048,4096,4x2048" -> (("isl2048", (2048,)), ("isl4096", (4096,)), ("4x2048", (2048,) * 4))."""
    cases = []
    for word in (w.strip() for w in spec.split(",")):
        if not word:
            continue
        count, sep, length = word.rpartition("x")
        is_bad_count = bool(sep) and (not count.isdigit() or int(count) < 1)
        if not length.isdigit() or int(length) < 1 or is_bad_count:
            raise ValueError(f"--cases: {word!r} is not LEN or NxLEN")
        label = f"{int(count)}x{int(length)}" if count else f"isl{int(length)}"
        cases.append((label, (int(length),) * (int(count) if count else 1)))
    if not cases:
        raise ValueError("--cases: no case given")
    return tuple(cases)


def make_inputs(
    num_tokens: int, num_seqs: int, num_k_heads: int, num_v_heads: int, head_dim: int, seed: int
) -> dict[str, Any]:
    """vLLM-shaped inputs for `num_seqs` sequences of `num_tokens` each, packed as one varlen batch."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    total = num_tokens * num_seqs

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.float32)

    q = torch.nn.functional.normalize(randn(1, total, num_k_heads, head_dim), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(randn(1, total, num_k_heads, head_dim), dim=-1).to(torch.bfloat16)
    v = randn(1, total, num_v_heads, head_dim).to(torch.bfloat16)
    # log decay in (-0.5, 0): the range softplus(a + dt_bias) * -exp(A_log) takes for the releases
    g = -0.5 * torch.rand(1, total, num_v_heads, generator=generator, device="cuda")
    beta = torch.sigmoid(randn(1, total, num_v_heads))
    state = 0.01 * randn(num_seqs, num_v_heads, head_dim, head_dim)
    cu_seqlens = torch.arange(0, total + 1, num_tokens, device="cuda", dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": state, "cu_seqlens": cu_seqlens}


def make_our_inputs(
    num_tokens: int, num_seqs: int, num_k_heads: int, num_v_heads: int, head_dim: int, seed: int
) -> dict[str, Any]:
    """deltaserve.kernels.gdn_prefill's inputs for the same batch: raw bf16 q/k/v and a/b (the op norms q/k and
    makes the gates itself), the checkpoint's A_log / dt_bias, fp32 states [N, HV, dk, dv] in slots 0..N-1."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    total = num_tokens * num_seqs

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.float32)

    return {
        "q": randn(total, num_k_heads, head_dim).to(torch.bfloat16),
        "k": randn(total, num_k_heads, head_dim).to(torch.bfloat16),
        "v": randn(total, num_v_heads, head_dim).to(torch.bfloat16),
        "a": randn(total, num_v_heads).to(torch.bfloat16),
        "b": randn(total, num_v_heads).to(torch.bfloat16),
        "A_log": torch.log(torch.empty(num_v_heads, device="cuda").uniform_(1, 16, generator=generator)),
        "dt_bias": 0.5 * randn(num_v_heads),
        "ssm_states": 0.01 * randn(num_seqs, num_v_heads, head_dim, head_dim),
        "query_start_loc": torch.arange(0, total + 1, num_tokens, device="cuda", dtype=torch.int32),
        "state_indices": torch.arange(num_seqs, device="cuda", dtype=torch.int32),
        "has_initial_state": torch.ones(num_seqs, device="cuda", dtype=torch.bool),
        "max_query_len": num_tokens,  # the runner's host hint (the scan's launch rule reads it)
    }


# Which inputs each backend is timed on: ours (make_our_inputs: raw q/k, gates from A_log), the peers' kernel inputs
# (make_inputs, or peer_inputs_from_ours with --same-values) or vLLM's layer inputs (served_inputs_from_ours).
INPUT_KIND = {
    "ours": "ours", "ours-flashinfer": "ours", "ours-baseline": "ours", "triton": "peer", "flashinfer": "peer",
    "triton-served": "served", "flashinfer-served": "served",
}  # fmt: skip


def peer_inputs_from_ours(ours: dict[str, Any]) -> dict[str, Any]:
    """vLLM-shaped inputs holding the same values as `ours`: q/k normed and g/beta made by the prep's plain-torch twin
    (gdn_prefill_prep_ref, vLLM's rounding points), the start states transposed to [N, HV, dv, dk]. With these the
    peers and our paths time one set of values (make_inputs draws its own: pre-normed q/k, g in (-0.5, 0))."""
    from deltaserve.kernels.gdn_flashinfer import gdn_prefill_prep_ref

    names = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
    q_hat, k_hat, v, g, beta = gdn_prefill_prep_ref(*(ours[name] for name in names))
    states = ours["ssm_states"].transpose(-1, -2).contiguous()  # [N, HV, dv, dk]
    return {
        "q": q_hat[None], "k": k_hat[None], "v": v[None], "g": g[None], "beta": beta[None],
        "initial_state": states, "cu_seqlens": ours["query_start_loc"],
    }  # fmt: skip


def served_inputs_from_ours(ours: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's GDN layer holds before its prefill, with `ours`' values: the conv output rows [T, q | k | v] (one
    contiguous tensor, as its split reads it), a, b, A_log, dt_bias, its state cache [slots, HV, dv, dk] (ours
    transposed, a copy made outside the timing) and the metadata (cu_seqlens, slots, has_initial_state)."""
    import torch

    num_tokens = ours["q"].shape[0]
    rows = [ours[name].reshape(num_tokens, -1) for name in ("q", "k", "v")]
    return {
        "conv_output": torch.cat(rows, dim=1).contiguous(),  # [T, 2 HK dk + HV dv]
        "a": ours["a"], "b": ours["b"], "A_log": ours["A_log"], "dt_bias": ours["dt_bias"],
        "ssm_state": ours["ssm_states"].transpose(-1, -2).contiguous(),  # [slots, HV, dv, dk]
        "cu_seqlens": ours["query_start_loc"], "state_indices": ours["state_indices"].long(),
        "has_initial_state": ours["has_initial_state"], "num_k_heads": ours["q"].shape[1],
    }  # fmt: skip


def vllm_served(kernel: Any) -> Any:
    """vLLM's prefill as its layer runs it (qwen_gdn_linear_attn, the prefill branch): the fused post-conv prep
    (split, l2norm, gates; g not exponentiated), the start states gathered from its cache with the rows without an
    initial state zeroed, the kernel, the final states written back: the like-for-like peer of our served op
    (`ours`, whose time includes its norms and gates), where the bare `triton` / `flashinfer` rows exclude them."""

    def run(**inputs: Any) -> Any:
        from vllm.third_party.flash_linear_attention.ops import fused_post_conv_prep

        head_dim = inputs["ssm_state"].shape[-1]
        q, k, v, g, beta = fused_post_conv_prep(
            conv_output=inputs["conv_output"], a=inputs["a"], b=inputs["b"], A_log=inputs["A_log"],
            dt_bias=inputs["dt_bias"], num_k_heads=inputs["num_k_heads"], head_k_dim=head_dim, head_v_dim=head_dim,
            apply_l2norm=True, output_g_exp=False,
        )  # fmt: skip
        state = inputs["ssm_state"]
        initial = state[inputs["state_indices"]]
        initial[~inputs["has_initial_state"], ...] = 0
        out, final = kernel(
            q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], initial_state=initial,
            output_final_state=True, cu_seqlens=inputs["cu_seqlens"], use_qk_l2norm_in_kernel=False,
        )  # fmt: skip
        state[inputs["state_indices"]] = final.to(state.dtype)
        return out

    return run


def profile_launches(fn: Any, inputs: dict[str, Any], iters: int) -> list[dict[str, Any]]:
    """Per GPU kernel of `iters` calls after the warm-up (torch.profiler): name, calls per call of fn, µs per call of
    fn, most expensive first: where a path's time goes beside its main kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn(**inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(**inputs)
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "cuda_time_total", 0.0)
        if device_us > 0:
            rows.append({"kernel": event.key[:120], "calls": round(event.count / iters, 2),
                         "us": round(device_us / iters, 1)})  # fmt: skip
    return sorted(rows, key=lambda row: -row["us"])


def _call_vllm(fn: Any) -> Any:
    """vLLM's entry points, as its layer calls them here: pre-normed q/k, the final state returned."""
    return lambda **inputs: fn(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=False)


def time_kernel(fn: Any, inputs: dict[str, Any], iters: int) -> list[float]:
    """Milliseconds per call (CUDA events), after three warm-up calls (the first compiles)."""
    import torch

    for _ in range(3):
        fn(**inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(**inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def load_baseline(path: str) -> Any:
    """`--baseline` / `--variant`: another gdn_triton.py imported as a module of its own (it imports deltaserve's
    helpers as the served file does), returning its gdn_prefill_triton called with the inputs it takes."""
    name = "deltaserve.kernels._gdn_triton_" + "".join(c if c.isalnum() else "_" for c in Path(path).stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--baseline: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module.gdn_prefill_triton
    # an older file may predate an argument of ours (e.g. the max_query_len hint): it gets the ones it takes
    takes = set(inspect.signature(kernel).parameters)

    @functools.wraps(kernel)
    def call(**inputs: Any) -> Any:
        return kernel(**{name: value for name, value in inputs.items() if name in takes})

    return call


def parse_scan_configs(spec: str) -> list[tuple[int, int, int]]:
    """`--scan-configs`: "32x4x2,64x4x3" -> [(32, 4, 2), (64, 4, 3)] (BV, warps, stages)."""
    configs = []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        parts = word.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--scan-configs: {word!r} is not BVxWARPSxSTAGES")
        configs.append((int(parts[0]), int(parts[1]), int(parts[2])))
    if not configs:
        raise ValueError("--scan-configs: no configuration given")
    return configs


def time_scan_configs(configs: list[tuple[int, int, int]], inputs: dict[str, Any], iters: int) -> list[dict[str, Any]]:
    """Our prefill at each scan launch configuration: the scan kernel's GPU µs a call (and every launch's, to see
    that nothing else moved), gdn_triton.scan_launch replaced for the call and restored after."""
    from deltaserve.kernels import gdn_triton

    served = gdn_triton.scan_launch
    results = []
    try:
        for config in configs:
            gdn_triton.scan_launch = lambda *args, config=config: config
            entry: dict[str, Any] = {"bv": config[0], "warps": config[1], "stages": config[2]}
            try:
                launches = profile_launches(gdn_triton.gdn_prefill_triton, inputs, iters)
                scan = [k for k in launches if k["kernel"].startswith("_gdn_chunk_scan_kernel")]
                entry["scan_us"] = scan[0]["us"] if scan else None
                entry["all_us"] = round(sum(k["us"] for k in launches), 1)
            except Exception as exc:  # a configuration that does not compile or fit names why
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            results.append(entry)
    finally:
        gdn_triton.scan_launch = served
    return results


def vllm_kernels() -> dict[str, Any]:
    """The vLLM backends (imported only when one is asked for: `ours` alone runs without the vLLM bundle)."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

    return {
        "triton": _call_vllm(gdn.fla_chunk_gated_delta_rule),
        "flashinfer": _call_vllm(gdn.fi_chunk_gated_delta_rule),
        "triton-served": vllm_served(gdn.fla_chunk_gated_delta_rule),
        "flashinfer-served": vllm_served(gdn.fi_chunk_gated_delta_rule),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="triton,flashinfer")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--deadline-s", type=float, default=None, help="start no case after this many seconds")
    parser.add_argument("--cases", default=None, help="LEN or NxLEN, comma-separated (default: 1024,3072,8x1024,16384)")
    parser.add_argument("--commit", default=None, help="the commit the record names (the device tree has no .git)")
    parser.add_argument(
        "--same-values",
        action="store_true",
        help="time the peers on our inputs' values (prep twin applied) instead of their own draw",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also record each backend's GPU kernels per call (torch.profiler) for every case: a path's overhead",
    )
    parser.add_argument("--baseline", default=None, help="an earlier gdn_triton.py, timed as the ours-baseline backend")
    parser.add_argument("--variant", action="append", default=[], help="another gdn_triton.py, timed as ours@STEM")
    parser.add_argument("--scan-configs", default=None, help="BVxWARPSxSTAGES,...: our scan at each (ours only)")
    args = parser.parse_args()
    try:
        cases = parse_cases(args.cases) if args.cases else CASES
        scan_configs = parse_scan_configs(args.scan_configs) if args.scan_configs else None
    except ValueError as exc:
        print(exc)
        return 2
    began = time.monotonic()
    import torch

    from deltaserve.kernels import gdn_prefill

    kernels: dict[str, Any] = {
        "ours": gdn_prefill,
        "ours-flashinfer": functools.partial(gdn_prefill, backend="flashinfer"),
    }
    peers = ("triton", "flashinfer", "triton-served", "flashinfer-served")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(kernels) - set(peers) - {"ours-baseline"}
    if unknown or not backends:
        print(f"unknown backends {sorted(unknown)}; choose from {sorted([*kernels, *peers, 'ours-baseline'])}")
        return 2
    if ("ours-baseline" in backends) != (args.baseline is not None):
        print("--baseline FILE and the ours-baseline backend go together")
        return 2
    # other gdn_triton.py files, timed on our inputs: --baseline (named in --backends) and each --variant (added)
    variants = [(f"ours@{Path(path).stem}", path) for path in args.variant]
    files = ([("ours-baseline", args.baseline)] if args.baseline is not None else []) + variants
    if len({label for label, _ in variants}) != len(variants):
        print("--variant: two files with one name")
        return 2
    for label, path in files:
        kernels[label] = load_baseline(path)
        INPUT_KIND[label] = "ours"
    backends += [label for label, _ in variants]
    if set(backends) & set(peers):
        kernels.update(vllm_kernels())
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    kinds = {INPUT_KIND[backend] for backend in backends}

    def inputs_by_kind(shapes: tuple[int, ...]) -> dict[str, dict[str, Any]]:
        """Each input kind's tensors for one case, built from seed 0 (a second build gives the same values)."""
        needs_ours = bool(kinds & {"ours", "served"}) or ("peer" in kinds and args.same_values)
        ours = make_our_inputs(*shapes, seed=0) if needs_ours else {}
        given_by_kind = {"ours": ours}
        if "served" in kinds:
            given_by_kind["served"] = served_inputs_from_ours(ours)
        if "peer" in kinds:
            same = args.same_values
            given_by_kind["peer"] = peer_inputs_from_ours(ours) if same else make_inputs(*shapes, seed=0)
        return given_by_kind

    timed: list[tuple[dict[str, Any], tuple[int, ...]]] = []
    for shape, num_k_heads, num_v_heads, num_layers in SHAPES:
        for case, lengths in cases:
            if args.deadline_s is not None and time.monotonic() - began > args.deadline_s:
                skipped.append(f"{shape} {case}")
                print(f"skipped {shape} {case}: past --deadline-s {args.deadline_s:g}", flush=True)
                continue
            shapes = (lengths[0], len(lengths), num_k_heads, num_v_heads, HEAD_DIM)
            given_by_kind = inputs_by_kind(shapes)
            row: dict[str, Any] = {"shape": shape, "case": case, "num_tokens": sum(lengths)}
            row["num_gdn_layers"] = num_layers
            if scan_configs is not None:
                row["scan_configs"] = time_scan_configs(scan_configs, given_by_kind["ours"], args.iters)
                for entry in row["scan_configs"]:
                    print(f"  {shape} {case} scan {entry}", flush=True)
            for backend in backends:
                try:
                    times = time_kernel(kernels[backend], given_by_kind[INPUT_KIND[backend]], args.iters)
                    row[f"{backend}_ms_per_layer"] = round(statistics.median(times), 4)
                    row[f"{backend}_ms_model"] = round(statistics.median(times) * num_layers, 3)
                except Exception as exc:  # one backend failing must not hide the other's numbers
                    row[f"{backend}_error"] = f"{type(exc).__name__}: {exc}"
            if "triton_ms_per_layer" in row and "flashinfer_ms_per_layer" in row:
                row["triton_over_flashinfer"] = round(row["triton_ms_per_layer"] / row["flashinfer_ms_per_layer"], 3)
            for peer in ("flashinfer", "triton", "flashinfer-served", "triton-served", *(label for label, _ in files)):
                if "ours_ms_per_layer" in row and f"{peer}_ms_per_layer" in row:
                    row[f"ours_over_{peer}"] = round(row["ours_ms_per_layer"] / row[f"{peer}_ms_per_layer"], 3)
            if "ours-flashinfer_ms_per_layer" in row and "flashinfer_ms_per_layer" in row:
                served, bare = row["ours-flashinfer_ms_per_layer"], row["flashinfer_ms_per_layer"]
                row["ours-flashinfer_over_flashinfer"] = round(served / bare, 3)
            rows.append(row)
            timed.append((row, shapes))
            print(json.dumps(row), flush=True)
            del given_by_kind  # the case's tensors, before empty_cache
            torch.cuda.empty_cache()
    # Profiles only after every timing: once torch.profiler has run in a process, later launches seem to cost the
    # host more (a record that profiled each backend right after timing it timed every later backend up to x2.5
    # slower than the same case timed without profiles, the first one not), and the smaller cases are host-bound.
    for row, shapes in timed if args.profile else []:
        given_by_kind = inputs_by_kind(shapes)
        for backend in backends:
            if f"{backend}_error" not in row:
                row[f"{backend}_kernels"] = profile_launches(kernels[backend], given_by_kind[INPUT_KIND[backend]], 5)
        for key in (key for key in row if key.endswith("_kernels")):
            print(f"  {row['shape']} {row['case']} {key}: "
                  + "; ".join(f"{k['us']} us x{k['calls']} {k['kernel'][:60]}" for k in row[key][:6]))  # fmt: skip
        del given_by_kind
        torch.cuda.empty_cache()
    record = {
        "kind": "gdn-prefill-kernels",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": args.commit,
        "command": " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "baseline": args.baseline,
        "variants": args.variant,
        "head_dim": HEAD_DIM,
        "iters": args.iters,
        "same_values": args.same_values,
        "rows": rows,
        "skipped": skipped,
    }
    for library in ("vllm", "flashinfer"):
        try:
            record[library] = __import__(library).__version__
        except Exception as exc:
            record[library] = f"not importable: {exc}"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    failed = [r for r in rows if any(k.endswith("_error") for k in r)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
