"""Truncation of the distribution of random rows: min_p, top-k and top-p, then exponential-race sampling.

All functions take fp32 logits [R, V] that are already divided by temperature and edit them in place. Semantics
follow vLLM v1 (`MinPLogitsProcessor`, `apply_top_k_top_p`, `apply_top_k_only`, `random_sample`): ties at the
k-th value are kept, top-p keeps the smallest suffix of the ascending sort whose mass exceeds p (at least one token).
"""

from __future__ import annotations

import torch

# Above this k a full sort is cheaper than torch.topk, and it handles top-k and top-p in one pass.
MAX_TOPK_ONLY = 1024


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p times the row's largest probability. min_p: [R]."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep tokens >= the k-th largest logit. top_k: [R] int64 in [1, V]; max_top_k: the largest k of the rows that
    truncate, known on the host; rows whose k exceeds it (V: off) keep everything."""
    index = top_k.clamp(max=max_top_k) - 1
    kth_values = logits.topk(max_top_k, dim=-1).values.gather(1, index.unsqueeze(1))  # [R, 1]
    kth_values.masked_fill_((top_k > max_top_k).unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth_values, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Sort-based top-k and/or top-p. top_k: [R] int64 (V = off); top_p: [R] fp32 (1.0 = off)."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)  # [R, V] each
    if top_k is not None:
        kth_values = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))  # [R, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_values, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)  # [R, V], ascending mass
        is_dropped = cumulative <= (1 - top_p).unsqueeze(1)
        is_dropped[:, -1] = False  # the most likely token always survives
        sorted_logits.masked_fill_(is_dropped, float("-inf"))
    logits.scatter_(1, sorted_idx, sorted_logits)


def random_sample(
    probs: torch.Tensor,
    generator: torch.Generator,
    row_generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1) per token: an exact draw from p. probs: [R, V] fp32, consumed.

    Rows in `row_generators` draw q only from their own generator, so a seeded request samples the same tokens
    whatever else is in the batch; every other row shares `generator`.
    """
    noise = torch.empty_like(probs)
    if len(row_generators) < probs.shape[0]:
        noise.exponential_(generator=generator)
    for row, row_generator in row_generators.items():
        noise[row].exponential_(generator=row_generator)
    return probs.div_(noise).argmax(dim=-1)  # [R]
