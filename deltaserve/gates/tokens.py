"""`deltaserve gate tokens`: greedy token-exactness of deltaserve against transformers, plus logit checks.

For N seeded prompts of varied length it generates greedily in both engines and prints `STRICT n/N`; for
each failing prompt, the first divergent position and the reference's top-2 logit margin there (and, in
bf16, whether that margin is a near-tie within a few bf16 ulps). It also checks, per prompt:
- logits: deltaserve's full forward against transformers' full forward, relative error
  ||ours - ref|| / ||ref|| over all positions <= 1e-4 in fp32 (both compute the same fp32 math in a
  different order; per-op differences are ~1e-7 and compound over the layers to ~1e-6..1e-5);
- prefill-then-decode equals one full forward: deltaserve's logits from the prompt as two prefill chunks
  (the second continuing the first's state) followed by one-token decode steps, against one prefill of the
  whole sequence. The chunked and the recurrent delta
  rule differ only by rounding, so the bound is the model's own rounding noise floor: the relative change of
  the same logits when the embedding table is perturbed by one rounding's worth (1e-7 relative in fp32,
  4e-3 in bf16), times 10, and never below 1e-5 (fp32). A state restarted from zero (the transformers bug of
  architecture doc §8.1) moves the logits by O(1), far above it. The random tiny models amplify rounding
  ~1000x, which is why a fixed 1e-5 would only measure their chaos.
In bf16 the gate also reports the yardstick: transformers-bf16 and deltaserve-bf16 each against
transformers-fp32, so mismatches can be read against the reference's own bf16 disagreement.
Exit 0 only when every prompt matches and every check holds; 1 on any failure; 2 when nothing was checked.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
SPLIT_TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 1e-2}
ROUNDING_PERTURBATION = {"float32": 1e-7, "bfloat16": 4e-3, "float16": 5e-4}
NOISE_FLOOR_FACTOR = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--reference", default="transformers", choices=["transformers"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-len", type=int, default=160)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="deltaserve's ranks")


def run(args: argparse.Namespace) -> int:
    return run_gate(
        Path(args.model), args.reference, args.num_prompts, args.max_tokens, args.dtype, args.device, args.seed,
        args.max_prompt_len, args.tensor_parallel_size,
    )  # fmt: skip


@dataclass
class PromptResult:
    index: int
    prompt_len: int
    is_exact: bool
    first_divergence: int | None = None
    ref_margin: float | None = None
    is_near_tie: bool = False
    logit_rel_error: float = 0.0
    split_rel_error: float = 0.0
    noise_floor: float = 0.0
    is_ref_dtype_exact: bool | None = None  # reference in this dtype vs reference in fp32 (bf16 yardstick)
    is_ours_vs_fp32_exact: bool | None = None


def make_prompts(tokenizer: object, num_prompts: int, max_len: int, seed: int) -> list[list[int]]:
    """Seeded prompts of ordinary (non-special) token ids, lengths spread over 1..max_len."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    ordinary = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    lengths = [1, 2, 63, 64, 65, 100, 129, max_len]
    while len(lengths) < num_prompts:
        lengths.append(int(rng.integers(1, max_len + 1)))
    return [rng.choice(ordinary, size=n).tolist() for n in lengths[:num_prompts]]


def bf16_ulp(value: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - 7)


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def reference_greedy(
    model: torch.nn.Module, prompt: list[int], max_tokens: int, device: str
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own prefill + cached decode loop; returns tokens and the logits each step chose from."""
    ids = torch.tensor([prompt], device=device)
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    tokens, step_logits = [], []
    logits = out.logits[0, -1].float()
    for _ in range(max_tokens):
        step_logits.append(logits.cpu())
        token = int(torch.argmax(logits))
        tokens.append(token)
        out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, step_logits


def noise_floor(llm: object, sequence: list[int], base: torch.Tensor, relative: float, seed: int) -> float:
    """Relative change of the full-forward logits `base` when the embedding table moves by `relative` (one
    rounding); on every tensor-parallel rank's rows alike."""
    runner = llm.engine.runner
    runner.run_on_all_ranks("perturb_embedding", relative, seed)
    try:
        return rel_error(llm.score(sequence).cpu(), base)
    finally:
        runner.run_on_all_ranks("restore_embedding")


def load_reference(model_dir: Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


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
    tensor_parallel_size: int = 1,
) -> int:
    from deltaserve.engine.llm import LLM
    from deltaserve.sampling_params import SamplingParams

    if num_prompts < 1 or max_tokens < 1:
        print("gate tokens: nothing to check (num_prompts and max_tokens must be positive)")
        return 2
    torch_dtype = getattr(torch, dtype)
    llm = LLM(
        model_dir, dtype=dtype, device=device, max_num_seqs=min(num_prompts, 64), seed=seed,
        tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip
    run_device = str(llm.engine.runner.device)
    prompts = make_prompts(llm.get_tokenizer(), num_prompts, max_prompt_len, seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref_model = load_reference(model_dir, torch_dtype, run_device)
    ref_fp32 = load_reference(model_dir, torch.float32, run_device) if dtype != "float32" else None
    results = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        ours = output.outputs[0].token_ids
        ref_tokens, ref_step_logits = reference_greedy(ref_model, prompt, max_tokens, run_device)
        result = PromptResult(i, len(prompt), ours == ref_tokens)
        if not result.is_exact:
            pos = next(j for j, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)) if a != b)
            top2 = torch.topk(ref_step_logits[pos], 2).values
            result.first_divergence = pos
            result.ref_margin = float(top2[0] - top2[1])
            result.is_near_tie = result.ref_margin <= 4 * bf16_ulp(float(top2[0]))
        if ref_fp32 is not None:
            fp32_tokens, _ = reference_greedy(ref_fp32, prompt, max_tokens, run_device)
            result.is_ref_dtype_exact = ref_tokens == fp32_tokens
            result.is_ours_vs_fp32_exact = ours == fp32_tokens
        sequence = prompt + ref_tokens
        ref_logits = ref_model(input_ids=torch.tensor([sequence], device=run_device)).logits[0].float().cpu()
        full = llm.score(sequence).cpu()
        # the prompt as two prefill chunks (the second continues the first's state), then one-token decodes
        first = (len(prompt) + 1) // 2
        split = llm.score(sequence, [first, len(prompt) - first] if len(prompt) > 1 else [1]).cpu()
        result.logit_rel_error = rel_error(full, ref_logits)
        result.split_rel_error = rel_error(split, full)
        result.noise_floor = noise_floor(llm, sequence, full, ROUNDING_PERTURBATION[dtype], seed + i)
        results.append(result)
    llm.shutdown()
    return report(results, dtype, model_dir, tensor_parallel_size)


def report(results: list[PromptResult], dtype: str, model_dir: Path, tensor_parallel_size: int = 1) -> int:
    num_exact = sum(r.is_exact for r in results)
    logit_tol = LOGIT_TOLERANCE[dtype]
    worst_logit = max(r.logit_rel_error for r in results)
    tp = f", tensor parallel {tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    print(f"gate tokens: {model_dir} ({dtype}{tp}), {len(results)} prompts, lengths "
          f"{min(r.prompt_len for r in results)}..{max(r.prompt_len for r in results)}")  # fmt: skip
    for r in results:
        if not r.is_exact:
            tie = " (near-tie: within 4 bf16 ulps)" if r.is_near_tie else ""
            print(f"  prompt {r.index} (len {r.prompt_len}): first divergence at output position "
                  f"{r.first_divergence}, reference top-2 margin {r.ref_margin:.6g}{tie}")  # fmt: skip
    num_near_ties = sum(1 for r in results if not r.is_exact and r.is_near_tie)
    print(f"STRICT {num_exact}/{len(results)}" + (f" ({num_near_ties} of the mismatches are near-ties)" if
          num_exact < len(results) else ""))  # fmt: skip
    if results[0].is_ref_dtype_exact is not None:
        num_ref = sum(bool(r.is_ref_dtype_exact) for r in results)
        num_ours = sum(bool(r.is_ours_vs_fp32_exact) for r in results)
        print(f"yardstick against transformers-fp32: transformers-{dtype} STRICT {num_ref}/{len(results)}, "
              f"deltaserve-{dtype} STRICT {num_ours}/{len(results)}")  # fmt: skip
    is_logit_ok = worst_logit <= logit_tol
    print(f"logits vs reference: max relative error {worst_logit:.3g} (tolerance {logit_tol:g}) "
          f"{'ok' if is_logit_ok else 'FAIL'}")  # fmt: skip
    failing = [
        r for r in results if r.split_rel_error > max(SPLIT_TOLERANCE[dtype], NOISE_FLOOR_FACTOR * r.noise_floor)
    ]
    worst = max(results, key=lambda r: r.split_rel_error / max(r.noise_floor, 1e-30))
    print(f"prefill-then-decode vs full forward: max relative error {max(r.split_rel_error for r in results):.3g}; "
          f"worst prompt {worst.index}: {worst.split_rel_error:.3g} against a rounding noise floor of "
          f"{worst.noise_floor:.3g} (bound {NOISE_FLOOR_FACTOR:g}x floor, at least {SPLIT_TOLERANCE[dtype]:g}) "
          f"{'ok' if not failing else f'FAIL on {len(failing)} prompts'}")  # fmt: skip
    return 0 if num_exact == len(results) and is_logit_ok and not failing else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
