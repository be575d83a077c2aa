"""Mixed-step benchmark: GPU time of one engine step that carries prefill chunks and decodes, against the sum of
its parts (the same prefills alone, the same decodes alone), per op, on the real model.

    python3 benchmarks/oracle/make_dummy_models.py /tmp/ds_models
    python3 benchmarks/mixed_step.py --models /tmp/ds_models --shapes 27b

A case is `P1xL1+P2xL2...@B`: P new prompts of L tokens each (no cached state: has_initial_state false, positions
from 0), plus B decoding sequences with --context cached tokens each, as the scheduler packs them (decodes first).
Every case runs eagerly, as the engine runs a step that holds a prefill (only all-decode steps replay a CUDA graph):
median GPU ms over --reps by CUDA events, then one forward under torch.profiler with the model's labels on (kernel
time per op, deltaserve/model/labels.py; every case of every shape is timed before the process's first profile, as
in decode_step.py). For a
case with both halves the record holds `parts_ms` (its prefill-only case + its decode-only case, both measured
here) and `lost_ms` = mixed - parts, and per op the same difference, largest first: what a mixed step pays that its
parts do not. `host_ms` is the host's time to issue the step (close to `ms`: the step
is host-bound, the GPU waiting on launches) and `host_top` one run's functions by own host time under cProfile.
`tflops` is the step's matmul rate from a FLOP count (2 x active
parameters x tokens, plus attention's QK and PV over the causal prefix), against the bf16 GEMM rate measured at
start (`ceilings`). The record goes to --out (default benchmarks/results/kernels/mixed-step-<UTC time>.json).
Exits 2 without CUDA (unless --device cpu: the plumbing check), 1 if a case failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_step as ds  # noqa: E402  (same folder: build_model, bind_cache, labels, profiler, ceilings, paths)

# a comma list, as --cases takes it (a tuple of one string once went through ",".join character by character)
# functions kept from the host profile of each case (by own time)
HOST_PROFILE_TOP = 25
DEFAULT_CASES = "2048@0,0@8,0@32,2048@8,2048@32,2x1024@0,2x1024@32,8x1024@0,8x1024@32,4x1024@0,4x1024@32,1024@0,1024@32"


@dataclasses.dataclass(frozen=True)
class Case:
    prompts: tuple[int, ...]  # prefill lengths, one new sequence each
    num_decodes: int

    @property
    def name(self) -> str:
        return f"{self.prefill_name}@{self.num_decodes}"

    @property
    def prefill_name(self) -> str:
        if not self.prompts:
            return "0"
        counts: dict[int, int] = {}
        for length in self.prompts:
            counts[length] = counts.get(length, 0) + 1
        return "+".join(f"{n}x{length}" if n > 1 else str(length) for length, n in counts.items())


def parse_case(text: str) -> Case:
    """'2x1024+512@32' -> Case((1024, 1024, 512), 32); '0@8' -> decodes only."""
    match = re.fullmatch(r"([0-9x+]+)@(\d+)", text.strip())
    if not match:
        raise ValueError(f"bad case {text!r}: want PROMPTS@DECODES, e.g. 2x1024@32 or 0@8")
    prompts: list[int] = []
    for part in match.group(1).split("+"):
        count, _, length = part.rpartition("x")
        if int(length):
            prompts += [int(length)] * (int(count) if count else 1)
    case = Case(tuple(prompts), int(match.group(2)))
    if not case.prompts and not case.num_decodes:
        raise ValueError(f"bad case {text!r}: no tokens")
    return case


def step_inputs(case: Case, cache: ds.Cache, context: int, vocab_size: int, device: torch.device) -> tuple[Any, ...]:
    """(ForwardContext, input_ids [T], positions [3, T], sample_rows [num_seqs]) of one step: the decodes hold
    rows 0..B-1 of the cache, prompt i row B+i (its own blocks and state slot)."""
    from deltaserve.model.context import ForwardContext

    b, lengths = case.num_decodes, list(case.prompts)
    num_seqs = b + len(lengths)
    tables = cache.block_tables[:num_seqs]
    starts = [context] * b + [0] * len(lengths)
    news = [1] * b + lengths
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, news, strict=True)]).to(device)
    rows = torch.repeat_interleave(torch.arange(num_seqs, device=device), torch.tensor(news, device=device))
    blocks = tables[rows, positions // cache.block_size].long()
    query_start_loc = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32, device=device)
    prefill_loc = torch.tensor([0, *torch.tensor(lengths or [0]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s + n for s, n in zip(starts, news, strict=True)], dtype=torch.int32, device=device)
    ctx = ForwardContext(
        num_decode_tokens=b,
        num_prefill_tokens=sum(lengths),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=blocks * cache.block_size + positions % cache.block_size,
        max_query_len=max(news),
        max_seq_len=int(seq_lens.max()),
        state_indices=torch.arange(num_seqs, dtype=torch.int32, device=device),
        has_initial_state=torch.tensor([1] * b + [0] * len(lengths), dtype=torch.bool, device=device),
        prefill_query_start_loc=prefill_loc[: len(lengths) + 1].to(device),
    )
    # token ids from (index among the decodes or among the prompts, position): a sequence reads the same tokens in
    # every case, and prompt i's tokens continue as decode i's (the CPU test checks a decode against a prefill)
    index = [*range(b), *range(len(lengths))]
    keys = torch.cat(
        [i * 7_919 + torch.arange(s, s + n) * 104_729 for i, s, n in zip(index, starts, news, strict=True)]
    )
    ids = (vocab_size // 8 + keys % (vocab_size * 3 // 4)).to(device)
    sample_rows = (query_start_loc[1:] - 1).long()  # each decode row, each prompt's last token
    return ctx, ids, positions.unsqueeze(0).expand(3, -1).contiguous(), sample_rows


def matmul_flops(config: Any, model: Any, case: Case, context: int) -> float:
    """2 x active parameters x tokens (routed experts at top_k / num_experts of their weights), lm_head on the
    sampled rows only, and attention's QK^T and PV (causal over each prompt, the cached context for decodes)."""
    tokens = sum(case.prompts) + case.num_decodes
    total = 0.0
    for name, param in model.named_parameters():
        if "embed" in name or name.endswith("lm_head") or param.dim() < 2:
            continue
        share = config.num_experts_per_tok / config.num_experts if re.search(r"\.(w13|w2)$", name) else 1.0
        total += 2.0 * param.numel() * share * tokens
    total += 2.0 * model.lm_head.numel() * (len(case.prompts) + case.num_decodes)
    num_attn = sum(1 for layer in model.layers if layer.is_full_attention)
    width = config.num_attention_heads * config.head_dim
    pairs = sum(n * (n + 1) / 2 for n in case.prompts) + case.num_decodes * (context + 1)
    return total + num_attn * 4.0 * width * pairs


def gpu_ms(run: Any, reps: int, device: torch.device) -> tuple[float, float, float, float]:
    """(median, p10, p90) ms of run() by CUDA events (wall clock on the CPU), after one warm-up, and the median ms
    the host spent issuing it: perf_counter from a synchronised start to run()'s return, before the closing sync.
    Where the two are close the step is host-bound (the GPU waited on launches); a hidden host sync inside run()
    shows in the host time too (the host then waits on the GPU)."""
    run()
    times, host = [], []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            started = time.perf_counter()
            run()
            host.append((time.perf_counter() - started) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e3)
            host.append(times[-1])
    times.sort()
    host.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return times[len(times) // 2], pick(0.1), pick(0.9), host[len(host) // 2]


def host_profile(run: Any, device: torch.device, top: int = HOST_PROFILE_TOP) -> list[dict[str, Any]]:
    """One run() under cProfile: the functions with the most own (tottime) host time, to find where an eager
    step's launch work goes (Triton's launcher, torch ops, our own Python). cProfile slows every call, so read
    the shares, not the absolute ms."""
    import cProfile
    import pstats

    if device.type == "cuda":
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (prim calls, calls, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {"function": f"{Path(file).name}:{line}({name})", "calls": calls, "tottime_ms": round(tottime * 1e3, 3),
         "cumtime_ms": round(cumtime * 1e3, 3)}
        for (file, line, name), (_, calls, tottime, cumtime, _) in rows
    ]  # fmt: skip


def _case_run(model: Any, config: Any, cache: ds.Cache, case: Case, args: argparse.Namespace) -> Any:
    """One forward of the case's step (decodes and prefill chunks) and the logits of its sampled rows."""
    from deltaserve.model.context import forward_context

    device = model.embed_tokens.device
    ctx, ids, positions, sample_rows = step_inputs(case, cache, args.context, config.vocab_size, device)

    def run() -> torch.Tensor:
        ctx.cos_sin, ctx.prefill_state_indices, ctx.prefill_has_initial_state = None, None, None
        with forward_context(ctx):
            hidden = model(ids, positions)
        return model.compute_logits(hidden.index_select(0, sample_rows))

    return run


def time_case(model: Any, config: Any, cache: ds.Cache, case: Case, args: argparse.Namespace,
              ceilings: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """The case's first forward and its step time (GPU and host). Runs before any profiler session of the process
    (decode_step.run_shape says why)."""
    device = model.embed_tokens.device
    run = _case_run(model, config, cache, case, args)
    row: dict[str, Any] = {"case": case.name, "prefill_tokens": sum(case.prompts), "num_decodes": case.num_decodes}
    with torch.inference_mode():
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        row["first_forward_s"] = round(time.perf_counter() - started, 2)
        median, p10, p90, host = gpu_ms(run, args.reps, device)
    row.update(ms=round(median, 3), ms_p10=round(p10, 3), ms_p90=round(p90, 3), host_ms=round(host, 3))
    flops = matmul_flops(config, model, case, args.context)
    row["flops"] = flops
    row["tflops"] = round(flops / (median * 1e-3) / 1e12, 1)
    row["gemm_share"] = round(row["tflops"] / ceilings["bf16_tflops"], 3) if ceilings.get("bf16_tflops") else None
    return row


def profile_case(model: Any, config: Any, cache: ds.Cache, case: Case, args: argparse.Namespace,
                 row: dict[str, Any]) -> None:  # fmt: skip
    """Adds to a timed row the host's top functions (cProfile) and the per-op kernel times (torch.profiler)."""
    device = model.embed_tokens.device
    run = _case_run(model, config, cache, case, args)
    with torch.inference_mode():
        row["host_top"] = host_profile(run, device)
        with ds.labelled():
            by_label, kernels, _ = ds.profile_ops(run, device)
    row["ops_us"] = {label: round(v["us"], 1) for label, v in sorted(by_label.items(), key=lambda kv: -kv[1]["us"])}
    row["top_kernels"] = kernels["top"][:15]


def compare(rows: dict[str, dict[str, Any]]) -> None:
    """For each case with prefills and decodes whose two halves were measured: parts_ms, lost_ms, lost per op."""
    for name, row in rows.items():
        case = parse_case(name)
        if not case.prompts or not case.num_decodes or "ms" not in row:
            continue
        prefill, decode = rows.get(Case(case.prompts, 0).name), rows.get(Case((), case.num_decodes).name)
        if not prefill or not decode or "ms" not in prefill or "ms" not in decode:
            continue
        row["parts_ms"] = round(prefill["ms"] + decode["ms"], 3)
        row["lost_ms"] = round(row["ms"] - row["parts_ms"], 3)
        if any("ops_us" not in r for r in (row, prefill, decode)):
            continue  # a profile failed: the times stand, the per-op difference does not
        labels = set(row["ops_us"]) | set(prefill["ops_us"]) | set(decode["ops_us"])
        lost = {lab: row["ops_us"].get(lab, 0.0) - prefill["ops_us"].get(lab, 0.0) - decode["ops_us"].get(lab, 0.0)
                for lab in labels}  # fmt: skip
        row["lost_us_by_op"] = {k: round(v, 1) for k, v in sorted(lost.items(), key=lambda kv: -abs(kv[1]))[:12]}


def table(shape: str, rows: dict[str, dict[str, Any]]) -> str:
    lines = [f"{shape}: case, GPU ms (eager), host ms, TFLOP/s (share of bf16 GEMM), parts ms, lost ms, top lost ops"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"  {name:<14} FAILED {row['error']}")
            continue
        lost = ", ".join(f"{k} {v:+.0f}" for k, v in list(row.get("lost_us_by_op", {}).items())[:5])
        lines.append(f"  {name:<14} {row['ms']:>9.2f} {row.get('host_ms', 0):>9.2f} {row['tflops']:>7.1f}"
                     f" ({row['gemm_share'] or 0:.0%})"
                     f"  {row.get('parts_ms', ''):>9} {row.get('lost_ms', ''):>8}  {lost}")  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("/tmp/ds_models"), help="make_dummy_models.py's folder")
    parser.add_argument("--shapes", default="27b,35b-a3b", help=f"comma list of {', '.join(ds.SHAPES)} or folders")
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per decoding sequence")
    parser.add_argument("--max-model-len", type=int, default=16384, help="block-table width")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default: see the module docstring)")
    return parser


def parse_cases(text: str) -> list[Case]:
    return [parse_case(part) for part in text.split(",") if part.strip()]


def main() -> int:
    args = build_parser().parse_args()
    args.out = args.out or ds.default_out("mixed-step")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured (use --device cpu for the plumbing check)")
        return 2
    from deltaserve.bench.provenance import git_state

    cases = parse_cases(args.cases)
    record: dict[str, Any] = {
        "kind": "mixed_step", "command": " ".join(["python3", *sys.argv]), "date": datetime.now(UTC).isoformat(),
        "commit": git_state(ds.ROOT).get("commit"), "device": device.type,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "context": args.context, "ceilings": ds.measure_ceilings() if device.type == "cuda" else {}, "shapes": {},
        "errors": [],
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [s for s in args.shapes.split(",") if s]
    for phase in ("time", "profile"):  # every case timed before the process's first profiler session
        for shape in shapes:
            started = time.perf_counter()
            config, model = ds.build_model(args.models / ds.SHAPES.get(shape, shape), device, dtype)
            num_seqs = max(c.num_decodes + len(c.prompts) for c in cases)
            longest = max([args.context, *(n for c in cases for n in c.prompts)])
            cache = ds.bind_cache(model, config, num_seqs, longest, args.max_model_len, args.block_size)
            print(f"{shape}: model and cache ready in {time.perf_counter() - started:.1f} s ({phase})", flush=True)
            rows: dict[str, dict[str, Any]] = record["shapes"].setdefault(shape, {})
            for case in cases:
                try:
                    if phase == "time":
                        rows[case.name] = time_case(model, config, cache, case, args, record["ceilings"])
                    elif "error" not in rows[case.name]:
                        profile_case(model, config, cache, case, args, rows[case.name])
                except Exception as exc:  # one failed case is a finding; the rest still run
                    error = f"{type(exc).__name__}: {exc}"[:500]
                    if phase == "time":
                        rows[case.name] = {"case": case.name, "error": error}
                    else:
                        rows[case.name]["profile_error"] = error
                    record["errors"].append(f"{shape} {case.name} ({phase}): {error}")
                if phase == "time":
                    print(f"{shape} {case.name}: {rows[case.name].get('ms', 'FAILED')} ms", flush=True)
                args.out.write_text(json.dumps(record, indent=1))
            if phase == "profile":
                compare(rows)
                print(table(shape, rows), flush=True)
            del model, cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    args.out.write_text(json.dumps(record, indent=1))
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
