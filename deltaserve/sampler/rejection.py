"""The rejection rule of speculative decoding: the target's tokens at a verify chunk's 1 + k positions and the k
drafts -> the accepted tokens, on the device with no host sync (docs/speculative-decoding.md).

Greedy (vLLM's rule): walk the drafts in order and accept draft j while it equals the target's token at position j
(the argmax of the processed logits); the first mismatch emits the target's token there and stops; when all k are
accepted the target's token at position k (the bonus token) is emitted too. Each chunk emits 1 .. k + 1 tokens, and
they are exactly the tokens plain greedy decoding would produce from the same logits.
"""

from __future__ import annotations

import torch


def greedy_accept(
    target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """target [S, W] (the target's token at each of the 1 + k_s positions; anything past them), drafts [S, W - 1]
    (-1 past k_s), num_drafts [S] -> (tokens [S, W]: the emitted tokens then -1, num_emitted [S] in 1 .. k_s + 1)."""
    width = target.shape[1]
    columns = torch.arange(width - 1, device=target.device)
    matches = (drafts == target[:, :-1]) & (columns[None, :] < num_drafts[:, None])  # [S, W - 1]
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [S]: leading matches
    num_emitted = num_accepted + 1
    keep = torch.arange(width, device=target.device)[None, :] < num_emitted[:, None]
    tokens = torch.where(keep, target, torch.full_like(target, -1))
    return tokens, num_emitted
