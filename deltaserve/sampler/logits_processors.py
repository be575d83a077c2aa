"""Logit processors without token history: a packed token bitmask (grammars, multi-token bad words) and the
per-request static bias (logit_bias, allowed_token_ids, single-token bad_words).

The bitmask is xgrammar's layout: int32 [C, ceil(V / 32)], bit j of word w allows token 32 * w + j; it is filled on
the host between steps (engine/structured.py) and unpacked here on the device into one masked_fill per step. The
static bias is one fp32 row [V] per request that asked for any of those controls, built once when the request is
added (runner/request_table.py): 0 for an untouched token, the bias for a biased one, -inf for a banned or a
not-allowed one. Adding it is exact: -inf absorbs any finite bias, and the biases are clamped to [-100, 100].
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

BITS = 32


@dataclass
class StaticBias:
    rows: torch.Tensor  # [P] int64: the batch rows with a static bias
    values: torch.Tensor  # [P, V] fp32


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [C, W] -> bool [C, V], True where the token is allowed."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [C, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens of the given rows -> -inf, in place. logits: [B, V]; rows: [C] int64; bitmask: [C, W]."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    sub = logits.index_select(0, rows)  # [C, V]
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


def apply_static_bias(logits: torch.Tensor, bias: StaticBias) -> None:
    """logits[rows] += values, in place (fp32 [B, V])."""
    logits.index_add_(0, bias.rows, bias.values)


def static_bias_row(
    vocab_size: int,
    logit_bias: Mapping[int, float] | None,
    allowed_token_ids: Iterable[int] | None,
    banned_token_ids: Iterable[int],
) -> np.ndarray | None:
    """The [V] fp32 static bias of one request, or None when it asks for none of the controls. Ids outside
    [0, V) are dropped (the front end refuses them; a padded vocabulary can still be narrower here)."""
    banned = [t for t in banned_token_ids if 0 <= t < vocab_size]
    if not logit_bias and allowed_token_ids is None and not banned:
        return None
    row = np.zeros(vocab_size, dtype=np.float32)
    for token_id, value in (logit_bias or {}).items():
        if 0 <= token_id < vocab_size:
            row[token_id] += value
    if allowed_token_ids is not None:
        is_allowed = np.zeros(vocab_size, dtype=np.bool_)
        allowed = np.fromiter((t for t in allowed_token_ids if 0 <= t < vocab_size), dtype=np.int64)
        is_allowed[allowed] = True
        row[~is_allowed] = -np.inf
    row[banned] = -np.inf
    return row


def single_token_bad_words(bad_words_token_ids: Iterable[Iterable[int]] | None) -> list[int]:
    """The bad words of one token: banned at every step (longer ones need history: engine/structured.py)."""
    return [ids[0] for ids in map(list, bad_words_token_ids or []) if len(ids) == 1]
