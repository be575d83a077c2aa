"""`deltaserve gate mtp`: speculative decoding with the checkpoint's MTP layer, exact and measured (issue 41).

On a checkpoint whose MTP head is trained (the trained tiny checkpoints, deltaserve/tiny/trained.py), greedy, on
seeded spans of the shipped corpus' held-out text (tokens.make_text_prompts):
(a) deltaserve with `speculative_config` {"method": "mtp", "num_speculative_tokens": k} against deltaserve without
    it: STRICT n/N. Exact in fp32 on the CPU (the greedy accept rule emits plain greedy decoding's tokens; fp32
    rounding leaves the trained checkpoints' greedy choices far from ties). In bf16 on the GPU it is not: the
    verify chunk runs the projections as GEMMs of 1 + k rows per sequence where the decode runs 1, and cuBLAS
    picks other kernels and sum orders for them, so a near-tied greedy choice can flip (the H200, 2026-12-05:
    9/16, 6/16, 7/16 on the trained dense / moe / next checkpoints;
    docs/speculative-decoding.md#the-gate-deltaserve-gate-mtp).
(b) with `--reference vllm` (on the H200): vLLM 0.26 in process with the same speculative_config (the oracle
    registry's MTP arm, gates/vllm_reference.py; vLLM is imported only there, inside functions): STRICT n/N of
    deltaserve-with-MTP's greedy tokens against vLLM-with-MTP's (each mismatch with vLLM's logit margin from its
    top-20 raw logits, as `gate tokens` judges it), and both engines' acceptance side by side: drafts, draft
    tokens, accepted per position, mean acceptance length (1 + accepted / drafts, vLLM's convention). deltaserve's
    counters are its engine's (engine/stats.py SpecDecodeCounts, the /metrics series); vLLM's come from
    `LLM.get_metrics()`. A draft is one sequence verified with draft tokens in one step, in both engines.
    The per-position rates (accepted at position j / drafts) must agree within RATE_TOLERANCE = 0.05, because the
    engines need not draft at the same moments: near `max_tokens` each caps k its own way (deltaserve to the
    outputs left - 1), which moves at most one draft a prompt, about (k + 1) / max_tokens of a rate (0.042 at the
    defaults, k = 3 and 96 tokens: the gate prints this bound and says when it exceeds the tolerance), and in bf16
    a draft whose MTP logits are a near-tie may be another token in the other engine. The drafts themselves are
    the same function of the same weights, so a rule, a KV or a chaining difference moves a rate by far more.
    With vLLM, two yardsticks follow the verdict (printed, recorded, not part of it; `--no-yardstick` skips the
    extra vLLM run): vLLM with MTP against vLLM without (how many near ties the peer's own verify flips) and
    deltaserve without MTP against vLLM without (the engines' bf16 difference on these prompts before any MTP),
    each mismatch with vLLM's margin and whether it is within `gate tokens`' near-tie margin (TIE_ULPS ulps).
`--no-reference-logprobs` runs vLLM without logprobs (no margins), for a vLLM that would not speculate otherwise.
Every disagreement is printed. Exit 0 when every check holds; 1 on a mismatch, a rate beyond the tolerance or a
refused reference; 2 when nothing was checked (no prompt, or deltaserve never drafted). `--record PATH` writes the
verdict as JSON. `--tensor-parallel-size N` runs both of deltaserve's engines at N ranks (speculative decoding under
tensor parallelism: docs/speculative-decoding.md#tensor-parallelism). On the H200: `--dtype bfloat16 --device cuda
--reference vllm` on the trained dense / moe / next checkpoints, side by side on one GPU with `--share-gpu`
(scripts/h200.sh gates mtp).
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltaserve.bench.deviations import GATE_SITE
from deltaserve.gates.references import ReferenceError
from deltaserve.gates.tokens import (
    TIE_ULPS,
    Mismatch,
    add_oracle_arguments,
    engine_memory,
    judge_mismatch,
    make_text_prompts,
    save_record,
)

RECORD_SCHEMA = "deltaserve-gate-mtp/1"
RATE_TOLERANCE = 0.05


@dataclass
class Acceptance:
    """One engine's spec-decode counters over the gate's run (vLLM's series, same definitions in both)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]

    def rates(self, k: int) -> list[float]:
        """Per-position acceptance: accepted at position j over drafts, j = 0 .. k-1 (vLLM's log line)."""
        per_pos = self.accepted_per_pos + [0] * (k - len(self.accepted_per_pos))
        return [count / self.num_drafts if self.num_drafts else 0.0 for count in per_pos[:k]]

    @property
    def mean_length(self) -> float:
        """1 + accepted drafts per draft: the tokens one verify emits on average, the target's own included."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def text(self, k: int) -> str:
        rates = ", ".join(f"{r:.3f}" for r in self.rates(k))
        return (f"{self.num_drafts} drafts, {self.num_draft_tokens} draft tokens, accepted per position "
                f"{self.accepted_per_pos} = [{rates}], mean acceptance length {self.mean_length:.3f}")  # fmt: skip


@dataclass
class TokenMismatch:
    """The first divergent output position of one prompt between two runs."""

    prompt: int
    position: int
    expected: int | None  # the run compared against (without MTP, or vLLM with MTP)
    ours: int | None  # deltaserve with MTP
    margin: float | None = None  # vLLM's logit margin (its token over ours), from its top-20; None without vLLM
    is_margin_exact: bool = True
    is_near_tie: bool | None = None  # margin within TIE_ULPS ulps of vLLM's top logit; None without a margin
    # against deltaserve without MTP: deltaserve's own top-1 minus top-2 logprob there, without and with MTP (a near
    # tie is small on one side at least; a wrong verify moves logits by far more)
    off_margin: float | None = None
    on_margin: float | None = None


@dataclass
class MtpVerdict:
    k: int
    num_prompts: int
    off_mismatches: list[TokenMismatch] = field(default_factory=list)
    ours: Acceptance | None = None
    reference: str | None = None
    ref_mismatches: list[TokenMismatch] = field(default_factory=list)
    theirs: Acceptance | None = None
    rate_disagreements: list[str] = field(default_factory=list)
    refused: str | None = None
    lines: list[str] = field(default_factory=list)
    tensor_parallel_size: int = 1  # deltaserve's ranks, in both of its runs
    # the yardsticks (vLLM and --yardstick): None when not run
    vllm_mtp_vs_off: list[TokenMismatch] | None = None  # vLLM with MTP against vLLM without
    off_vs_vllm_off: list[TokenMismatch] | None = None  # deltaserve without MTP against vLLM without

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder with a trained MTP layer (mtp.*)")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=3, help="k, drafts per verify")
    parser.add_argument("--reference", default=None, choices=["vllm"], help="also compare with vLLM 0.26's MTP arm")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-prompt-len", type=int, default=160)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="deltaserve's ranks, with and without MTP alike (the vLLM reference runs on one GPU)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    add_oracle_arguments(parser)
    parser.add_argument(
        "--no-reference-logprobs",
        action="store_true",
        help="vLLM runs without logprobs, so its margins are not measured: for a vLLM that leaves a request asking "
        "for logprobs out of speculation (the gate then reports that vLLM made no draft)",
    )
    parser.add_argument(
        "--no-yardstick",
        action="store_true",
        help="with --reference vllm, skip the run of vLLM without MTP (the yardsticks: vLLM with MTP against "
        "without, deltaserve without MTP against vLLM without)",
    )


def run(args: argparse.Namespace) -> int:
    return run_gate(
        Path(args.model), args.num_speculative_tokens, args.reference, args.num_prompts, args.max_tokens,
        args.max_prompt_len, args.dtype, args.device, args.seed, args.site, args.record, args.share_gpu,
        not args.no_reference_logprobs, args.tensor_parallel_size, not args.no_yardstick,
    )  # fmt: skip


def speculative_config(k: int) -> dict[str, Any]:
    """vLLM's spelling, the same dict for both engines: greedy drafts, the standard (exact) accept rule."""
    return {"method": "mtp", "num_speculative_tokens": k}


def first_difference(expected: list[int], ours: list[int]) -> int | None:
    position = next((j for j, (a, b) in enumerate(zip(expected, ours, strict=False)) if a != b), None)
    if position is None and len(expected) != len(ours):
        position = min(len(expected), len(ours))
    return position


def _token(tokens: list[int], position: int) -> int | None:
    return tokens[position] if position < len(tokens) else None


def compare_tokens(expected: list[list[int]], ours: list[list[int]]) -> list[TokenMismatch]:
    found = []
    for i, (a, b) in enumerate(zip(expected, ours, strict=True)):
        position = first_difference(a, b)
        if position is not None:
            found.append(TokenMismatch(i, position, _token(a, position), _token(b, position)))
    return found


def compare_acceptance(ours: Acceptance, theirs: Acceptance, k: int, tolerance: float = RATE_TOLERANCE) -> list[str]:
    """Every position whose acceptance rate differs by more than `tolerance`, as a printable line."""
    found = []
    for j, (a, b) in enumerate(zip(ours.rates(k), theirs.rates(k), strict=True)):
        if abs(a - b) > tolerance:
            found.append(f"  position {j}: deltaserve {a:.3f} vs vLLM {b:.3f}, |difference| {abs(a - b):.3f} > "
                         f"{tolerance:g}")  # fmt: skip
    if theirs.num_drafts == 0:
        found.append("  vLLM made no draft at all (a vLLM that leaves requests asking for logprobs out of speculation "
                     "does so: run again with --no-reference-logprobs)")  # fmt: skip
    return found


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[float | None]]]:
    """Greedy tokens per prompt, and per output position the top-1 minus top-2 logprob (its margin)."""
    from deltaserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    margins = []
    for o in outputs:
        ranked = [sorted((lp.logprob for lp in entry.values()), reverse=True) for entry in o.outputs[0].logprobs or []]
        margins.append([r[0] - r[1] if len(r) >= 2 else None for r in ranked])
    return [list(o.outputs[0].token_ids) for o in outputs], margins


def _free(llm: Any) -> None:
    """Give the device back before the next engine takes it."""
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_deltaserve(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, dtype: str, device: str, seed: int,
    spec: dict[str, Any] | None, share_gpu: bool = False, tensor_parallel_size: int = 1,
) -> tuple[list[list[int]], Acceptance | None, list[list[float | None]]]:  # fmt: skip
    """Greedy tokens of deltaserve's offline LLM, with or without speculation, its spec-decode counters, and each
    output position's top-2 logprob margin."""
    from deltaserve.engine.llm import LLM

    llm = LLM(model_dir, dtype=dtype, device=device, seed=seed, max_num_seqs=min(len(prompts), 64),
              speculative_config=spec, tensor_parallel_size=tensor_parallel_size,
              **engine_memory(share_gpu))  # fmt: skip
    tokens, margins = _generate(llm, prompts, max_tokens)
    acceptance = None
    if spec is not None:
        stats = llm.engine.stats()
        acceptance = Acceptance(
            stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens,
            list(stats.spec_decode_num_accepted_tokens_per_pos),
        )  # fmt: skip
    _free(llm)
    return tokens, acceptance, margins


def _device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


@torch.inference_mode()
def run_gate(
    model_dir: Path,
    k: int = 3,
    reference: str | None = None,
    num_prompts: int = 16,
    max_tokens: int = 96,
    max_prompt_len: int = 160,
    dtype: str = "float32",
    device: str = "auto",
    seed: int = 0,
    site: str = GATE_SITE,
    record_path: Path | None = None,
    share_gpu: bool = False,
    reference_logprobs: bool = True,
    tensor_parallel_size: int = 1,
    yardstick: bool = True,
) -> int:
    from transformers import AutoTokenizer

    if num_prompts < 1 or max_tokens < 1 or k < 1:
        print("gate mtp: nothing to check (num_prompts, max_tokens and k must be positive)")
        return 2
    model_dir = Path(model_dir)
    run_device = _device(device)
    prompts = make_text_prompts(AutoTokenizer.from_pretrained(model_dir), num_prompts, max_prompt_len, seed)
    spec = speculative_config(k)
    verdict = MtpVerdict(k, len(prompts), reference=reference, tensor_parallel_size=tensor_parallel_size)
    ref_run = ref_off = None
    if reference == "vllm":
        # vLLM first: it must give the GPU back before deltaserve takes it
        from deltaserve.gates.vllm_reference import LOGPROBS_TOP_K, VllmReference

        top = LOGPROBS_TOP_K if reference_logprobs else None
        try:
            oracle = VllmReference(model_dir, dtype, max_prompt_len, seed, site, shares_gpu=share_gpu,
                                   speculative_config=spec)  # fmt: skip
            ref_run = oracle.run(prompts, max_tokens, top)
            verdict.theirs = Acceptance(**ref_run.config["spec_decode"])
            if yardstick:
                ref_off = VllmReference(model_dir, dtype, max_prompt_len, seed, site, shares_gpu=share_gpu).run(
                    prompts, max_tokens, top
                )
        except (ReferenceError, ValueError) as exc:
            verdict.refused = str(exc)
    tp = tensor_parallel_size
    off, _, off_margins = run_deltaserve(model_dir, prompts, max_tokens, dtype, run_device, seed, None, share_gpu, tp)
    ours, verdict.ours, on_margins = run_deltaserve(model_dir, prompts, max_tokens, dtype, run_device, seed, spec,
                                                    share_gpu, tp)  # fmt: skip
    verdict.off_mismatches = compare_tokens(off, ours)
    for m in verdict.off_mismatches:
        m.off_margin = _margin_at(off_margins[m.prompt], m.position)
        m.on_margin = _margin_at(on_margins[m.prompt], m.position)
    if ref_run is not None:
        verdict.ref_mismatches = judged_mismatches(ref_run, ours, dtype)
        verdict.rate_disagreements = compare_acceptance(verdict.ours, verdict.theirs, k)
    if ref_run is not None and ref_off is not None:
        verdict.vllm_mtp_vs_off = judged_mismatches(ref_off, ref_run.tokens, dtype)
        verdict.off_vs_vllm_off = judged_mismatches(ref_off, off, dtype)
    code = report(verdict, model_dir, dtype, max_tokens, ref_run.config if ref_run is not None else None)
    if record_path is not None:
        _write_record(record_path, verdict, code, model_dir, dtype, seed, max_tokens, prompts, ref_run)
    return code


def _margin_at(margins: list[float | None], position: int) -> float | None:
    return round(margins[position], 6) if position < len(margins) and margins[position] is not None else None


def judged_mismatches(ref_run: Any, ours: list[list[int]], dtype: str) -> list[TokenMismatch]:
    """`ours` against a vLLM run's tokens, each first difference with vLLM's margin there and whether it is a near
    tie (gates/tokens.py judge_mismatch)."""
    mismatches = compare_tokens(ref_run.tokens, ours)
    for m in mismatches:
        scores = ref_run.scores[m.prompt]
        if m.position >= len(scores):
            continue  # no logits there (--no-reference-logprobs, or past vLLM's output): no margin
        judged: Mismatch | None = judge_mismatch(ours[m.prompt], ref_run.tokens[m.prompt], scores, dtype)
        if judged is not None:
            m.margin, m.is_margin_exact, m.is_near_tie = judged.margin, judged.is_margin_exact, judged.is_near_tie
    return mismatches


def verdict_code(verdict: MtpVerdict) -> int:
    if verdict.refused is not None:
        return 1
    if verdict.ours is None or verdict.ours.num_drafts == 0:
        return 2
    failed = verdict.off_mismatches or verdict.ref_mismatches or verdict.rate_disagreements
    return 1 if failed else 0


def _mismatch_line(m: TokenMismatch, what: str, ours: str = "deltaserve-mtp") -> str:
    margin = ""
    if m.margin is not None:
        margin = f"; vLLM's margin {'' if m.is_margin_exact else '> '}{m.margin:.6g}"
        if m.is_near_tie is not None:
            margin += ", a near tie" if m.is_near_tie else ", beyond the near-tie margin"
    if m.off_margin is not None or m.on_margin is not None:
        margin += f" (top-2 logprob margin without MTP {m.off_margin}, with MTP {m.on_margin})"
    return f"  prompt {m.prompt}, output position {m.position}: {what} {m.expected} vs {ours} {m.ours}{margin}"


def _say_strict(
    verdict: MtpVerdict, mismatches: list[TokenMismatch], comparison: str, what: str, ours: str = "deltaserve-mtp",
    prefix: str = "",
) -> None:  # fmt: skip
    """One comparison's STRICT n/N line, then its every mismatch (`what`, `ours`: the two sides' names)."""
    n = verdict.num_prompts
    verdict.say(f"{prefix}STRICT {n - len(mismatches)}/{n} {comparison}")
    for m in mismatches:
        verdict.say(_mismatch_line(m, what, ours))


def report(verdict: MtpVerdict, model_dir: Path, dtype: str, max_tokens: int, ref_config: dict[str, Any] | None) -> int:
    """Prints the verdict (STRICT lines first) and returns the exit code."""
    n, k = verdict.num_prompts, verdict.k
    tp = f", tensor parallel {verdict.tensor_parallel_size}" if verdict.tensor_parallel_size > 1 else ""
    _say_strict(verdict, verdict.off_mismatches, f"deltaserve with MTP (k = {k}) against deltaserve without "
                f"({dtype}{tp})", "without MTP")  # fmt: skip
    if verdict.refused is not None:
        verdict.say(f"gate mtp: the {verdict.reference} reference REFUSED: {verdict.refused}")
    elif verdict.reference is not None:
        version = (ref_config or {}).get("version", "")
        _say_strict(verdict, verdict.ref_mismatches, f"deltaserve with MTP against vllm {version} with MTP "
                    f"(k = {k}, {dtype})", "vLLM-mtp")  # fmt: skip
    if verdict.ours is not None:
        verdict.say(f"acceptance deltaserve: {verdict.ours.text(k)}")
    if verdict.theirs is not None:
        verdict.say(f"acceptance vLLM:       {verdict.theirs.text(k)}")
        bound = (k + 1) / max_tokens
        note = "" if bound <= RATE_TOLERANCE else " (exceeds the tolerance: raise --max-tokens)"
        state = "ok" if not verdict.rate_disagreements else f"FAIL at {len(verdict.rate_disagreements)} positions"
        verdict.say(f"per-position rates within {RATE_TOLERANCE:g} (end-of-request drafts move a rate by up to "
                    f"(k + 1) / max_tokens = {bound:.3f}{note}): {state}")  # fmt: skip
        for line in verdict.rate_disagreements:
            verdict.say(line)
    if verdict.vllm_mtp_vs_off is not None and verdict.off_vs_vllm_off is not None:
        ties = [m for m in verdict.ref_mismatches if m.is_near_tie]
        verdict.say(f"against vLLM with MTP, {len(ties)} of {len(verdict.ref_mismatches)} mismatches are near ties "
                    f"({TIE_ULPS:g} ulps of {dtype} at vLLM's top logit)")  # fmt: skip
        say = "yardstick (not part of the verdict): "
        _say_strict(verdict, verdict.vllm_mtp_vs_off, f"vLLM with MTP against vLLM without ({dtype})",
                    "vLLM", "vLLM-mtp", say)  # fmt: skip
        _say_strict(verdict, verdict.off_vs_vllm_off, f"deltaserve without MTP against vLLM without ({dtype})",
                    "vLLM", "deltaserve", say)  # fmt: skip
    code = verdict_code(verdict)
    if code == 2:
        verdict.say("gate mtp: nothing checked: deltaserve made no draft (is the MTP layer trained?)")
    verdict.say(f"gate mtp: {model_dir} ({dtype}{tp}), {n} corpus prompts, {max_tokens} tokens each, k = {k}; "
                f"exit {code}")  # fmt: skip
    return code


def _write_record(
    path: Path, verdict: MtpVerdict, code: int, model_dir: Path, dtype: str, seed: int, max_tokens: int,
    prompts: list[list[int]], ref_run: Any,
) -> None:  # fmt: skip
    record = {
        "kind": "gate-mtp",
        "model": str(model_dir),
        "dtype": dtype,
        "speculative_config": speculative_config(verdict.k),
        "prompts": {"source": "text", "seed": seed, "lengths": [len(p) for p in prompts], "max_tokens": max_tokens},
        "rate_tolerance": RATE_TOLERANCE,
        "reference_config": ref_run.config if ref_run is not None else None,
        "verdict": asdict(verdict),
        "exit_code": code,
    }
    save_record(path, RECORD_SCHEMA, record)


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(prog="deltaserve gate mtp", description=__doc__)
    add_arguments(main_parser)
    sys.exit(run(main_parser.parse_args()))
