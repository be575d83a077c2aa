"""The token gate's references: what deltaserve's tokens are compared with, and what each one reports.

A reference runs the gate's prompts greedily and returns, per prompt, its tokens and the logits each step
chose from, in its own dtype (so a margin is measured in the reference's numbers, never re-rounded). The
transformers reference is built from `config.architectures[0]` (the composite *ForConditionalGeneration class
for a composite checkpoint: AutoModelForCausalLM builds the text-only class from text_config, which leaves
lm_head random when the top-level and text_config tie flags differ), and it is refused when transformers
reports missing, mismatched or unexpected weights, so a partly random reference never produces a verdict.
The vLLM reference lives in vllm_reference.py.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Mantissa bits of each dtype (ulp(x) = 2 ** (exponent(x) - bits)).
MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}


class ReferenceError(RuntimeError):
    """The reference cannot stand for the checkpoint (wrong class, partly random weights, missing engine)."""


def ulp(value: float, dtype: str) -> float:
    """One unit in the last place of `value` in `dtype`."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - MANTISSA_BITS[dtype])


@dataclass
class StepScores:
    """The logits one greedy step chose from: a full row, or only the top entries (vLLM returns top-k)."""

    values: dict[int, float]  # token id -> logit, in the reference's dtype (exactly representable there)
    is_complete: bool  # True: every token's logit is here; False: only the top len(values)

    @classmethod
    def from_row(cls, row: torch.Tensor) -> StepScores:
        values = row.detach().cpu().double().tolist()
        return cls(dict(enumerate(values)), True)

    def margin(self, top: int, other: int) -> tuple[float, bool]:
        """(logit[top] - logit[other], is_exact); a token outside a top-k row gives a lower bound."""
        if other in self.values:
            return self.values[top] - self.values[other], True
        return self.values[top] - min(self.values.values()), False

    def top_values(self, k: int) -> list[tuple[int, float]]:
        return sorted(self.values.items(), key=lambda item: -item[1])[:k]


@dataclass
class ReferenceRun:
    """Greedy output of a reference on every prompt."""

    tokens: list[list[int]]
    scores: list[list[StepScores]]
    config: dict[str, Any] = field(default_factory=dict)


def architecture(model_dir: Path) -> str:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not architectures:
        raise ReferenceError(f"{model_dir}/config.json names no architectures: the reference class is unknown")
    return str(architectures[0])


def load_transformers(model_dir: Path, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """transformers' `config.architectures[0]` class, loaded whole, and what it reported; refuses a partial load."""
    import transformers

    name = architecture(model_dir)
    model_class = getattr(transformers, name, None)
    if model_class is None:
        raise ReferenceError(f"transformers {transformers.__version__} has no class {name} (config.architectures[0])")
    model, info = model_class.from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
    problems = {key: sorted(info.get(key) or []) for key in ("missing_keys", "mismatched_keys", "unexpected_keys")}
    problems = {key: value for key, value in problems.items() if value}
    if info.get("error_msgs"):
        problems["error_msgs"] = list(info["error_msgs"])
    if problems:
        detail = "; ".join(f"{key.replace('_', ' ')}: {', '.join(map(str, v[:6]))}" for key, v in problems.items())
        raise ReferenceError(
            f"the transformers reference {name} for {model_dir} is partly random or incomplete ({detail}); "
            "refusing to compare against it"
        )
    facts = {
        "engine": "transformers",
        "version": transformers.__version__,
        "class": type(model).__name__,
        "dtype": str(dtype).removeprefix("torch."),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "loading_info": {key: [] for key in ("missing_keys", "mismatched_keys", "unexpected_keys")},
    }
    return model.to(device).eval(), facts


@torch.inference_mode()
def transformers_greedy(
    model: torch.nn.Module, prompt: list[int], max_tokens: int, device: str
) -> tuple[list[int], list[StepScores]]:
    """transformers' own prefill + cached decode loop; tokens and each step's logits in the model's dtype."""
    ids = torch.tensor([prompt], device=device)
    out = model(input_ids=ids, use_cache=True)
    cache = cache_of(out)
    tokens, scores = [], []
    logits = out.logits[0, -1]
    for _ in range(max_tokens):
        scores.append(StepScores.from_row(logits))
        # torch.argmax returns the first maximal index, as vLLM's greedy sampler does.
        token = int(torch.argmax(logits.float()))
        tokens.append(token)
        step = {cache_argument(model): cache}
        out = model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **step)
        cache = cache_of(out)
        logits = out.logits[0, -1]
    return tokens, scores


def cache_argument(model: torch.nn.Module) -> str:
    """The forward's name for the cache: `cache` from transformers 5.24 on (`past_key_values` is deprecated
    there), `past_key_values` before (the H200 has 5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output: Any) -> Any:
    """The cache a transformers forward returned (`cache` from 5.24 on, `past_key_values` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


class TransformersReference:
    """transformers' reference class at one dtype."""

    kind = "transformers"

    def __init__(self, model_dir: Path, dtype: str, device: str) -> None:
        self.dtype = dtype
        self.device = device
        self.model, self.facts = load_transformers(model_dir, getattr(torch, dtype), device)

    def run(self, prompts: list[list[int]], max_tokens: int) -> ReferenceRun:
        tokens, scores = [], []
        for prompt in prompts:
            out_tokens, out_scores = transformers_greedy(self.model, prompt, max_tokens, self.device)
            tokens.append(out_tokens)
            scores.append(out_scores)
        return ReferenceRun(tokens, scores, dict(self.facts))

    @torch.inference_mode()
    def full_logits(self, sequence: list[int]) -> torch.Tensor:
        """Logits [L, V] (fp32 copy) of one full forward over `sequence`."""
        ids = torch.tensor([sequence], device=self.device)
        return self.model(input_ids=ids).logits[0].float().cpu()

    @torch.inference_mode()
    def routing_margins(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per position of one forward over `inputs`, the smallest relative top-k margin of the model's MoE
        routing over its layers, (p_k − p_(k+1)) / p_k of each router's softmax, and the layer holding it:
        ([L] fp32, [L] int64). None for a model without routers. A margin at the size of two implementations' own
        fp32 differences makes that top-k choice, and every logit downstream of it, a coin toss."""
        config = getattr(self.model.config, "text_config", None) or self.model.config
        top_k, num_experts = getattr(config, "num_experts_per_tok", 0), getattr(config, "num_experts", 0)
        if not top_k or top_k >= num_experts:
            return None
        out = self.model(**inputs, output_router_logits=True, use_cache=False)
        layers = getattr(out, "router_logits", None)
        if not layers:
            return None
        margins = []
        for logits in layers:  # [L, E] each
            probs = torch.softmax(logits.float().reshape(-1, num_experts), dim=-1)
            top = torch.topk(probs, top_k + 1, dim=-1).values  # [L, k + 1]
            margins.append((top[:, top_k - 1] - top[:, top_k]) / top[:, top_k - 1].clamp_min(1e-30))
        value, layer = torch.stack(margins).min(dim=0)  # over layers: [L], [L]
        return value.cpu(), layer.cpu()

    @torch.inference_mode()
    def weight_floor(self, sequence: list[int], relative: float, seeds: tuple[int, ...] = (0, 1, 2)) -> float:
        """The largest relative change of this model's logits over `sequence` when EVERY weight matrix moves by
        `relative` (one rounding's worth, a fresh draw per seed): what the reference itself does under one
        rounding anywhere. On a checkpoint whose routers or activations sit near ties (random tiny MoE models) this
        is orders above `noise_floor`, which moves only the embedding table; the gate measures it only for the
        prompts whose errors pass the fixed bounds, so a well-conditioned run never pays for it."""
        params = [p for p in self.model.parameters() if p.dim() >= 2]
        saved = [p.data.clone() for p in params]
        base = self.full_logits(sequence)
        worst = 0.0
        try:
            for seed in seeds:
                generator = torch.Generator(device="cpu").manual_seed(seed)
                for param, original in zip(params, saved, strict=True):
                    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.device)
                    param.data.copy_((original.float() * (1 + relative * noise)).to(original.dtype))
                moved = self.full_logits(sequence)
                change = (moved.double() - base.double()).norm() / base.double().norm().clamp_min(1e-30)
                worst = max(worst, float(change))
        finally:
            for param, original in zip(params, saved, strict=True):
                param.data.copy_(original)
        return worst

    @torch.inference_mode()
    def noise_floor(self, sequence: list[int], relative: float, seed: int) -> float:
        """Relative change of this model's full-forward logits when its embedding table moves by `relative`
        (one rounding's worth): how much the checkpoint amplifies rounding, measured on the reference."""
        embed = self.model.get_input_embeddings().weight
        saved = embed.data.clone()
        base = self.full_logits(sequence)
        generator = torch.Generator(device=embed.device).manual_seed(seed)
        try:
            noise = torch.randn(embed.shape, generator=generator, device=embed.device, dtype=torch.float32)
            embed.data.copy_((saved.float() * (1 + relative * noise)).to(saved.dtype))
            moved = self.full_logits(sequence)
        finally:
            embed.data.copy_(saved)
        return float((moved.double() - base.double()).norm() / base.double().norm().clamp_min(1e-30))
