"""Where a deltaserve decode step spends its time on the GPU, and which Triton kernels compile while serving.

Run on the H200 from the repo root (no server: the engine in-process, dummy weights):
    python3 benchmarks/profile_decode.py --model /tmp/ds_models/q35-35b-a3b --out $OUT/profile.json

For each batch size B it prefills B random 1024-token prompts, then measures
- `step_ms`: wall time of `LLMEngine.step()` for decode steps (what TPOT sees, minus the HTTP server);
- `step_phase_ms`: the same steps with a device sync around schedule, input building, graph replay, sampling
  and advance (`other`: the engine's stop rules, detokenisation and outputs);
- `graph_ms`: GPU time of the captured decode graph alone (CUDA events around `replay`, inputs already on
  the device), so `step_ms - graph_ms` is the host-side cost per step (input building, copies, sampling);
- `kernels`: a torch.profiler table of one eager decode forward (same batch), CUDA time per kernel name.
A jit_cache_hook records every Triton specialization first met in this process with the phase it appeared
in; a kernel that first compiles in the `staggered` phase (requests arriving while others decode, as under
`bench serve`) is one the start-up warm-up missed, and costs a compile (or an autotune) inside a request.
"""

from __future__ import annotations

import argparse
import json
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
from deltaserve.model.context import forward_context
from deltaserve.runner.model_runner import build_forward_context
from deltaserve.sampling_params import SamplingParams

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


def _decode_batch_ctx(engine: LLMEngine) -> tuple[Any, torch.Tensor, torch.Tensor, Any]:
    batch = engine.scheduler.schedule()
    assert batch.num_decodes == len(batch.sequences), "expected an all-decode batch"
    ids, pos, ctx = build_forward_context(batch, engine.runner.block_size, engine.runner.device)
    return batch, ids, pos, ctx


def _step_phases(engine: LLMEngine, num_steps: int) -> dict[str, float]:
    """Decode steps again with a device sync around each phase: where a step's time goes (the syncs add a
    little; `other` is the engine's own bookkeeping: stop rules, detokenisation, outputs)."""
    from deltaserve.runner import model_runner

    totals: dict[str, float] = defaultdict(float)
    runner, scheduler = engine.runner, engine.scheduler
    originals = {
        "schedule": (scheduler, "schedule", scheduler.schedule),
        "advance": (scheduler, "advance", scheduler.advance),
        "sampler": (runner, "sampler", runner.sampler),
        "build_forward_context": (model_runner, "build_forward_context", model_runner.build_forward_context),
    }
    if runner.graphs is not None:
        originals["graph_replay"] = (runner.graphs, "replay", runner.graphs.replay)

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _sync()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            _sync()
            totals[name] += time.perf_counter() - start
            return result

        return wrapper

    for name, (owner, attr, fn) in originals.items():
        setattr(owner, attr, timed(name, fn))
    try:
        _sync()
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        _sync()
        total = time.perf_counter() - start
    finally:
        for owner, attr, fn in originals.values():
            setattr(owner, attr, fn)
    phases = {name: round(seconds / num_steps * 1e3, 3) for name, seconds in totals.items()}
    phases["step_with_syncs"] = round(total / num_steps * 1e3, 3)
    phases["other"] = round((total - sum(totals.values())) / num_steps * 1e3, 3)
    return phases


def measure_batch(
    engine: LLMEngine, batch_size: int, input_len: int, num_steps: int, rng: random.Random
) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    for i, prompt in enumerate(_prompts(rng, batch_size, input_len, vocab)):
        engine.add_request(f"b{batch_size}-{i}", prompt, _params(num_steps * 3 + 64))
    while engine.scheduler.waiting or any(not seq.output_token_ids for seq in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    _sync()
    t = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    _sync()
    step_ms = (time.perf_counter() - t) / num_steps * 1e3
    phase_ms = _step_phases(engine, num_steps)

    # The decode graph alone: the scheduler's next batch, replayed with its inputs already on the device.
    batch, ids, pos, ctx = _decode_batch_ctx(engine)
    graphs = engine.runner.graphs
    graph_ms = None
    if graphs is not None and graphs.can_run(len(batch.sequences), ctx.block_tables.shape[1]):
        graphs.replay(ids, pos, ctx)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(num_steps):
            graphs.replay(ids, pos, ctx)
        end.record()
        _sync()
        graph_ms = start.elapsed_time(end) / num_steps

    # One eager forward of the same batch under the profiler: CUDA time per kernel.
    model = engine.runner.model
    with torch.inference_mode(), forward_context(ctx):
        model.compute_logits(model(ids, pos))
        _sync()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                model.compute_logits(model(ids, pos))
            _sync()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += event.time_range.elapsed_us() / 3
            totals[event.name][1] += 1 / 3
    kernels = sorted(
        ({"name": n[:160], "us_per_step": round(v[0], 1), "calls_per_step": round(v[1], 1)} for n, v in totals.items()),
        key=lambda row: -row["us_per_step"],
    )
    for request_id in [r for r in list(engine.requests) if r.startswith(f"b{batch_size}-")]:
        engine.abort_request(request_id)
    return {
        "batch_size": batch_size,
        "step_ms": round(step_ms, 3),
        "graph_ms": None if graph_ms is None else round(graph_ms, 3),
        "step_phase_ms": phase_ms,
        "eager_kernel_us_total": round(sum(k["us_per_step"] for k in kernels), 1),
        "eager_num_kernels": round(sum(k["calls_per_step"] for k in kernels)),
        "kernels": kernels[:40],
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
        outputs = engine.step()
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
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staggered", default="8,32", help="concurrencies of the staggered-arrival phase")
    args = parser.parse_args()
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
    }
    t = time.monotonic()
    config = EngineConfig(model=args.model, load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.85)
    engine = LLMEngine(config)
    result["startup_s"] = round(time.monotonic() - t, 1)
    result["batches"] = []
    result["staggered"] = []

    def save() -> None:
        result["compiles"] = COMPILES
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    save()
    PHASE["name"] = "fixed-batches"
    for batch_size in [int(b) for b in args.batches.split(",")]:
        result["batches"].append(measure_batch(engine, batch_size, args.input_len, args.steps, rng))
        print(json.dumps({k: v for k, v in result["batches"][-1].items() if k != "kernels"}), flush=True)
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


if __name__ == "__main__":
    main()
