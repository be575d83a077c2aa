"""Truncation of the distribution of random rows: min_p, top-k and top-p, then exponential-race sampling.

All functions take fp32 logits [R, V] that are already divided by temperature and edit them in place, a block of
rows at a time (`row_blocks`): every step is row-wise, so the result is the same bits as one pass over all rows, and
the temporaries (a sort's values and int64 indices, a softmax, masks: ~18 bytes a logit, plus the sort's own double
buffers on CUDA) stay those of one block instead of growing with the batch
(docs/ARCHITECTURE.md#the-samplers-share-of-the-warm-up-peak). Semantics
follow vLLM v1 (`MinPLogitsProcessor`, `apply_top_k_top_p`, `apply_top_k_only`, `random_sample`): ties at the
k-th value are kept, top-p keeps the smallest suffix of the ascending sort whose mass exceeds p (at least one token).
"""

from __future__ import annotations

import torch

# Above this k a full sort is cheaper than torch.topk, and it handles top-k and top-p in one pass.
MAX_TOPK_ONLY = 1024
# Logits per block of rows: 2**25 fp32 is 128 MiB, 135 rows of Qwen3.5's 248,320-token vocabulary, so a batch of up
# to 128 rows runs as one block and the warm-up's 1,024 rows as 8.
BLOCK_ELEMENTS = 2**25


def row_blocks(num_rows: int, vocab_size: int) -> list[slice]:
    """The row ranges the truncations run over, each at most BLOCK_ELEMENTS logits (at least one row)."""
    rows = max(1, BLOCK_ELEMENTS // max(vocab_size, 1))
    return [slice(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows)]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p times the row's largest probability. min_p: [R]."""
    for rows in row_blocks(*logits.shape):
        block = logits[rows]  # [r, V], a view: edited in place
        probs = block.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[rows].unsqueeze(1)  # [r, 1]
        block.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep tokens >= the k-th largest logit. top_k: [R] int64 in [1, V]; max_top_k: the largest k of the rows that
    truncate, known on the host; rows whose k exceeds it (V: off) keep everything."""
    index = top_k.clamp(max=max_top_k) - 1
    for rows in row_blocks(*logits.shape):
        block = logits[rows]  # [r, V]
        kth_values = block.topk(max_top_k, dim=-1).values.gather(1, index[rows].unsqueeze(1))  # [r, 1]
        kth_values.masked_fill_((top_k[rows] > max_top_k).unsqueeze(1), float("-inf"))
        block.masked_fill_(block < kth_values, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Sort-based top-k and/or top-p. top_k: [R] int64 (V = off); top_p: [R] fp32 (1.0 = off)."""
    vocab_size = logits.shape[1]
    for rows in row_blocks(*logits.shape):
        block = logits[rows]  # [r, V]
        sorted_logits, sorted_idx = block.sort(dim=-1, descending=False)  # [r, V] each
        if top_k is not None:
            kth_values = sorted_logits.gather(1, (vocab_size - top_k[rows]).unsqueeze(1))  # [r, 1]
            sorted_logits.masked_fill_(sorted_logits < kth_values, float("-inf"))
        if top_p is not None:
            cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)  # [r, V], ascending mass
            is_dropped = cumulative <= (1 - top_p[rows]).unsqueeze(1)
            del cumulative
            is_dropped[:, -1] = False  # the most likely token always survives
            sorted_logits.masked_fill_(is_dropped, float("-inf"))
        block.scatter_(1, sorted_idx, sorted_logits)


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
