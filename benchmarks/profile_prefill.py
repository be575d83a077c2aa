"""Where one long prefill spends its time, op by op, against the H200's ceilings: the engine in process, one request
at a time, chunked as served.

Run on the H200 from the repo root (no server; dummy weights; `bash scripts/h200.sh profile-prefill` wraps it):
    python3 benchmarks/profile_prefill.py --model /tmp/ds_models/q35-27b --prompt-lens 16384,65536
The record goes to --out (default benchmarks/results/kernels/profile-prefill-<UTC time>.json), saved after every
measurement, so a run cut short keeps what it measured.

For each prompt length (random token ids, a fresh prompt per request so the prefix cache never hits; max_tokens 1):
- one untimed request (its first-met kernel specialisations compile), then --reps timed ones, each alone:
  `ttft_ms`, wall time from add_request to the step that returns its token (what TTFT sees, minus the HTTP server
  and the API process); `gpu_ms`, the GPU time of its prefill steps by CUDA events recorded around each
  `ModelRunner.execute` (first step's start to last step's end, sampling included); `steps_gpu_ms`, the sum of the
  steps' own spans (so `gpu_ms − steps_gpu_ms` is the GPU idle between steps, waiting for the host to launch the
  next chunk); `host_ms = ttft_ms − gpu_ms`, the wall time the GPU was not yet or no longer on the request; per
  chunk (the scheduler's split: one request at a time, so at --lone-prefill-tokens, the engine's default unless
  given) its start position,
  tokens and median GPU ms. Medians over the reps;
- after every length is timed (once torch.profiler has run in a process, CUPTI stays attached and later kernels pay
  for it: benchmarks/profile_decode.py), for each of --profile-lens (default: every length) one more request under
  torch.profiler with the model's labels on (deltaserve/model/labels.py) and a `prefill_chunk:N` range around each
  step's launch: per op label its kernels' GPU time, share of all kernel time, kernel and call counts, its bytes and
  FLOPs (benchmarks/prefill_costs.py: the formulas), the lower bound max(bytes / copy bandwidth, FLOPs / bf16 rate)
  with the ceilings measured at start (benchmarks/decode_step.py measure_ceilings), which ceiling sets it, and the
  achieved share of it (`of_floor_pct` = floor / measured; `beats_floor` lists any op above 100 %: a wrong count);
  each op's top kernels (`kernels.by_op`); and the same split per chunk, beside the chunk's step span (`step_ms −
  ops_ms`: the GPU idle inside the step). What a layer runs outside its ops is `attn.other` / `gdn.other`; what a
  step launches outside the model (inputs, prefix-cache checkpoint copies, sampling) is `runner.other`.
`--device cpu` runs the plumbing on a tiny checkpoint (fp32, the ops' plain-torch twins): no CUDA events (the "GPU"
times are the host's own step times, `timer` says which) and no kernels (each op's self CPU time under its label),
placeholder ceilings. Exits 2 without CUDA unless --device cpu, 1 if a measurement failed.
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
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_step as ds  # noqa: E402  (same folder: ceilings, label folding, record paths)
import prefill_costs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHUNK_RANGE = "prefill_chunk:"  # the range this script puts around each step's launch in the profiled request
RUNNER_OP = "runner.other"  # what a step launches outside the model's labels
CURRENT_CHUNK: list[int | None] = [None]  # the step chunk_steps is launching now (Triton launch records read it)
CPU_CEILINGS = {"copy_gbps": 100.0, "bf16_tflops": 1.0}  # placeholders: the CPU run checks the plumbing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _Mark:
    """A point in a step's GPU stream (a CUDA event) or, on the CPU, where execution is synchronous, host time."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        self.at = 0.0
        if self.event is not None:
            self.event.record()
        else:
            self.at = time.perf_counter()

    def ms_until(self, other: _Mark) -> float:
        if self.event is not None:
            return self.event.elapsed_time(other.event)
        return (other.at - self.at) * 1e3


@contextmanager
def chunk_steps(runner: Any, device: torch.device, ranges: bool = False) -> Iterator[list[dict[str, Any]]]:
    """While open, every step with work that the engine launches is recorded: its chunk's start position and
    tokens, and marks around its launch (the list yielded gets one entry a step, `start` / `end` marks added). With
    `ranges`, each launch also runs inside a `prefill_chunk:N` profiler range. ModelRunner.execute is wrapped on the
    instance and put back on exit; nothing in the engine changes."""
    steps: list[dict[str, Any]] = []
    launch = runner.execute

    def execute(plan: Any, *args: Any, **kwargs: Any) -> Any:
        if plan.is_empty:
            return launch(plan, *args, **kwargs)
        seq = plan.seqs[-1]  # one request at a time: its chunk
        entry = {"start": seq.num_computed_tokens, "tokens": plan.num_tokens, "samples": seq.needs_sample}
        entry["mark_start"] = _Mark(device)  # outside the range: the range's own cost is inside the marks
        CURRENT_CHUNK[0] = len(steps)
        try:
            with torch.profiler.record_function(f"{CHUNK_RANGE}{len(steps)}") if ranges else nullcontext():
                handle = launch(plan, *args, **kwargs)
        finally:
            CURRENT_CHUNK[0] = None
        entry["mark_end"] = _Mark(device)
        steps.append(entry)
        return handle

    runner.execute = execute
    try:
        yield steps
    finally:
        del runner.execute  # the class's method again


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab // 8, vocab * 7 // 8) for _ in range(length)]


def run_request(engine: Any, request_id: str, prompt: list[int]) -> float:
    """Adds one request (max_tokens 1) to an idle engine and steps until its token is out: wall ms."""
    from deltaserve.sampling_params import SamplingParams

    if engine.has_unfinished():
        raise RuntimeError("run_request needs an idle engine")
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    try:
        while not any(o.request_id == request_id and o.finished for o in engine.step(by_output_kind=False)):
            pass
    except BaseException:
        engine.abort_request(request_id)  # the engine idle again for the next length
        while engine.has_unfinished():
            engine.step(by_output_kind=False)
        raise
    wall = (time.perf_counter() - started) * 1e3
    while engine.has_unfinished():  # the step that frees its row
        engine.step(by_output_kind=False)
    return wall


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def time_length(engine: Any, length: int, reps: int, rng: random.Random, device: torch.device) -> dict[str, Any]:
    """One untimed request of `length` tokens, then `reps` timed ones: TTFT, GPU ms, host ms, per-chunk GPU ms."""
    vocab = engine.model_config.vocab_size
    started = time.perf_counter()
    run_request(engine, f"warm-{length}", _prompt(rng, length, vocab))
    row: dict[str, Any] = {"prompt_len": length, "first_request_s": round(time.perf_counter() - started, 2)}
    ttft, gpu, busy, per_chunk, layout = [], [], [], [], None
    for rep in range(reps):
        with chunk_steps(engine.runner, device) as steps:
            ttft.append(run_request(engine, f"t{length}-{rep}", _prompt(rng, length, vocab)))
        _sync(device)
        gpu.append(steps[0]["mark_start"].ms_until(steps[-1]["mark_end"]))
        per_chunk.append([step["mark_start"].ms_until(step["mark_end"]) for step in steps])
        busy.append(sum(per_chunk[-1]))
        layout = [(step["start"], step["tokens"]) for step in steps]
    row.update(
        num_chunks=len(layout or []),
        ttft_ms=[round(v, 2) for v in ttft],
        gpu_ms=[round(v, 2) for v in gpu],
        ttft_ms_median=round(_median(ttft), 2),
        gpu_ms_median=round(_median(gpu), 2),
        steps_gpu_ms_median=round(_median(busy), 2),
        host_ms_median=round(_median([w - g for w, g in zip(ttft, gpu, strict=True)]), 2),
        chunks=[
            {"index": i, "start": start, "tokens": tokens, "gpu_ms_median": round(_median(ms), 3)}
            for i, ((start, tokens), ms) in enumerate(zip(layout or [], zip(*per_chunk, strict=True), strict=True))
        ],
    )
    return row


# ----------------------------------------------------------------------------------------------------------------
# The profiled request: per op and per chunk


def _owners(event: Any) -> tuple[str | None, int | None]:
    """(the op of the innermost model label around a profiler event, the index of its prefill_chunk range)."""
    op = chunk = None
    node = event
    while node is not None:
        name = node.name
        if op is None and name.startswith(ds.LABEL):
            op = ds.op_of(name[len(ds.LABEL) :])
        elif name.startswith(CHUNK_RANGE):
            chunk = int(name[len(CHUNK_RANGE) :])
            break
        node = node.cpu_parent
    return op, chunk


@contextmanager
def triton_launches() -> Iterator[list[tuple[str, str | None, int | None]]]:
    """While open, every Triton kernel launch on this host: (kernel name, the innermost model label open then
    (deltaserve.model.labels.current), the step chunk_steps is launching), in launch order. The profiler links
    Triton's driver launches to no host op (a 2026-12-05 H200 run left 98.9 % of a prefill `unlabelled`); one stream
    runs kernels in launch order, so the n-th Triton kernel on the GPU is the n-th launch here."""
    import triton

    from deltaserve.model import labels

    launches: list[tuple[str, str | None, int | None]] = []

    def hook(metadata: Any) -> None:
        launches.append((metadata.data["name"], labels.current(), CURRENT_CHUNK[0]))

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        yield launches
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)


def attribute(
    events: list[Any], device: torch.device, launches: list[tuple[str, str | None, int | None]] | None = None
) -> tuple[dict[tuple[str, int | None], list[float]], dict]:
    """(op, chunk) -> [µs, kernels, calls] and the kernel totals. On the GPU each kernel's time goes to the innermost
    model label of the host op that launched it (RUNNER_OP inside a step's range but outside every label,
    `unlabelled` outside every step, and so do kernels the profiler linked to no host op); on the CPU each host op's
    self time does, counted only inside the steps' ranges. `calls` counts the label's ranges (RUNNER_OP's: the
    steps). The totals: all kernel time, what no host op claimed, the top kernels by time, and each op's top kernels
    (`by_op`: which of an op's launches, the GDN prefill's four or the MoE block's GEMMs, holds its time).
    `launches` (triton_launches): the Triton kernels go to their launch's label by launch order instead, when the
    GPU ran exactly the launched sequence of names; otherwise they stay unclaimed and `launch_order` says why."""
    cells: dict[tuple[str, int | None], list[float]] = defaultdict(lambda: [0.0, 0, 0])
    kernel_us: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    op_kernels: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    claimed_us = 0.0
    triton_names = {name for name, _, _ in launches or []}
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if getattr(event, "is_user_annotation", False) or event.name.startswith((CHUNK_RANGE, ds.LABEL)):
                continue  # a range's GPU span (gpu_user_annotation): time its kernels hold, not a kernel
            kernel_us[event.name][0] += event.time_range.elapsed_us()
            kernel_us[event.name][1] += 1
            continue
        op, chunk = _owners(event)
        if event.name.startswith(ds.LABEL):
            cells[(ds.op_of(event.name[len(ds.LABEL) :]), chunk)][2] += 1
        elif event.name.startswith(CHUNK_RANGE):
            cells[(RUNNER_OP, chunk)][2] += 1
        if device.type == "cuda":
            owner = op or (RUNNER_OP if chunk is not None else "unlabelled")
            for kernel in event.kernels:
                if kernel.name in triton_names:  # by launch order, below
                    continue
                cell = cells[(owner, chunk)]
                cell[0] += kernel.duration
                cell[1] += 1
                claimed_us += kernel.duration
                op_kernels[owner][kernel.name][0] += kernel.duration
                op_kernels[owner][kernel.name][1] += 1
        elif chunk is not None:
            cells[(op or RUNNER_OP, chunk)][0] += event.self_cpu_time_total
    launch_order = None
    if device.type == "cuda" and launches:
        ran = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name in triton_names),
                     key=lambda e: e.time_range.start)  # fmt: skip
        if [e.name for e in ran] != [name for name, _, _ in launches]:
            launch_order = f"mismatch: {len(ran)} Triton kernels ran, {len(launches)} launched; left unclaimed"
        else:
            launch_order = f"{len(ran)} Triton kernels attributed by launch order"
            for event, (name, label, chunk) in zip(ran, launches, strict=True):
                owner = ds.op_of(label) if label else (RUNNER_OP if chunk is not None else "unlabelled")
                duration = event.time_range.elapsed_us()
                cell = cells[(owner, chunk)]
                cell[0] += duration
                cell[1] += 1
                claimed_us += duration
                op_kernels[owner][name][0] += duration
                op_kernels[owner][name][1] += 1
    total_us = sum(v[0] for v in kernel_us.values())
    if device.type == "cuda" and total_us - claimed_us > 1.0:  # kernels the profiler linked to no host op
        cells[("unlabelled", None)][0] += total_us - claimed_us
    kernels = {
        "total_us": round(total_us, 1),
        "unclaimed_us": round(max(total_us - claimed_us, 0.0), 1),
        "top": _top(kernel_us, 40),
        "by_op": {op: _top(by_name, 6) for op, by_name in op_kernels.items()},
        "launch_order": launch_order,
    }
    return dict(cells), kernels


def _top(by_name: dict[str, list[float]], count: int) -> list[dict[str, Any]]:
    """The `count` kernels with the most time: {name (cut to 120 characters), us, calls}."""
    rows = sorted(by_name.items(), key=lambda item: -item[1][0])[:count]
    return [{"name": name[:120], "us": round(us, 2), "calls": int(calls)} for name, (us, calls) in rows]


def _op_row(op: str, us: float, total_us: float, cost: tuple[float, float] | None, ceilings: dict) -> dict[str, Any]:
    row: dict[str, Any] = {"op": op, "ms": round(us / 1e3, 3), "share_pct": round(100 * us / total_us, 2)}
    if cost is not None:
        floor, bound = prefill_costs.floor_us(cost[0], cost[1], ceilings)
        row.update(bytes=int(cost[0]), flops=int(cost[1]), floor_ms=round(floor / 1e3, 6), bound=bound)
        row["of_floor_pct"] = round(100 * floor / us, 1) if us > 0 else None
    return row


def profile_length(
    engine: Any, length: int, rng: random.Random, device: torch.device, ceilings: dict[str, float]
) -> dict[str, Any]:
    """One request of `length` tokens under the profiler with the model's labels on: the per-op and per-chunk
    tables (see the module docstring)."""
    from deltaserve.model import labels

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prompt = _prompt(rng, length, engine.model_config.vocab_size)
    profiler = torch.profiler.profile(activities=activities)
    launch_log = triton_launches() if device.type == "cuda" else nullcontext([])
    steps_log = chunk_steps(engine.runner, device, ranges=True)
    with labels.enabled(), steps_log as steps, launch_log as launches, profiler as prof:
        wall = run_request(engine, f"p{length}", prompt)
        _sync(device)
    started = time.perf_counter()
    cells, kernels = attribute(list(prof.events()), device, launches)
    config = engine.model_config
    dtype_bytes = torch.finfo(engine.runner.model.embed_tokens.dtype).bits // 8
    chunk_costs = [prefill_costs.chunk_costs(config, s["tokens"], s["start"], s["samples"], dtype_bytes) for s in steps]
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for (op, _), (us, count, calls) in cells.items():
        by_op[op][0] += us
        by_op[op][1] += count
        by_op[op][2] += calls
    total_us = sum(v[0] for v in by_op.values()) or 1.0
    ops = []
    for op, (us, count, calls) in sorted(by_op.items(), key=lambda item: -item[1][0]):
        parts = [c[op] for c in chunk_costs if op in c]
        cost = (sum(p[0] for p in parts), sum(p[1] for p in parts)) if parts else None
        row = _op_row(op, us, total_us, cost, ceilings)
        row.update(kernels=int(count), calls=int(calls))
        ops.append(row)
    chunks = []
    for index, step in enumerate(steps):
        chunk_total = sum(v[0] for (op, c), v in cells.items() if c == index) or 1.0
        chunk_ops = [_op_row(op, v[0], chunk_total, chunk_costs[index].get(op), ceilings)
                     for (op, c), v in sorted(cells.items(), key=lambda item: -item[1][0]) if c == index]  # fmt: skip
        chunks.append({"index": index, "start": step["start"], "tokens": step["tokens"],
                       "step_ms": round(step["mark_start"].ms_until(step["mark_end"]), 3),
                       "ops_ms": round(chunk_total / 1e3, 3), "ops": chunk_ops})  # fmt: skip
    floor = sum(op["floor_ms"] for op in ops if "floor_ms" in op)
    # an op faster than its floor means its byte or FLOP count is wrong (or a ceiling was measured low)
    beats_floor = [op["op"] for op in ops if (op.get("of_floor_pct") or 0) > 100]
    return {
        "prompt_len": length,
        "wall_ms": round(wall, 2),
        "ops_ms": round(total_us / 1e3, 3),
        "floor_ms": round(floor, 3),
        "of_floor_pct": round(100 * floor / (total_us / 1e3), 1),
        "beats_floor": beats_floor,
        "ops": ops,
        "chunks": chunks,
        "kernels": kernels,
        "analysis_s": round(time.perf_counter() - started, 1),
    }


# ----------------------------------------------------------------------------------------------------------------
# Tables and the run


def table(profile: dict[str, Any], top: int = 30) -> str:
    head = (
        f"  {'op':<32} {'ms':>9} {'share':>6} {'calls':>6} {'kernels':>8} {'floor ms':>9} {'bound':>8} {'of floor':>8}"
    )
    lines = [f"prefill of {profile['prompt_len']} tokens, profiled: {profile['ops_ms']:.1f} ms of op time, floor "
             f"{profile['floor_ms']:.1f} ms ({profile['of_floor_pct']:.0f} %), {len(profile['chunks'])} chunks",
             head]  # fmt: skip
    for op in profile["ops"][:top]:
        floor = f"{op['floor_ms']:>9.2f} {op['bound']:>8} {op['of_floor_pct'] or 0:>7.1f}%" if "floor_ms" in op else ""
        row = f"  {op['op']:<32} {op['ms']:>9.2f} {op['share_pct']:>5.1f}% {op['calls']:>6} {op['kernels']:>8}"
        lines.append(f"{row} {floor}".rstrip())
    if profile["kernels"].get("launch_order"):
        lines.append(f"  Triton kernels: {profile['kernels']['launch_order']}")
    by_op = profile["kernels"].get("by_op", {})
    for op in [op["op"] for op in profile["ops"] if op["op"] in by_op][:8]:  # where the largest ops' time goes
        names = ", ".join(f"{k['name'][:48]} {k['us'] / 1e3:.2f} ms x{k['calls']}" for k in by_op[op][:3])
        lines.append(f"  {op}: {names}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder (the H200's dummies: /tmp/ds_models/q35-*)")
    parser.add_argument("--prompt-lens", default="16384", help="comma list of prompt lengths, each timed and profiled")
    parser.add_argument("--profile-lens", default=None, help="the prompt lengths profiled (default: every one)")
    parser.add_argument("--reps", type=int, default=3, help="timed requests per prompt length")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the chunk budget (engine default)")
    parser.add_argument(
        "--lone-prefill-tokens", type=int, default=None, help="a prompt alone's chunk budget (engine default; 0: off)"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="engine default unless given")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="one request at a time never decodes: fewer decode graphs to capture")  # fmt: skip
    parser.add_argument("--load-format", default="dummy", choices=("dummy", "auto"))
    parser.add_argument("--no-profile", action="store_true", help="timings only")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default: see the module docstring)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lengths = [int(x) for x in args.prompt_lens.split(",") if x]
    profiled = lengths if args.profile_lens is None else [int(x) for x in args.profile_lens.split(",") if x]
    if not lengths or min(lengths) < 1 or args.reps < 1 or not set(profiled) <= set(lengths):
        print("profile_prefill: --prompt-lens needs positive lengths, --profile-lens some of them, --reps at least 1",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cuda" and (not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        print("profile_prefill: no CUDA device: nothing to measure (--device cpu checks the plumbing)", file=sys.stderr)
        return 2
    out = args.out or ds.default_out("profile-prefill")
    from deltaserve.bench.provenance import git_state
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine_config import EngineConfig

    device = torch.device(args.device)
    record: dict[str, Any] = {
        "kind": "profile_prefill", "command": "python3 " + shlex.join(sys.argv if argv is None else argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": git_state(ROOT).get("commit"),
        "model": args.model, "device": args.device, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "prompt_lens": lengths, "reps": args.reps, "runs": [], "errors": [],
        "timer": "cuda-events" if device.type == "cuda" else "host",
    }  # fmt: skip

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")

    record["ceilings"] = ds.measure_ceilings() if device.type == "cuda" else dict(CPU_CEILINGS)
    started = time.perf_counter()
    config = EngineConfig(model=args.model, device=args.device, load_format=args.load_format,
                          max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs,
                          lone_prefill_tokens=args.lone_prefill_tokens)  # fmt: skip
    engine = LLMEngine(config)
    record.update(startup_s=round(time.perf_counter() - started, 1), max_model_len=engine.max_model_len,
                  max_num_batched_tokens=engine.core.max_num_batched_tokens,
                  lone_prefill_tokens=engine.core.lone_prefill_tokens,
                  dtype=str(engine.runner.model.embed_tokens.dtype).removeprefix("torch."))  # fmt: skip
    # one request at a time: its chunks take the lone-prefill budget (engine/budget.py step_budgets)
    print(f"engine ready in {record['startup_s']} s: budget {record['max_num_batched_tokens']} tokens a step, "
          f"{record['lone_prefill_tokens']} for a prompt alone, max_model_len {record['max_model_len']}; ceilings "
          f"{record['ceilings']}", flush=True)  # fmt: skip
    save()
    rng = random.Random(args.seed)
    runs: dict[int, dict[str, Any]] = {}
    # every length is timed before the process's first profile (see the module docstring)
    for phase in ("time",) if args.no_profile else ("time", "profile"):
        for length in lengths:
            if phase == "profile" and (length not in profiled or length not in runs):
                continue  # not asked for, or its timing failed
            try:
                if phase == "time":
                    runs[length] = time_length(engine, length, args.reps, rng, device)
                    record["runs"].append(runs[length])
                    run = runs[length]
                    print(f"prompt {length}: TTFT {run['ttft_ms_median']} ms, GPU {run['gpu_ms_median']} ms, host "
                          f"{run['host_ms_median']} ms over {run['num_chunks']} chunks", flush=True)  # fmt: skip
                else:
                    runs[length]["profile"] = profile_length(engine, length, rng, device, record["ceilings"])
                    print(table(runs[length]["profile"]), flush=True)
                    if runs[length]["profile"]["beats_floor"]:
                        print(f"CHECK THE COUNTS: faster than their floor: {runs[length]['profile']['beats_floor']}",
                              flush=True)  # fmt: skip
            except Exception as exc:  # one failed length is a finding; the rest still run
                record["errors"].append(f"{length} ({phase}): {type(exc).__name__}: {exc}"[:500])
                print(f"prompt {length}: FAILED ({phase}) {record['errors'][-1]}", flush=True)
                _sync(device)
            save()
    engine.shutdown()
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
