"""Where a deltaserve decode step spends its time, whether the GPU waits for the host between steps, and which
Triton kernels compile while serving.

Run on the H200 from the repo root (no server: the engine in-process, dummy weights, async scheduling as served):
    python3 benchmarks/profile_decode.py --model /tmp/ds_models/q35-35b-a3b
The record goes to --out (default benchmarks/results/kernels/profile-decode-<UTC time>.json).

For each batch size B it prefills B random 1024-token prompts, then, in steady decode, measures
- `step_ms`: wall time per `LLMEngine.step()` (what TPOT sees, minus the HTTP server and the API process);
- `wait_ms`: of that, the time the host waits for the GPU (collecting a step's tokens, as the runner's step
  observer reports it): when it is > 0 the host is ahead and the GPU is the bottleneck; `host_ms = step_ms -
  wait_ms` is the host's own work per step;
- `gpu_idle_pct`: the share of the measured span in which no kernel or copy runs on the GPU (torch.profiler's
  CUDA activity, intervals merged): the gap between consecutive decode steps that async scheduling must close;
- `graph_ms`: GPU time of the captured decode graph alone (CUDA events around back-to-back replays), and
  `inter_step_gap_pct = (step_ms - graph_ms) / step_ms`: the GPU's wait between consecutive decode steps (the
  profiler's `gpu_idle_pct` also counts the launch gaps between kernels inside a graph).
A jit_cache_hook records every Triton specialization first met in this process with the phase it appeared in; a
kernel that first compiles in the `staggered` phase (requests arriving while others decode, as under `bench
serve`) is one the start-up warm-up missed, and costs a compile (or an autotune) inside a request.

Timings after a profiler session: once torch.profiler has run in a process CUPTI stays attached (torch keeps its
teardown off when CUDA graphs are in use) and every later kernel pays for it, ~0.25 ms a 35B-A3B decode step at B = 1
(docs/kernels-log.md). Each batch's step_ms and graph_ms are taken before its own profile, but
the second and later batch sizes and the staggered phase run after the first's: with the default --gpu-profile they
carry that overhead; --no-gpu-profile (no gpu_idle_pct) keeps them clean.

With --tensor-parallel-size N (N GPUs; rank 0 is profiled) each batch also reports `nccl_pct` and `allreduce_pct`:
the share of rank 0's GPU kernel time spent in NCCL kernels (all-reduces, the logits gather, the token broadcast)
and in the all-reduces alone. `graph_ms` is left out there (a graph replayed on rank 0 alone would wait on the
other ranks' collectives forever).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import triton

from deltaserve.bench.provenance import git_state
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine_config import EngineConfig
from deltaserve.runner.observer import StepTimings
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import StepPlan, StepResult

PHASE = {"name": "startup"}
COMPILES: list[dict[str, Any]] = []
T0 = time.monotonic()


def _jit_hook(*, key: str, repr: str, fn: Any, compile: Any, is_manual_warmup: bool, already_compiled: bool) -> None:
    COMPILES.append({"phase": PHASE["name"], "t_s": round(time.monotonic() - T0, 2), "kernel": repr[:400]})
    return None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab // 8, vocab * 7 // 8) for _ in range(length)] for _ in range(count)]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def _gpu_idle_share(prof: torch.profiler.profile) -> tuple[float, float]:
    """(share of the span with no kernel or copy running, span in ms) from the profiler's CUDA events."""
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not intervals:
        return 0.0, 0.0
    busy, cur_start, cur_end = 0.0, intervals[0][0], intervals[0][1]
    for lo, hi in intervals[1:]:
        if lo > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = lo, hi
        else:
            cur_end = max(cur_end, hi)
    busy += cur_end - cur_start
    span = max(hi for _, hi in intervals) - intervals[0][0]
    return 1.0 - busy / span, span / 1e3


def _kernel_share(prof: torch.profiler.profile, *needles: str) -> float:
    """Share of the CUDA kernel time in kernels whose name contains every needle (lower case)."""
    total = matched = 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        duration = e.time_range.end - e.time_range.start
        total += duration
        if all(needle in e.name.lower() for needle in needles):
            matched += duration
    return matched / total if total else 0.0


def _timed_steps(engine: LLMEngine, num_steps: int) -> tuple[float, float]:
    """(wall ms per step, ms per step the host spent waiting for the GPU in collect(), from the runner's step
    observer)."""
    waited = [0.0]

    def observe(plan: StepPlan, result: StepResult, timings: StepTimings) -> None:
        waited[0] += timings.wait_s

    engine.runner.set_step_observer(observe)
    try:
        _sync()
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step(by_output_kind=False)
        _sync()
        total = time.perf_counter() - start
    finally:
        engine.runner.set_step_observer(None)
    return total / num_steps * 1e3, waited[0] / num_steps * 1e3


def _num_emitted(engine: LLMEngine) -> int:
    """Output tokens held by the running sequences (sampled and applied)."""
    return sum(len(seq.output_token_ids) for seq in engine.scheduler.running)


def _count_spec_graph_runs(engine: LLMEngine) -> dict[str, list[int]]:
    """Wraps the runner's verify and width-1 graphs' run() with call counters (none without speculation)."""
    counts: dict[str, list[int]] = {}
    for name in ("spec_graphs", "spec_decode_graphs"):
        graphs = getattr(engine.runner, name, None)
        if graphs is None:
            continue
        calls = counts[name] = [0]
        run = graphs.run

        def counted(*args: Any, _run: Any = run, _calls: list[int] = calls) -> Any:
            _calls[0] += 1
            return _run(*args)

        graphs.run = counted
    return counts


def _restore_spec_graph_runs(engine: LLMEngine) -> None:
    for name in ("spec_graphs", "spec_decode_graphs"):
        graphs = getattr(engine.runner, name, None)
        if graphs is not None and "run" in vars(graphs):
            del graphs.run


def _top_kernels(prof: torch.profiler.profile, num_steps: int, count: int) -> list[dict[str, Any]]:
    """The count kernels with the most CUDA time: name, ms and launches per step."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.end <= e.time_range.start:
            continue
        entry = totals[e.name[:120]]
        entry[0] += (e.time_range.end - e.time_range.start) / 1e3
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [{"kernel": name, "ms_per_step": round(ms / num_steps, 4), "launches_per_step": round(n / num_steps, 2)}
            for name, (ms, n) in ranked]  # fmt: skip


def _replay_ms(graph: torch.cuda.CUDAGraph, num_steps: int) -> float:
    """GPU ms of one replay of a captured graph, replayed back to back (one warm replay first)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_steps):
        graph.replay()
    end.record()
    _sync()
    return start.elapsed_time(end) / num_steps


def _spec_graph_split(engine: LLMEngine, num_steps: int) -> dict[str, Any]:
    """While speculating: the GPU ms of the verify graph (the target's 1 + k token forward) and of each
    post-sampling graph (GDN commit and the drafter's passes, per draft count) of the bucket the last step replayed,
    each replayed back to back. What a verify step costs beyond their sum is the sampler, the accept step and the
    host. Replaying rewrites the bucket's KV, scratch and state slots with the same values' kind (finite), so the
    steps measured after it time the same work; their tokens are not checked here."""
    spec = getattr(engine.runner, "spec_graphs", None)
    if spec is None or not spec.is_captured or spec.size not in spec.graphs or engine.config.tensor_parallel_size > 1:
        return {}
    post = {str(drafts): round(_replay_ms(graph, num_steps), 3)
            for (size, drafts), graph in spec.post_graphs.items() if size == spec.size}  # fmt: skip
    return {
        "verify_bucket": spec.size,
        "verify_graph_ms": round(_replay_ms(spec.graphs[spec.size], num_steps), 3),
        "post_graph_ms": post,
    }


def _spec_op_split(engine: LLMEngine) -> dict[str, Any]:
    """While speculating: one eager (uncaptured) run of the bucket's verify forward and of its post-sampling work
    (commit, MTP pass, chained drafts) under the profiler with the model's op labels on, each kernel's GPU time
    attributed to its op as benchmarks/profile_prefill.py does for a prefill: where the verify step's GPU time goes,
    op by op. Kernel times, not the graph's wall time (eager launches leave gaps the graph does not)."""
    spec = getattr(engine.runner, "spec_graphs", None)
    if spec is None or spec.size not in spec.graphs or engine.config.tensor_parallel_size > 1:
        return {}
    import profile_prefill as pp

    from deltaserve.model import labels

    device = torch.device("cuda")
    size, drafts = spec.size, max(spec.draft_counts)
    calls = {"verify": lambda: spec._forward(size), "post": lambda: spec._after_accept(size, drafts)}
    split: dict[str, Any] = {}
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name, call in calls.items():
        with torch.inference_mode():
            call()  # warm: nothing compiles inside the profile
            _sync()
            with (
                labels.enabled(),
                pp.triton_launches() as launches,
                torch.profiler.profile(activities=activities) as prof,
            ):
                call()
                _sync()
        cells, kernels = pp.attribute(list(prof.events()), device, launches)
        ops = sorted(((op, cell[0], cell[1]) for (op, _), cell in cells.items()), key=lambda row: -row[1])
        split[name] = {
            "kernel_ms": round(kernels["total_us"] / 1e3, 3),
            "ops": [{"op": op, "ms": round(us / 1e3, 4), "kernels": int(n)} for op, us, n in ops],
            "launch_order": kernels["launch_order"],
            "top": kernels["top"][:12],
        }
    return split


def measure_batch(
    engine: LLMEngine, batch_size: int, input_len: int, num_steps: int, rng: random.Random, is_profiled: bool = True
) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    for i, prompt in enumerate(_prompts(rng, batch_size, input_len, vocab)):
        engine.add_request(f"b{batch_size}-{i}", prompt, _params(num_steps * 4 + 64))
    scheduler = engine.scheduler
    while scheduler.waiting or any(not seq.output_token_ids for seq in scheduler.running):
        engine.step(by_output_kind=False)
    for _ in range(5):
        engine.step(by_output_kind=False)
    emitted_before = _num_emitted(engine)
    graph_calls = _count_spec_graph_runs(engine)
    step_ms, wait_ms = _timed_steps(engine, num_steps)
    tokens_per_step = (_num_emitted(engine) - emitted_before) / num_steps  # every sequence's, summed
    spec_graphed_steps = {name: calls[0] for name, calls in graph_calls.items()}
    _restore_spec_graph_runs(engine)
    # The decode graph alone: its bucket replayed back to back over the inputs of the last step (before this batch's
    # profile: see the module docstring on timings after a profiler session).
    graphs = engine.runner.graphs
    graph_ms = None
    if graphs is not None and batch_size <= graphs.max_batch and engine.config.tensor_parallel_size == 1:
        size = next(s for s in graphs.sizes if s >= batch_size)
        graph_ms = _replay_ms(graphs.graphs[size], num_steps)
    spec_split = _spec_graph_split(engine, num_steps)
    activities = [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() and is_profiled else []
    idle, span_ms = 0.0, 0.0
    shares: dict[str, float] = {}
    if activities:
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(num_steps):
                engine.step(by_output_kind=False)
            _sync()
        idle, span_ms = _gpu_idle_share(prof)
        shares["top_kernels"] = _top_kernels(prof, num_steps, 25)
        if engine.config.tensor_parallel_size > 1:
            shares = {
                "nccl_pct": round(100 * _kernel_share(prof, "nccl"), 2),
                "allreduce_pct": round(100 * _kernel_share(prof, "nccl", "allreduce"), 2),
            }
    if activities:  # after the timings: the eager runs rewrite the bucket's buffers (same kind of values)
        try:
            shares["spec_ops"] = _spec_op_split(engine)
        except Exception as exc:  # a diagnostic: its failure is recorded, the batch's timings above are kept
            shares["spec_ops"] = {"error": repr(exc)[:500]}
    for request_id in [r for r in list(engine.requests) if r.startswith(f"b{batch_size}-")]:
        engine.abort_request(request_id)
    while engine.core.has_unfinished():
        engine.step(by_output_kind=False)
    return {
        "batch_size": batch_size,
        "step_ms": round(step_ms, 3),
        "wait_ms": round(wait_ms, 3),
        "host_ms": round(step_ms - wait_ms, 3),
        "gpu_idle_pct": round(100 * idle, 2),
        "profiled_ms_per_step": round(span_ms / num_steps, 3) if span_ms else None,
        "graph_ms": None if graph_ms is None else round(graph_ms, 3),
        # speculative decoding: tokens emitted per step over the batch, the per-sequence ms per token (what TPOT
        # sees), and how many of the timed steps replayed the verify / width-1 graphs (the rest ran eager)
        "tokens_per_step": round(tokens_per_step, 3),
        "ms_per_token_per_seq": round(step_ms * batch_size / tokens_per_step, 3) if tokens_per_step else None,
        "spec_graphed_steps": spec_graphed_steps,
        # the gap between consecutive graph replays as a share of the step: what async scheduling must keep small
        "inter_step_gap_pct": None if graph_ms is None else round(100 * (step_ms - graph_ms) / step_ms, 2),
        **spec_split,
        **shares,
    }


def staggered(
    engine: LLMEngine, concurrency: int, num_requests: int, input_len: int, osl: int, rng: random.Random
) -> dict[str, Any]:
    """Requests arrive as others finish (max concurrency `concurrency`), as under `bench serve`."""
    vocab = engine.model_config.vocab_size
    pending = _prompts(rng, num_requests, input_len, vocab)
    active = 0
    finished = 0
    step_times = []
    next_id = 0
    while finished < num_requests:
        while active < concurrency and pending:
            engine.add_request(f"s{concurrency}-{next_id}", pending.pop(), _params(osl))
            next_id += 1
            active += 1
        t = time.perf_counter()
        outputs = engine.step(by_output_kind=False)
        step_times.append(time.perf_counter() - t)
        done = sum(1 for o in outputs if o.finished)
        finished += done
        active -= done
    step_times.sort()
    return {"concurrency": concurrency, "num_steps": len(step_times),
            "step_ms_median": round(step_times[len(step_times) // 2] * 1e3, 2),
            "step_ms_max": round(step_times[-1] * 1e3, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default: see the module docstring)")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staggered", default="8,32", help="concurrencies of the staggered-arrival phase")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="as `serve` (an 80 GB card: 0.92)")
    parser.add_argument("--speculative-config", default=None, help="vLLM's JSON, as `serve` takes it (MTP steps)")
    parser.add_argument(
        "--gpu-profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile each batch for gpu_idle_pct (and the TP shares); --no-gpu-profile keeps every timing clean",
    )
    args = parser.parse_args()
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        args.out = Path(__file__).resolve().parent / "results" / "kernels" / f"profile-decode-{stamp}.json"
    triton.knobs.runtime.jit_cache_hook = _jit_hook
    rng = random.Random(0)
    result: dict[str, Any] = {
        "command": "python3 " + shlex.join(sys.argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_state(Path(__file__).resolve().parents[1])["commit"],
        "model": args.model,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tensor_parallel_size": args.tensor_parallel_size,
        "gpu_profile": args.gpu_profile,
        "speculative_config": args.speculative_config,
        # every launch waits for its kernel: a debugging run (session 23 located a fault so), never a timing
        "cuda_launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"),
    }
    if result["cuda_launch_blocking"]:
        print("CUDA_LAUNCH_BLOCKING is set: every launch waits for its kernel, so the timings below are not "
              "comparable to any record", flush=True)  # fmt: skip
    t = time.monotonic()
    max_batch = max(int(b) for b in args.batches.split(","))
    config = EngineConfig(model=args.model, load_format="dummy", max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max_batch,
                          tensor_parallel_size=args.tensor_parallel_size,
                          speculative_config=args.speculative_config)  # fmt: skip
    engine = LLMEngine(config)
    result["startup_s"] = round(time.monotonic() - t, 1)
    # while speculating, a max_num_seqs past what the budget holds with each sequence's verify scratch is lowered
    # (runner/memory.py): a batch above it queues, so the record says what ran
    result["max_num_seqs"] = engine.runner.max_num_seqs
    if engine.runner.max_num_seqs < max_batch:
        print(f"max_num_seqs {engine.runner.max_num_seqs} < the largest batch {max_batch}: larger batches queue",
              flush=True)  # fmt: skip
    result["batches"] = []
    result["staggered"] = []

    def save() -> None:
        result["compiles"] = COMPILES
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    save()
    PHASE["name"] = "fixed-batches"
    for batch_size in [int(b) for b in args.batches.split(",")]:
        result["batches"].append(measure_batch(engine, batch_size, args.input_len, args.steps, rng, args.gpu_profile))
        print(json.dumps(result["batches"][-1]), flush=True)
        save()
    PHASE["name"] = "staggered"
    for concurrency in [int(c) for c in args.staggered.split(",") if c]:
        result["staggered"].append(staggered(engine, concurrency, concurrency * 3, args.input_len, 64, rng))
        print(json.dumps(result["staggered"][-1]), flush=True)
        save()
    by_phase: dict[str, int] = defaultdict(int)
    for entry in COMPILES:
        by_phase[entry["phase"]] += 1
    print("triton specializations first met, by phase:", dict(by_phase), flush=True)
    for entry in COMPILES:
        if entry["phase"] != "startup":
            print(entry["phase"], entry["t_s"], entry["kernel"][:300], flush=True)
    save()
    engine.shutdown()


if __name__ == "__main__":
    main()
