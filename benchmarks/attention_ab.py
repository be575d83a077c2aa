"""Long-prompt attention prefill side by side with the field's libraries (issue 35 item 3;
docs/kernels.md#attention-against-the-libraries).

In one process on one GPU, bf16: deltaserve's `paged_attention` (the served call over its paged KV cache, block
size 16) against vLLM 0.26's FlashAttention 3 varlen with a block table and FlashInfer's paged prefill wrapper
(benchmarks/attention_ab_arms.py says how each is called; both read deltaserve's cache layout as is). Each library
arm runs at every --library-block-sizes: 16 reads deltaserve's cache itself; another size (`vllm`: the block size
vLLM 0.26 serves these hybrid models with, 1056 tokens on the 35B-A3B and 784 on the 27B, `vllm_block_size`) reads
a copy repaged to it, made once per case outside the timing, as `NAME@LABEL`. A library that does not import is
recorded as missing, with its import error.

The op is the Qwen3.5 full-attention layer's: head_dim 256, GQA (--shapes: 35b-a3b 16 q / 2 kv heads, 27b 24 / 4;
the configs are benchmarks/oracle/make_dummy_models.py's), causal, scale d^-0.5; the output gate is outside the op
and not timed. A case `C@P` is one sequence prefilling a chunk of C tokens at context start P, chunked prefill as
served (the chunk attends to the P cached tokens and to itself causally); `BxC@P` is B such sequences in one call.
Default: C = 2048 and 8192 at P = 0, 8K, 16K, 32K, 56K (up to a 64K prompt), a batch of 8 x 1024 at P = 0, and the
verify shape 64 x 4 at 4K. FLOPs 4·nq·d·(C·P + C(C+1)/2) a sequence; TFLOP/s against the bf16 GEMM rate and bytes
(the K/V pages read once, q in, o out) against the copy bandwidth, both measured in the same run.

Before timing, every arm is checked against `paged_attention_ref` in fp32 (the arms get bf16 operands, the twin
their fp32 upcast, unrounded) on --check-cases: `small` (four sequences of mixed chunk and context lengths, odd
sizes, one decode, pages shuffled) and one real case (default 2048@8192): the largest error over the largest
reference value. An arm beyond the tolerance is reported (printed and recorded); it is timed but never wins. Timing:
each arm's call is a CUDA graph where it captures, else eager (noted), warmed first; arms replayed interleaved in a
rotating order; each figure is the median of --reps by CUDA events. A library becomes the served kernel for a range
only when it beats deltaserve there by more than --adopt-margin: per case (`winners`) and per range of context
(`ranges`: short up to 16K tokens, long beyond, verify for chunks of at most 16 tokens, from times summed over the
range). On a machine without CUDA (`--device cpu`) ours runs its torch twin and is timed by the wall clock: the CPU
test's check of discovery and the record. The record (JSON) goes to --out, by default
benchmarks/results/kernels/attention-ab-<UTC>.json, after every case. Exit 0, or 1 when deltaserve's own arm
disagrees with its twin, 2 when there is nothing to measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import json
import re
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from attention_ab_arms import Arm, Batch, attention_arms  # noqa: E402
from fp8_ab import Timer, check_arms, finish, range_verdict, time_arms, verdict  # noqa: E402

from deltaserve.bench.provenance import git_state  # noqa: E402
from deltaserve.kernels.attention import paged_attention_ref  # noqa: E402

STARTED = time.monotonic()  # --deadline-s counts from here, the library imports and the ceilings included
MODELS = {"35b-a3b": "q35-35b-a3b", "27b": "q35-27b"}
CASES = [f"{c}@{p}" for c in (2048, 8192) for p in (0, 8192, 16384, 32768, 57344)] + ["8x1024@0", "64x4@4096"]
SMALL = [(37, 50), (1, 70), (20, 0), (64, 129)]  # (chunk, context start) of the `small` check's sequences
BLOCK_SIZE = 16  # as served
RANGES = {"verify": (0, 16, 0, 1 << 40), "short": (17, 1 << 40, 0, 16384), "long": (17, 1 << 40, 16385, 1 << 40)}


@functools.cache
def text_config(model: str) -> dict[str, Any]:
    """The text config of the dummy `model` (a key of MODELS), as make_dummy_models writes it."""
    spec = importlib.util.spec_from_file_location("make_dummy_models", ROOT / "benchmarks/oracle/make_dummy_models.py")
    dummies = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dummies)
    return {**dummies.COMMON, **dummies.SHAPES[MODELS[model]][2]}


def head_shape(model: str) -> tuple[int, int, int]:
    """(q heads, kv heads, head_dim) of the full-attention layers of `model` (a key of MODELS)."""
    text = text_config(model)
    return text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]


def vllm_block_size(model: str, kernel_block: int = 16) -> int:
    """The attention block size vLLM 0.26 serves `model` with (bf16 KV, one GPU, mamba cache mode none or align):
    one attention page must hold at least one GDN layer's state (the conv window, kernel − 1 columns of the q|k|v
    channels in bf16, and the recurrent state HV·dk·dv in the checkpoint's mamba_ssm_dtype), so the block is the
    smallest multiple of FA's kernel block (16) whose K and V bytes reach it
    (docs/kernels.md#attention-against-the-libraries)."""
    text = text_config(model)
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv_bytes = (2 * nk * dk + nv * dv) * (text["linear_conv_kernel_dim"] - 1) * 2
    state_bytes = nv * dk * dv * (4 if text.get("mamba_ssm_dtype") == "float32" else 2)
    token_bytes = 2 * text["num_key_value_heads"] * text["head_dim"] * 2  # K and V of one token, bf16
    return kernel_block * -(-(conv_bytes + state_bytes) // (kernel_block * token_bytes))


def library_block_sizes(labels: list[str], model: str) -> dict[str, int]:
    """Each --library-block-sizes label's block size for `model`: a number, or `vllm` (vllm_block_size)."""
    return {label: vllm_block_size(model) if label == "vllm" else int(label) for label in labels}


def repage(b: Batch, block_size: int, seed: int = 2) -> Batch:
    """A copy of b's cache laid out in pages of `block_size` tokens (each sequence's new pages a random set in random
    order, as make_batch's): the same tokens and queries, another block table."""
    lengths = b.seq_lens.tolist()
    pages = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(pages) + 1, generator=torch.Generator().manual_seed(seed))
    shape = (sum(pages) + 1, block_size, *b.k_cache.shape[2:])  # [num_blocks, block_size, nkv, d]
    k_cache = torch.zeros(shape, dtype=b.k_cache.dtype, device=b.k_cache.device)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    used = 0
    for s, length in enumerate(lengths):
        table[s, : pages[s]] = order[used : used + pages[s]]
        used += pages[s]
        positions = torch.arange(length, device=b.k_cache.device)
        old = b.block_tables[s, positions // b.block_size].long() * b.block_size + positions % b.block_size
        new = table[s].to(b.k_cache.device)[positions // block_size].long() * block_size + positions % block_size
        k_cache.view(-1, *shape[2:])[new] = b.k_cache.view(-1, *shape[2:])[old]
        v_cache.view(-1, *shape[2:])[new] = b.v_cache.view(-1, *shape[2:])[old]
    return dataclasses.replace(b, k_cache=k_cache, v_cache=v_cache, block_tables=table.to(b.k_cache.device))


def views(b: Batch, arms: list[Arm], sizes: dict[str, int]) -> dict[str | None, Batch]:
    """The batch each available arm reads: ours as is (None), a repaged copy per block-size label in use."""
    labels = {arm.pages for arm in arms if arm.available and arm.pages is not None}
    return {None: b} | {label: repage(b, sizes[label]) for label in sorted(labels)}


def parse_case(text: str) -> list[tuple[int, int]]:
    """`C@P` or `BxC@P` -> [(chunk, context start)] a sequence; `small` -> the small check's mixed batch."""
    if text == "small":
        return list(SMALL)
    found = re.fullmatch(r"(?:(\d+)x)?(\d+)@(\d+)", text.strip())
    if not found or int(found.group(2)) < 1:
        raise ValueError(f"a case is C@P or BxC@P with C >= 1 (chunk C at context start P), not {text!r}")
    return [(int(found.group(2)), int(found.group(3)))] * int(found.group(1) or 1)


def case_flops(seqs: list[tuple[int, int]], num_q_heads: int, head_dim: int) -> int:
    """QKᵀ and PV over the unmasked scores: 4·nq·d·(C·P + C(C+1)/2) a sequence."""
    return sum(4 * num_q_heads * head_dim * (c * p + c * (c + 1) // 2) for c, p in seqs)


def case_bytes(seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """The K and V pages read once, q read and o written."""
    return sum(itemsize * head_dim * (2 * num_kv_heads * (c + p) + 2 * num_q_heads * c) for c, p in seqs)


def make_batch(
    seqs: list[tuple[int, int]], heads: tuple[int, int, int], device: str, dtype: torch.dtype, seed: int = 0
) -> Batch:
    """Random q and cache for `seqs`, each sequence's pages a random set of the cache's blocks in random order (as
    after churn), so an arm that reads the block table wrong disagrees."""
    num_q_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)  # the page order, on the host
    device_gen = torch.Generator(device=device).manual_seed(seed)  # the values, drawn where they live (64K tokens)
    lengths = [c + p for c, p in seqs]
    pages = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(pages) + 3  # a few blocks no sequence owns
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used : used + n]
        used += n
    starts = [0]
    for c, _ in seqs:
        starts.append(starts[-1] + c)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=device_gen, device=device).to(dtype)

    return Batch(
        q=randn(starts[-1], num_q_heads, head_dim),
        k_cache=randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim),
        v_cache=randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        scale=head_dim**-0.5,
        max_query_len=max(c for c, _ in seqs),
        max_seq_len=max(lengths),
    )


def reference(b: Batch) -> torch.Tensor:
    """paged_attention_ref on the fp32 upcast of the operands: fp32 out, no rounding."""
    args = (b.q.float(), b.k_cache.float(), b.v_cache.float(), b.query_start_loc, b.seq_lens, b.block_tables)
    return paged_attention_ref(*args, b.scale, b.max_query_len, b.max_seq_len)


class Context:
    """What every case shares: the arguments, the timer, the ceilings, the record and the deadline."""

    def __init__(self, args: argparse.Namespace, record: dict[str, Any]) -> None:
        self.args, self.record = args, record
        self.dtype = getattr(torch, args.dtype)
        self.timer = Timer(args.device)
        self.last_case_s = 0.0

    def out_of_time(self) -> bool:
        """Whether the next case, taking as long as the last one did, would end past --deadline-s."""
        deadline = self.args.deadline_s
        return deadline is not None and time.monotonic() - STARTED + self.last_case_s > deadline

    def save(self) -> None:
        """The record as it stands (after every case, so a call cut short still returns what it measured)."""
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.record, indent=2) + "\n")


def run_checks(ctx: Context, model: str, arms: list[Arm]) -> dict[str, dict[str, Any]]:
    """Every available arm at each --check-cases against the fp32 twin; an arm agrees only if it agreed at all."""
    heads = head_shape(model)
    merged: dict[str, dict[str, Any]] = {}
    for text in ctx.args.check_cases:
        if ctx.out_of_time():
            ctx.record["skipped"].append({"model": model, "case": text, "check": True, "why": "deadline"})
            continue
        b = make_batch(parse_case(text), heads, ctx.args.device, ctx.dtype, seed=1)
        ref = reference(b)
        live = [arm for arm in arms if arm.available]
        seen = views(b, live, ctx.record["library_block_sizes"][model])
        checks = check_arms(live, lambda arm, seen=seen: arm.call(seen[arm.pages], arm.prepare(seen[arm.pages])), ref)
        for arm, check in checks.items():
            ctx.record["checks"].append({"model": model, "case": text, "arm": arm, **check})
            state = "ok" if check["agrees"] else "DISAGREES" if "error" not in check else "ERROR"
            detail = check.get("error") or f"max abs {check['max_abs']:.3g}, max rel {check['max_rel']:.3g}, " \
                f"rel RMSE {check['rel_rmse']:.3g}"  # fmt: skip
            print(f"check {model} {text} {arm}: {state} ({detail})", flush=True)
            merged[arm] = check if not check["agrees"] else merged.get(arm, check)
        del b, ref, seen
        _free(ctx)
        ctx.save()  # a JIT build that runs past the call's limit still leaves the checks before it
    return merged


def run_case(ctx: Context, model: str, text: str, arms: list[Arm], checks: dict[str, dict[str, Any]]) -> None:
    """Time every arm that checked without an error at one case; one row an arm, then the case's verdict."""
    seqs = parse_case(text)
    heads = head_shape(model)
    base = {"model": model, "case": text, "B": len(seqs), "C": seqs[0][0], "P": seqs[0][1]}
    if ctx.out_of_time():
        ctx.record["skipped"].append({**base, "why": "deadline"})
        return
    began = time.monotonic()
    b = make_batch(seqs, heads, ctx.args.device, ctx.dtype)
    ran = [arm for arm in arms if arm.available and "error" not in checks.get(arm.name, {})]
    seen = views(b, ran, ctx.record["library_block_sizes"][model])  # the repaged copies, outside the timing
    calls: dict[str, Callable[[int], object]] = {}
    for arm in ran:
        view = seen[arm.pages]
        prepared = arm.prepare(view)  # outside the timing: FlashInfer's plan, nothing for the others
        calls[arm.name] = lambda i, arm=arm, prepared=prepared, view=view: arm.call(view, prepared)
    timings = time_arms(calls, 1, ctx.args.reps, ctx.timer)
    flops = case_flops(seqs, heads[0], heads[2])
    moved = case_bytes(seqs, *heads, ctx.dtype.itemsize)
    rows = []
    for arm, timing in timings.items():
        row = {**base, "op": "attention", "shape": model, "arm": arm, **timing}
        row["agrees"] = checks.get(arm, {}).get("agrees")
        if "us" in timing:
            tflops = flops / (timing["us"] * 1e-6) / 1e12
            gbps = moved / (timing["us"] * 1e-6) / 1e9
            bf16, copy = ctx.record["ceilings"].get("bf16_tflops"), ctx.record["ceilings"].get("copy_gbps")
            row.update(tflops=tflops, bf16_share=tflops / bf16 if bf16 else None, gbps=gbps,
                       copy_share=gbps / copy if copy else None)  # fmt: skip
        rows.append(row)
    ctx.record["results"] += rows
    ctx.record["winners"].append(verdict({**base, "op": "attention", "shape": model}, rows, ctx.args.adopt_margin))
    line = "  ".join(
        f"{r['arm']}={r['us'] / 1e3:.2f}ms ({r['tflops']:.0f} TF/s)" + ("(!)" * (r["agrees"] is False))
        for r in rows
        if "us" in r
    )
    print(f"attention {model:<8} {text:<12} {line}  -> {ctx.record['winners'][-1]['adopt']}", flush=True)
    del b, seen, calls
    _free(ctx)
    ctx.last_case_s = time.monotonic() - began
    ctx.save()


def range_of(row: dict[str, Any]) -> str | None:
    """The range a case belongs to: verify (chunks of at most 16 tokens), short (context up to 16K), long."""
    context = row["C"] + row["P"]
    for name, (c_low, c_high, ctx_low, ctx_high) in RANGES.items():
        if c_low <= row["C"] <= c_high and ctx_low <= context <= ctx_high:
            return name
    return None


def range_verdicts(results: list[dict[str, Any]], margin: float) -> list[dict[str, Any]]:
    """What serves each range (RANGES), from timed rows (fp8_ab.range_verdict's rule)."""
    verdicts = []
    for name in RANGES:
        rows = [r for r in results if "us" in r and range_of(r) == name]
        verdict = range_verdict(rows, lambda r: (r["model"], r["case"]), margin)
        if verdict is not None:
            verdicts.append({"range": name, **verdict})
    return verdicts


def _free(ctx: Context) -> None:
    if ctx.timer.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--shapes", type=_list, default=list(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--cases", type=_list, default=CASES, help="comma list of C@P / BxC@P (default: the issue's)")
    parser.add_argument("--check-cases", type=_list, default=["small", "2048@8192"], help="cases checked first")
    parser.add_argument("--arms", type=_list, default=None, help="arm names to run (deltaserve always runs)")
    parser.add_argument("--library-block-sizes", type=_list, default=["16", "vllm"],
                        help="block sizes the library arms read (16: our cache as is; vllm: the size vLLM 0.26 "
                        "serves the model with, on a repaged copy)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=20, help="interleaved passes per case (median)")
    parser.add_argument("--deadline-s", type=float, default=None, help="start no case that would end after this")
    parser.add_argument("--adopt-margin", type=float, default=0.10, help="a library serves where it beats ours by more")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16",), default="bfloat16")
    parser.add_argument("--check-only", action="store_true", help="discover and check the arms; time nothing")
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default benchmarks/results/kernels/)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device (--device cpu times the torch twin)")
    if set(args.shapes) - set(MODELS):
        parser.error(f"--shapes: unknown {sorted(set(args.shapes) - set(MODELS))}; choose from {', '.join(MODELS)}")
    for text in args.cases + args.check_cases:
        try:
            parse_case(text)
        except ValueError as exc:
            parser.error(str(exc))
    bad = [label for label in args.library_block_sizes if label != "vllm" and not re.fullmatch(r"[1-9]\d*", label)]
    if bad or not args.library_block_sizes:
        parser.error(f"--library-block-sizes: block sizes in tokens or `vllm`, not {bad or 'nothing'}")
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        args.out = ROOT / "benchmarks" / "results" / "kernels" / f"attention-ab-{stamp}.json"
    if args.check_only:
        args.cases = []
    return args


def new_record(args: argparse.Namespace, arms: list[Arm], argv: list[str]) -> dict[str, Any]:
    ceilings: dict[str, float] = {}
    if args.device.startswith("cuda"):
        from decode_step import measure_ceilings  # the copy and bf16 GEMM ceilings every kernel record uses

        ceilings = measure_ceilings()
    return {
        "kind": "attention_ab",
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "device": args.device,
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_state(ROOT)["commit"],
        "command": shlex.join(["python", "benchmarks/attention_ab.py", *argv]),
        "dtype": args.dtype,
        "block_size": BLOCK_SIZE,
        "library_block_sizes": {model: library_block_sizes(args.library_block_sizes, model) for model in args.shapes},
        "ceilings": ceilings,
        "heads": {model: head_shape(model) for model in args.shapes},
        "tolerance": "max |arm - ref| <= 1e-2 * max |ref| (ref: paged_attention_ref on the fp32 upcast)",
        "adopt_margin": args.adopt_margin,
        "arms": {arm.name: arm.describe() for arm in arms},
        "missing": {arm.name: arm.error for arm in arms if not arm.available},
        "checks": [],
        "results": [],
        "winners": [],
        "skipped": [],
        "ranges": [],
    }


def main(argv: list[str] | None = None, importer: Callable[[str], Any] = importlib.import_module) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.shapes or not (args.cases or args.check_cases):
        print("attention_ab: nothing to measure (no --shapes, or no --cases and no --check-cases)", file=sys.stderr)
        return 2
    arms = []
    for arm in attention_arms(importer):
        for label in args.library_block_sizes if arm.name != "deltaserve" else [str(BLOCK_SIZE)]:
            named = arm if label == str(BLOCK_SIZE) else arm.at_pages(label)
            if args.arms is None or named.name in {*args.arms, "deltaserve"} or arm.name in args.arms:
                arms.append(named)
    for arm in arms:
        print(f"arm {arm.name} ({arm.library}): {'available' if arm.available else arm.error}")
    record = new_record(args, arms, argv)
    ctx = Context(args, record)
    if record["ceilings"]:
        print(f"{record['gpu']}: bf16 {record['ceilings']['bf16_tflops']:.0f} TFLOP/s, "
              f"copy {record['ceilings']['copy_gbps']:.0f} GB/s")  # fmt: skip
    for model in args.shapes:
        checks = run_checks(ctx, model, arms)
        for text in args.cases:
            run_case(ctx, model, text, arms, checks)
    return finish(ctx, range_verdicts, lambda row: f"{row['model']} {row['case']}", lambda v: v["range"])


if __name__ == "__main__":
    sys.exit(main())
