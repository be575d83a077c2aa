"""The rejection rules of speculative decoding: the target's results at a verify chunk's 1 + k positions and the k
drafts -> the accepted tokens, on the device with no host sync (docs/speculative-decoding.md#the-accept-rules).

Draft j is judged by the target's position j (whose logits predict the token the draft stands for). Each chunk
emits 1 .. k + 1 tokens: its accepted drafts, then one token of the target's at the first rejection, or the bonus
token (the target's own sample at position k) when all k are accepted.

- Greedy (vLLM's rule): accept draft j while it equals the target's token there (the argmax of the processed
  logits); the token at the first rejection is the target's argmax. The tokens are exactly plain greedy decoding's.
- Random (speculative sampling with a one-hot draft distribution: MTP drafts are argmax drafts and carry no
  probabilities): accept draft d with probability p(d), p the target's final distribution at that position (after
  temperature, top-k, top-p, min-p and the masks); at the first rejection draw from p with d removed, renormalised.
  Each emitted token is then distributed as p whatever the drafts are (unseeded rows).
- Seeded random rows (the coupled rule): accept draft d exactly when it equals the target's own draw at that
  position (the sampler's draw with the position's generator, seed and output index), and emit that draw at the
  first rejection. The draw equals d with probability p(d), and given a rejection it is distributed as p with d
  removed, renormalised: the random rule's law, but the emitted tokens are the position's own draws, the tokens of
  the same seeded request without speculation, whichever positions carried drafts (a preemption, a step budget or
  a k policy moves them).
- Synthetic (vLLM's benchmarking mode): the accept decision is pinned by unconditional rates r_1 >= ... >= r_k
  (r_i: the chance that drafts 1..i are all accepted), drawn with the conditional r_i / r_(i-1); the emitted tokens
  are the drafts up to the first rejection and then the target's token there. The work is unchanged.
"""

from __future__ import annotations

import torch


def _emit(
    target: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor, num_drafts: torch.Tensor,
    at_rejection: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """accepted [S, W-1] per-draft decisions (False past k) -> (tokens [S, W], num_emitted [S]): the leading
    accepted drafts, then at_rejection [S, W-1] at the first rejection, or the bonus token target[:, k]."""
    width = target.shape[1]
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [S]: the leading run
    columns = torch.arange(width, device=target.device)[None, :]
    # the token after the run: a rejection's, or the target's own at position k (the bonus)
    padded = torch.cat([at_rejection, at_rejection[:, :1]], dim=1)  # [S, W]
    is_bonus = (num_accepted == num_drafts)[:, None]
    last = torch.where(is_bonus, target, padded).gather(1, num_accepted[:, None])  # [S, 1]
    run = torch.cat([drafts, drafts[:, :1]], dim=1)  # [S, W]
    tokens = torch.where(columns < num_accepted[:, None], run, last)
    tokens = torch.where(columns <= num_accepted[:, None], tokens, torch.full_like(tokens, -1))
    return tokens, num_accepted + 1


def _real(drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    columns = torch.arange(drafts.shape[1], device=drafts.device)
    return columns[None, :] < num_drafts[:, None]  # [S, W-1]


def greedy_accept(
    target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """target [S, W] (the target's token at each of the 1 + k_s positions; anything past them), drafts [S, W - 1]
    (-1 past k_s), num_drafts [S] -> (tokens [S, W]: the emitted tokens then -1, num_emitted [S] in 1 .. k_s + 1)."""
    accepted = (drafts == target[:, :-1]) & _real(drafts, num_drafts)
    return _emit(target, drafts, accepted, num_drafts, target[:, :-1])


def recovered_tokens(probs: torch.Tensor, drafts: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [S, W-1, V] (the target's distribution judging each draft), drafts [S, W-1], noise [S, W-1, V] ~ Exp(1)
    -> a draw from each p with its draft removed and renormalised [S, W-1] (argmax(p' / q), exact)."""
    residual = probs.clone()
    residual.scatter_(2, drafts.clamp(min=0).unsqueeze(2), 0.0)
    return residual.div_(noise).argmax(dim=-1)


def random_accept(
    target: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    is_coupled: torch.Tensor,
    probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy, seeded and unseeded random rows together. target [S, W] (the target's own token per position: argmax
    for greedy rows, a draw for random ones), drafts [S, W-1], num_drafts [S], is_coupled [S] (greedy and seeded
    rows: a draft is accepted exactly when it equals the target's token, which the first rejection emits), probs
    [S, W-1, V] (the distribution at each draft's position; unused for coupled rows), uniforms [S, W-1] in [0, 1),
    noise [S, W-1, V] ~ Exp(1) (both unused for coupled rows)."""
    draft_probs = probs.gather(2, drafts.clamp(min=0).unsqueeze(2)).squeeze(2)  # [S, W-1]: p(d)
    by_chance = uniforms < draft_probs
    accepted = torch.where(is_coupled[:, None], drafts == target[:, :-1], by_chance) & _real(drafts, num_drafts)
    recovered = torch.where(is_coupled[:, None], target[:, :-1], recovered_tokens(probs, drafts, noise))
    return _emit(target, drafts, accepted, num_drafts, recovered)


def synthetic_accept(
    target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, rates: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """rates [K >= W-1] unconditional, non-increasing; uniforms [S, W-1]: draft j is accepted (given the earlier
    ones) with probability rates[j] / rates[j - 1]."""
    width = drafts.shape[1]
    rates = rates[:width].float()
    previous = torch.cat([rates.new_ones(1), rates[:-1]])
    conditional = torch.where(previous > 0, rates / previous.clamp(min=1e-30), torch.zeros_like(rates))  # [W-1]
    accepted = (uniforms < conditional[None, :]) & _real(drafts, num_drafts)
    return _emit(target, drafts, accepted, num_drafts, target[:, :-1])
