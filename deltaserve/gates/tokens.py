"""`deltaserve gate tokens`: greedy token-exactness of deltaserve against a reference, with margins.

For N seeded prompts of varied length (random ordinary tokens, or spans of the corpus' held-out text; with
`--media KIND`, image and video prompts: media.py) both engines generate greedily and the verdict starts with
`STRICT n/N`. Then, for every mismatch: the output
position, both tokens, and the reference's logit margin between them, measured in the reference's own dtype
(fp32 margins for an fp32 reference, bf16 for bf16); a mismatch whose margin is within the stated near-tie
margin (TIE_ULPS ulps of the reference dtype at its top logit) is reported as a tie, and still counts against
STRICT. References (references.py, vllm_reference.py):
- transformers: `config.architectures[0]` (the composite class for a composite checkpoint), refused when it
  reports missing, mismatched or unexpected weights;
- vllm (on the H200): `vllm.LLM` built by the oracle registry in its production configuration; the record
  states the configuration vLLM reports, the fused attention preamble included.
Checks besides STRICT, per prompt:
- logits: deltaserve's full forward against the reference's, relative error over all positions <= 1e-4 in
  fp32 (against vLLM: over the top-20 logits it returns per step);
- prefill-then-decode equals one full forward: deltaserve's logits from the prompt as two prefill chunks then
  one-token decodes, against one prefill of the whole sequence, within 10x the model's rounding noise floor
  (the relative change of a transformers model's logits when its embedding table moves by one rounding's worth:
  1e-7 in fp32, 4e-3 in bf16), never below 1e-5 in fp32. A GDN state restarted from zero moves them by O(1).
In bf16 the gate also prints the yardstick: each engine against transformers-fp32, so a mismatch can be read
against the reference's own bf16 disagreement. deltaserve is driven only through its offline API (`LLM`,
`LLM.prefill_logits`). `--record PATH` writes the whole verdict as JSON. Exit 0 only when every prompt matches and
every check holds; 1 on any failure or refused reference; 2 when nothing was checked. `--reference-only` saves
the reference's run to `--reference-cache` and stops (no verdict); `--share-gpu` sizes both engines' caches small
so several gates run side by side on one GPU (benchmarks/oracle/gates_shared.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaserve import env
from deltaserve.bench.deviations import GATE_SITE
from deltaserve.gates.references import ReferenceError, ReferenceRun, StepScores, TransformersReference, ulp
from deltaserve.tiny.media_prompts import media_argument

LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
SPLIT_TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 1e-2}
ROUNDING_PERTURBATION = {"float32": 1e-7, "bfloat16": 4e-3, "float16": 5e-4}
NOISE_FLOOR_FACTOR = 10.0
# A relative top-k routing margin below ROUTER_TIE_FACTOR x the dtype's logit tolerance (the size of the two
# implementations' own differences the gate accepts) makes that routing choice a near-tie: either side of it is
# right, and the logits after a flipped choice differ by far more than one rounding of the weights moves them.
ROUTER_TIE_FACTOR = 10.0
TIE_ULPS = 4.0
RECORD_SCHEMA = "deltaserve-gate-tokens/1"
# deltaserve's share of the GPU under --share-gpu: ten tiny-model gates fit one H200 side by side
SHARED_GPU_UTILIZATION = 0.05
PROMPT_SOURCES = ("random", "text")


def add_oracle_arguments(parser: argparse.ArgumentParser) -> None:
    """--site, --record and --share-gpu, as every gate that runs vLLM in process takes them."""
    parser.add_argument(
        "--site",
        default=GATE_SITE,
        help=f"where the vLLM reference runs (registry SITES; default {GATE_SITE})",
    )
    parser.add_argument("--record", type=Path, default=None, help="write the verdict as JSON here")
    parser.add_argument(
        "--share-gpu",
        action="store_true",
        help=f"run beside other gates on one GPU: deltaserve's engines at gpu_memory_utilization "
        f"{SHARED_GPU_UTILIZATION} and the vLLM oracle with the registry's shared-GPU settings (a fixed KV cache); "
        "cache sizes only, no computation changes",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--reference", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-len", type=int, default=160)
    parser.add_argument("--prompts", default="random", choices=PROMPT_SOURCES, help="random tokens or corpus text")
    parser.add_argument(
        "--media",
        default=None,
        type=media_argument,
        metavar="{image,multi-image,video,all}",
        help="image and video prompts instead of text (gates/media.py): --num-prompts fixed synthetic prompts per "
        "kind (image: one image; multi-image: two or three; video: one or two videos, some beside an image; all: "
        "the three sets; or a comma-separated list, e.g. image,video), given to deltaserve as vLLM's "
        "multi_modal_data; adds the check that the four-op preamble (DELTASERVE_FUSE_ATTN_PREAMBLE=0) refuses "
        "them. --prompts and --max-prompt-len do not apply",
    )
    add_oracle_arguments(parser)
    parser.add_argument(
        "--reference-cache",
        type=Path,
        default=None,
        help="reuse the reference's run from this file when it was made for the same checkpoint, dtype, reference "
        "and prompts (else run it and save it here): one vLLM start serves several deltaserve configurations",
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="deltaserve's ranks")
    parser.add_argument(
        "--reference-only",
        action="store_true",
        help="run the reference and save its run to --reference-cache, then stop (no verdict): the vLLM starts of "
        "several gates can then run at once with --share-gpu, and each gate later reads its cache",
    )


def run(args: argparse.Namespace) -> int:
    if args.reference_only and args.reference_cache is None:
        print("gate tokens: --reference-only needs --reference-cache (where the reference's run is saved)")
        return 2
    options = {"share_gpu": args.share_gpu, "is_reference_only": args.reference_only}
    if args.media:
        from deltaserve.gates.media import run_media_gate

        return run_media_gate(
            Path(args.model), args.media, args.reference, args.num_prompts, args.max_tokens, args.dtype, args.device,
            args.seed, site=args.site, record_path=args.record, reference_cache=args.reference_cache,
            tensor_parallel_size=args.tensor_parallel_size, **options,
        )  # fmt: skip
    return run_gate(
        Path(args.model), args.reference, args.num_prompts, args.max_tokens, args.dtype, args.device, args.seed,
        args.max_prompt_len, prompts=args.prompts, site=args.site, record_path=args.record,
        reference_cache=args.reference_cache, tensor_parallel_size=args.tensor_parallel_size, **options,
    )  # fmt: skip


@dataclass
class Mismatch:
    """The first divergent step of one prompt, judged by the reference's own logits there."""

    position: int
    ref_token: int
    our_token: int
    margin: float  # reference logit of its token minus reference logit of ours, in the reference's dtype
    is_margin_exact: bool  # False: our token is outside the reference's top-k, so `margin` is a lower bound
    tie_margin: float  # TIE_ULPS ulps of the reference dtype at the reference's top logit
    is_near_tie: bool
    ref_token_text: str = ""
    our_token_text: str = ""


@dataclass
class PromptResult:
    index: int
    prompt_len: int
    is_exact: bool
    mismatch: Mismatch | None = None
    logit_rel_error: float = 0.0
    split_rel_error: float = 0.0
    noise_floor: float = 0.0
    # the reference's own change under one rounding of every weight (references.weight_floor); measured only
    # for a prompt whose logit or split error passes the fixed bounds, None otherwise
    weight_floor: float | None = None
    # (position, layer, relative margin): at the first position whose logits leave the bound, the reference's
    # smallest top-k routing margin (references.routing_margins); measured only for a prompt whose logit error is
    # above the bound and beyond its weight floor, None otherwise
    routing_margin: tuple[int, int, float] | None = None
    is_ref_dtype_exact: bool | None = None  # reference in this dtype vs transformers in fp32 (bf16 yardstick)
    is_ours_vs_fp32_exact: bool | None = None


@dataclass
class GateReport:
    lines: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


def make_prompts(tokenizer: Any, num_prompts: int, max_len: int, seed: int) -> list[list[int]]:
    """Seeded prompts of ordinary (non-special) token ids, lengths spread over 1..max_len."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    ordinary = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    return [rng.choice(ordinary, size=n).tolist() for n in prompt_lengths(num_prompts, max_len, rng)]


def prompt_lengths(num_prompts: int, max_len: int, rng: np.random.Generator) -> list[int]:
    """The chunk-boundary lengths (1, 2, 63, 64, 65, ...) first, then seeded random ones."""
    lengths = [n for n in (1, 2, 63, 64, 65, 100, 129, max_len) if n <= max_len]
    while len(lengths) < num_prompts:
        lengths.append(int(rng.integers(1, max_len + 1)))
    return lengths[:num_prompts]


def held_out_ids(tokenizer: Any) -> list[int]:
    """The shipped corpus' held-out paragraphs (text no trained checkpoint saw) as token ids."""
    from deltaserve.tiny.mtp import corpus_split

    return tokenizer.encode(corpus_split()[1], add_special_tokens=False)


def make_text_prompts(tokenizer: Any, num_prompts: int, max_len: int, seed: int) -> list[list[int]]:
    """Seeded spans of the shipped corpus' held-out paragraphs (text no trained checkpoint saw)."""
    ids = held_out_ids(tokenizer)
    rng = np.random.default_rng(seed)
    prompts = []
    for n in prompt_lengths(num_prompts, max_len, rng):
        start = int(rng.integers(0, max(len(ids) - n, 1)))
        prompts.append(ids[start : start + n])
    return prompts


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def judge_mismatch(ours: list[int], ref: list[int], scores: list[StepScores], dtype: str) -> Mismatch | None:
    """The first divergence and the reference's margin there (None when the tokens agree)."""
    position = next((j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    if position is None:
        if len(ours) == len(ref):
            return None
        position = min(len(ours), len(ref))
    step = scores[position]
    ref_token = ref[position] if position < len(ref) else max(step.values, key=step.values.get)
    our_token = ours[position] if position < len(ours) else -1
    margin, is_exact = step.margin(ref_token, our_token)
    tie_margin = TIE_ULPS * ulp(step.values[ref_token], dtype)
    # a negative margin (the reference's own token below ours in its logits) is no tie: something else differs
    is_near_tie = is_exact and 0.0 <= margin <= tie_margin
    return Mismatch(position, ref_token, our_token, margin, is_exact, tie_margin, is_near_tie)


def gate_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _reference(
    kind: str, model_dir: Path, dtype: str, device: str, max_prompt_len: int, seed: int, site: str,
    share_gpu: bool = False,
) -> Any:  # fmt: skip
    if kind == "transformers":
        return TransformersReference(model_dir, dtype, device)
    if kind == "vllm":
        from deltaserve.gates.vllm_reference import VllmReference

        return VllmReference(model_dir, dtype, max_prompt_len, seed, site, shares_gpu=share_gpu)
    raise ValueError(f"unknown reference {kind!r}")


@torch.inference_mode()
def run_gate(
    model_dir: Path,
    reference: str = "transformers",
    num_prompts: int = 32,
    max_tokens: int = 32,
    dtype: str = "float32",
    device: str = "auto",
    seed: int = 0,
    max_prompt_len: int = 160,
    prompts: str = "random",
    site: str = GATE_SITE,
    record_path: Path | None = None,
    reference_cache: Path | None = None,
    tensor_parallel_size: int = 1,
    share_gpu: bool = False,
    is_reference_only: bool = False,
) -> int:
    from transformers import AutoTokenizer

    if num_prompts < 1 or max_tokens < 1:
        print("gate tokens: nothing to check (num_prompts and max_tokens must be positive)")
        return 2
    model_dir = Path(model_dir)
    run_device = gate_device(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    maker = make_text_prompts if prompts == "text" else make_prompts
    prompt_ids = maker(tokenizer, num_prompts, max_prompt_len, seed)
    try:
        # The reference first: a refused (partly random) reference stops the gate before deltaserve runs, and
        # vLLM must give the GPU back before deltaserve takes it.
        ref = _reference(reference, model_dir, dtype, run_device, max_prompt_len, seed, site, share_gpu)
        key = {"model": str(model_dir.resolve()), "dtype": dtype, "reference": reference, "site": site,
               "max_tokens": max_tokens, "prompts": prompt_ids}  # fmt: skip
        ref_run = cached_reference_run(reference_cache, key)
        if ref_run is None:
            ref_run = ref.run(prompt_ids, max_tokens)
            save_reference_run(reference_cache, key, ref_run)
        if is_reference_only:
            return reference_saved(reference, model_dir, reference_cache, len(prompt_ids))
        # transformers at the run dtype measures the noise floor (and is the reference itself in that mode).
        rounding = (
            ref if isinstance(ref, TransformersReference) else TransformersReference(model_dir, dtype, run_device)
        )
        fp32_run = None
        if dtype != "float32":
            fp32_ref = TransformersReference(model_dir, "float32", run_device)
            fp32_run = fp32_ref.run(prompt_ids, max_tokens)
            del fp32_ref
    except ReferenceError as exc:
        print(f"gate tokens: REFUSED: {exc}")
        return 1
    results = _compare(
        model_dir, dtype, run_device, seed, prompt_ids, max_tokens, ref, ref_run, rounding, fp32_run,
        tensor_parallel_size, share_gpu,
    )  # fmt: skip
    report = GateReport()
    code = report_verdict(
        report, results, dtype, model_dir, reference, ref_run, prompts, tokenizer, tensor_parallel_size
    )
    if record_path is not None:
        write_record(record_path, report, results, code, model_dir, dtype, reference, ref_run, prompts, seed)
    return code


def reference_saved(reference: str, model_dir: Path, path: Path | None, num_prompts: int) -> int:
    """--reference-only: say where the run went; no verdict (the gate that reads the cache gives it)."""
    print(f"gate tokens: --reference-only: the {reference} reference's run on {model_dir} ({num_prompts} prompts) is "
          f"in {path}; no verdict yet: run the gate again with --reference-cache {path}")  # fmt: skip
    return 0


def engine_memory(share_gpu: bool) -> dict[str, float]:
    """deltaserve's LLM(...) memory setting in the gate: its default, or the shared-GPU share."""
    return {"gpu_memory_utilization": SHARED_GPU_UTILIZATION} if share_gpu else {}


def cached_reference_run(path: Path | None, key: dict[str, Any]) -> ReferenceRun | None:
    """The saved reference run at `path` if it was made for exactly `key`, else None (and say why)."""
    if path is None or not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("key") != key:
        print(f"gate tokens: {path} was made for another checkpoint, dtype, reference or prompt set; running anew")
        return None
    scores = [[StepScores({int(t): v for t, v in step["values"].items()}, step["is_complete"]) for step in row]
              for row in saved["scores"]]  # fmt: skip
    print(f"gate tokens: the {key['reference']} reference's run comes from {path}")
    return ReferenceRun(saved["tokens"], scores, saved["config"] | {"from_cache": str(path)})


def save_reference_run(path: Path | None, key: dict[str, Any], run: ReferenceRun) -> None:
    if path is None:
        return
    scores = [[{"values": step.values, "is_complete": step.is_complete} for step in row] for row in run.scores]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "tokens": run.tokens, "scores": scores, "config": run.config}, default=str))


def _compare(
    model_dir: Path,
    dtype: str,
    device: str,
    seed: int,
    prompt_ids: list[list[int]],
    max_tokens: int,
    ref: Any,
    ref_run: ReferenceRun,
    rounding: TransformersReference,
    fp32_run: ReferenceRun | None,
    tensor_parallel_size: int = 1,
    share_gpu: bool = False,
) -> list[PromptResult]:
    from deltaserve import LLM, SamplingParams

    llm = LLM(
        model_dir, dtype=dtype, device=device, max_num_seqs=min(len(prompt_ids), 64), seed=seed,
        tensor_parallel_size=tensor_parallel_size, **engine_memory(share_gpu),
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    results = []
    for i, (prompt, output) in enumerate(zip(prompt_ids, outputs, strict=True)):
        ours = list(output.outputs[0].token_ids)
        ref_tokens, ref_scores = ref_run.tokens[i], ref_run.scores[i]
        result = PromptResult(i, len(prompt), ours == ref_tokens)
        result.mismatch = judge_mismatch(ours, ref_tokens, ref_scores, dtype)
        if fp32_run is not None:
            result.is_ref_dtype_exact = ref_tokens == fp32_run.tokens[i]
            result.is_ours_vs_fp32_exact = ours == fp32_run.tokens[i]
        sequence = prompt + ref_tokens
        full = llm.prefill_logits(sequence).cpu()
        if isinstance(ref, TransformersReference):
            result.logit_rel_error = rel_error(full, ref.full_logits(sequence))
        else:
            result.logit_rel_error = top_k_error(full, len(prompt), ref_scores)
        # the prompt as two prefill chunks (the second continues the first's state), then one-token decodes
        first = (len(prompt) + 1) // 2
        split = llm.prefill_logits(sequence, [first, len(prompt) - first] if len(prompt) > 1 else [1]).cpu()
        result.split_rel_error = rel_error(split, full)
        result.noise_floor = rounding.noise_floor(sequence, ROUNDING_PERTURBATION[dtype], seed + i)
        results.append(result)
    llm.shutdown()
    measure_weight_floors(results, dtype, lambda i: rounding.weight_floor(prompt_ids[i] + ref_run.tokens[i],
                                                                         ROUNDING_PERTURBATION[dtype]))  # fmt: skip
    return results


def _split_bound(result: PromptResult, dtype: str) -> float:
    return max(SPLIT_TOLERANCE[dtype], NOISE_FLOOR_FACTOR * result.noise_floor)


def measure_weight_floors(results: list[PromptResult], dtype: str, floor_of: Callable[[int], float]) -> None:
    """For each prompt whose logit error or prefill-split error is above its fixed bound, the reference's own
    change under one rounding of every weight (floor_of(index)): the gate then tells an ill-conditioned prompt
    (within NOISE_FLOOR_FACTOR of that change) from a defect, and prints which it judged each to be."""
    for result in results:
        if result.logit_rel_error > LOGIT_TOLERANCE[dtype] or result.split_rel_error > _split_bound(result, dtype):
            result.weight_floor = floor_of(result.index)


def first_position_over(ours: torch.Tensor, ref: torch.Tensor, tolerance: float) -> int:
    """The first position whose own share of the relative error (its row's difference over the whole reference's
    norm) exceeds `tolerance`; the worst position if none does alone."""
    per_row = (ours.double() - ref.double()).norm(dim=-1) / ref.double().norm().clamp_min(1e-30)  # [L]
    over = (per_row > tolerance).nonzero()
    return int(over[0]) if len(over) else int(per_row.argmax())


def measure_router_ties(
    results: list[PromptResult],
    dtype: str,
    first_over: dict[int, int],
    margins_of: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None],
) -> None:
    """For each prompt whose logit error is above the bound and beyond its weight floor, the reference's routing
    margin at the first position over the bound (margins_of(index): per-position margins over the prompt's
    prefill, so a position in the continuation is not measured and stays a defect)."""
    for result in results:
        position = first_over.get(result.index)
        if position is None or position >= result.prompt_len:
            continue
        if result.logit_rel_error <= LOGIT_TOLERANCE[dtype] or _is_within_weight_floor(result.logit_rel_error, result):
            continue
        margins = margins_of(result.index)
        if margins is not None:
            value, layer = margins
            result.routing_margin = (position, int(layer[position]), float(value[position]))


def _is_router_tie(result: PromptResult, dtype: str) -> bool:
    return result.routing_margin is not None and result.routing_margin[2] < ROUTER_TIE_FACTOR * LOGIT_TOLERANCE[dtype]


def _logit_verdict(result: PromptResult, dtype: str) -> str:
    if _is_within_weight_floor(result.logit_rel_error, result):
        return "ill-conditioned"
    return "ill-conditioned (router near-tie)" if _is_router_tie(result, dtype) else "FAIL"


def _margin_text(result: PromptResult) -> str:
    if result.routing_margin is None:
        return ""
    position, layer, margin = result.routing_margin
    return (f"; at position {position}, the first over the bound, the reference's top-k routing margin is "
            f"{margin:.3g} (relative) at layer {layer}")  # fmt: skip


def _floor_text(result: PromptResult) -> str:
    return "not measured" if result.weight_floor is None else f"{result.weight_floor:.3g}"


def _is_within_weight_floor(error: float, result: PromptResult) -> bool:
    return result.weight_floor is not None and error <= NOISE_FLOOR_FACTOR * result.weight_floor


def top_k_error(full: torch.Tensor, prompt_len: int, scores: list[StepScores]) -> float:
    """Relative error of our logits at the reference's top-k entries of every step (vLLM returns only those)."""
    ours, theirs = [], []
    for step, row in enumerate(scores):
        for token, value in row.values.items():
            ours.append(float(full[prompt_len - 1 + step, token]))
            theirs.append(value)
    return rel_error(torch.tensor(ours), torch.tensor(theirs))


def _summary(config: dict[str, Any]) -> dict[str, Any]:
    """The reference's configuration without the registry's long reasons (those go to the record)."""
    return {k: v for k, v in config.items() if k != "registry"}


def _token_text(tokenizer: Any, token: int) -> str:
    if token < 0:
        return "(none)"
    try:
        return repr(tokenizer.decode([token]))
    except Exception:
        # an id past the tokenizer (a padding row) has no text
        return "(no text)"


def report_verdict(
    report: GateReport,
    results: list[PromptResult],
    dtype: str,
    model_dir: Path,
    reference: str,
    ref_run: ReferenceRun,
    prompts: str,
    tokenizer: Any,
    tensor_parallel_size: int = 1,
) -> int:
    num_exact = sum(r.is_exact for r in results)
    mismatches = [r for r in results if r.mismatch is not None]
    num_ties = sum(1 for r in mismatches if r.mismatch.is_near_tie)
    ref_name = f"{reference} {ref_run.config.get('class') or ref_run.config.get('version') or ''}".strip()
    tail = f": {len(mismatches)} mismatches, {num_ties} of them near-ties" if mismatches else ""
    report.say(f"STRICT {num_exact}/{len(results)} against {ref_name} ({dtype}){tail}")
    for r in mismatches:
        m = r.mismatch
        m.ref_token_text, m.our_token_text = _token_text(tokenizer, m.ref_token), _token_text(tokenizer, m.our_token)
        bound = "" if m.is_margin_exact else "> "
        verdict = "near-tie" if m.is_near_tie else "beyond the near-tie margin"
        report.say(
            f"  prompt {r.index} (len {r.prompt_len}), output position {m.position}: reference {m.ref_token} "
            f"{m.ref_token_text} vs deltaserve {m.our_token} {m.our_token_text}; reference margin {bound}{m.margin:.6g}"
            f" ({dtype}; near-tie margin {m.tie_margin:.3g} = {TIE_ULPS:g} ulps at its top logit): {verdict}"
        )
    lengths = [r.prompt_len for r in results]
    tp = f", tensor parallel {tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    report.say(
        f"gate tokens: {model_dir} ({dtype}{tp}), {len(results)} {prompts} prompts of lengths "
        f"{min(lengths)}..{max(lengths)}; reference {reference}: {json.dumps(_summary(ref_run.config))}"
    )
    if results[0].is_ref_dtype_exact is not None:
        num_ref = sum(bool(r.is_ref_dtype_exact) for r in results)
        num_ours = sum(bool(r.is_ours_vs_fp32_exact) for r in results)
        report.say(
            f"yardstick against transformers-float32: {reference}-{dtype} STRICT {num_ref}/{len(results)}, "
            f"deltaserve-{dtype} STRICT {num_ours}/{len(results)}"
        )
    logit_tol = LOGIT_TOLERANCE[dtype]
    worst_logit = max(r.logit_rel_error for r in results)
    above = [r for r in results if r.logit_rel_error > logit_tol]
    logit_failing = [r for r in above if _logit_verdict(r, dtype) == "FAIL"]
    is_logit_ok = not logit_failing
    scope = "over all positions" if reference == "transformers" else "over vLLM's top-20 logits per step"
    excused = (
        f", {len(above)} prompts above it all within {NOISE_FLOOR_FACTOR:g}x the reference's own change"
        " under one rounding of its weights or at a router near-tie (ill-conditioned, listed below)"
        if above and is_logit_ok
        else ""
    )
    report.say(
        f"logits vs reference ({scope}): max relative error {worst_logit:.3g} (tolerance {logit_tol:g}{excused}) "
        f"{'ok' if is_logit_ok else f'FAIL on {len(logit_failing)} prompts'}"
    )
    for r in above:
        report.say(f"  prompt {r.index}: logit error {r.logit_rel_error:.3g} > {logit_tol:g}; reference's own change"
                   f" under one rounding of every weight {_floor_text(r)}{_margin_text(r)}:"
                   f" {_logit_verdict(r, dtype)}")  # fmt: skip
    split_above = [r for r in results if r.split_rel_error > _split_bound(r, dtype)]
    failing = [r for r in split_above if not _is_within_weight_floor(r.split_rel_error, r)]
    worst = max(results, key=lambda r: r.split_rel_error / max(r.noise_floor, 1e-30))
    report.say(
        f"prefill-then-decode vs full forward: max relative error {max(r.split_rel_error for r in results):.3g}; "
        f"worst prompt {worst.index}: {worst.split_rel_error:.3g} against a rounding noise floor of "
        f"{worst.noise_floor:.3g} (bound {NOISE_FLOOR_FACTOR:g}x floor, at least {SPLIT_TOLERANCE[dtype]:g}) "
        f"{'ok' if not failing else f'FAIL on {len(failing)} prompts'}"
    )
    for r in split_above:
        verdict = "ill-conditioned" if _is_within_weight_floor(r.split_rel_error, r) else "FAIL"
        bound = _split_bound(r, dtype)
        report.say(f"  prompt {r.index}: split error {r.split_rel_error:.3g} > bound {bound:.3g}; reference's own "
                   f"change under one rounding of every weight {_floor_text(r)}: {verdict}")  # fmt: skip
    return 0 if num_exact == len(results) and is_logit_ok and not failing else 1


def write_record(
    path: Path,
    report: GateReport,
    results: list[PromptResult],
    code: int,
    model_dir: Path,
    dtype: str,
    reference: str,
    ref_run: ReferenceRun,
    prompts: str,
    seed: int,
) -> None:
    record = {
        "kind": "gate-tokens",
        "model": str(model_dir),
        "dtype": dtype,
        "reference": reference,
        "reference_config": ref_run.config,
        "deltaserve": {"fuse_attn_preamble": env.fuse_attn_preamble(), "use_triton": env.use_triton()},
        "prompts": {"source": prompts, "seed": seed, "lengths": [r.prompt_len for r in results]},
        "strict": {"num_exact": sum(r.is_exact for r in results), "num_prompts": len(results)},
        "near_tie_margin": f"{TIE_ULPS:g} ulps of {dtype} at the reference's top logit",
        "results": [asdict(r) for r in results],
        "exit_code": code,
        "output": report.lines,
    }
    save_record(path, RECORD_SCHEMA, record)


def save_record(path: Path, schema: str, record: dict[str, Any]) -> None:
    """Writes a gate's JSON record: `schema` first, then the gate's fields, last the facts of the host it ran on."""
    from deltaserve.bench.provenance import host_facts

    record = {"schema": schema, **record, "host": host_facts(Path(__file__).resolve().parents[2])}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
