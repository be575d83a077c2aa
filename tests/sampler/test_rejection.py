"""The rejection rules (sampler/rejection.py): greedy acceptance of drafts against the target's tokens; the random
rule keeps the target's distribution (chi-square over many draws, as tests/sampler/test_sampler.py checks the
sampler); the synthetic rule pins the acceptance rates."""

from __future__ import annotations

import pytest
import torch

from deltaserve.sampler.rejection import greedy_accept, random_accept, synthetic_accept


def test_greedy_accepts_the_leading_matches_then_the_targets_token() -> None:
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [9, 1, 1, 1]])
    drafts = torch.tensor([[5, 6, 7], [5, 0, 7], [0, 6, 7], [5, 6, -1], [-1, -1, -1]])
    num_drafts = torch.tensor([3, 3, 3, 2, 0])
    tokens, num_emitted = greedy_accept(target, drafts, num_drafts)
    assert num_emitted.tolist() == [4, 2, 1, 3, 1]
    assert tokens.tolist() == [
        [5, 6, 7, 8],  # all accepted, then the bonus token
        [5, 6, -1, -1],  # the first mismatch emits the target's token there
        [5, -1, -1, -1],  # a wrong first draft: only the target's own token
        [5, 6, 7, -1],  # k = 2 of a wider step: its third position is the bonus
        [9, -1, -1, -1],  # k = 0
    ]


def test_a_draft_past_k_is_never_accepted() -> None:
    """Columns past a sequence's k hold whatever the step's padding left; they must not extend a run."""
    target = torch.tensor([[5, 6, 7]])
    tokens, num_emitted = greedy_accept(target, torch.tensor([[5, 6]]), torch.tensor([1]))
    assert num_emitted.tolist() == [2] and tokens.tolist() == [[5, 6, -1]]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 6 tokens, df 5: the 99.9 % critical value of chi-square is 20.5
CRITICAL = 20.5
DISTRIBUTIONS = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.06, 0.04],  # position 0 judges draft 0
        [0.05, 0.10, 0.50, 0.05, 0.20, 0.10],  # position 1 judges draft 1
        [0.10, 0.10, 0.10, 0.40, 0.20, 0.10],  # position 2: the bonus token's distribution
    ]
)


def _draws(drafts: list[int], num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """num verify chunks of k = 2 fixed drafts against DISTRIBUTIONS, all rows random."""
    gens = [torch.Generator().manual_seed(seed + i) for i in range(3)]  # independent streams
    width = DISTRIBUTIONS.shape[0]
    probs = DISTRIBUTIONS.expand(num, -1, -1)  # [S, W, V]
    target = torch.multinomial(probs.reshape(-1, 6), 1, generator=gens[0]).view(num, width)  # the sampler's draws
    uniforms = torch.rand(num, width - 1, generator=gens[1])
    noise = torch.empty(num, width - 1, 6).exponential_(generator=gens[2])
    draft = torch.tensor(drafts).expand(num, -1)
    return random_accept(target, draft, torch.full((num,), 2), torch.zeros(num, dtype=torch.bool),
                         probs[:, :-1].contiguous(), uniforms, noise)  # fmt: skip


@pytest.mark.parametrize("drafts", [[0, 2], [5, 1], [3, 3]])
def test_random_rule_keeps_the_target_distribution(drafts: list[int]) -> None:
    """Whatever the drafts (likely, unlikely, or the same token twice), the first emitted token is distributed as
    position 0's p, the second (given the first draft was accepted) as position 1's, the third (both accepted) as
    the bonus position's."""
    tokens, num_emitted = _draws(drafts, 40000, seed=5)
    first = torch.bincount(tokens[:, 0], minlength=6).float()
    assert _chi_square(first, DISTRIBUTIONS[0]) < CRITICAL
    accepted_first = tokens[:, 0] == drafts[0]  # a recovered token is never the rejected draft
    assert (num_emitted[accepted_first] >= 2).all() and (num_emitted[~accepted_first] == 1).all()
    second = torch.bincount(tokens[accepted_first, 1], minlength=6).float()
    assert _chi_square(second, DISTRIBUTIONS[1]) < CRITICAL
    both = num_emitted == 3
    assert both.sum() > 100
    third = torch.bincount(tokens[both, 2], minlength=6).float()
    assert _chi_square(third, DISTRIBUTIONS[2]) < CRITICAL
    # acceptance as the rule says: p0(d0), then p1(d1)
    rate = accepted_first.float().mean()
    assert abs(rate - DISTRIBUTIONS[0, drafts[0]]) < 0.01


def test_random_rule_greedy_rows_beside_random_ones() -> None:
    """In a mixed batch a greedy row still takes the greedy rule (its own argmax tokens), whatever its uniforms."""
    target = torch.tensor([[2, 4, 1], [2, 4, 1]])
    drafts = torch.tensor([[2, 0], [2, 0]])
    probs = torch.full((2, 2, 6), 1 / 6)
    tokens, num_emitted = random_accept(target, drafts, torch.tensor([2, 2]), torch.tensor([True, False]), probs,
                                        torch.tensor([[0.99, 0.99], [0.0, 0.99]]), torch.ones(2, 2, 6))  # fmt: skip
    assert tokens[0].tolist() == [2, 4, -1] and num_emitted[0] == 2  # greedy: 2 == argmax, 0 != 4
    assert num_emitted[1] == 2 and tokens[1, 0] == 2 and tokens[1, 1] != 0  # random: u 0.0 accepts, 0.99 rejects


def test_coupled_rows_emit_their_own_draws_whatever_the_drafts() -> None:
    """A seeded row (is_coupled) accepts a draft exactly when it equals its own draw there and emits the draw at the
    first rejection: the emitted tokens are the draws, so the law is p's, and a draft d is accepted with p(d)."""
    num, gen = 40000, torch.Generator().manual_seed(11)
    probs = DISTRIBUTIONS.expand(num, -1, -1)  # [S, W, V]
    target = torch.multinomial(probs.reshape(-1, 6), 1, generator=gen).view(num, -1)  # the seeded draws
    drafts = torch.tensor([0, 2]).expand(num, -1)
    ones = torch.ones(num, 2)  # uniforms that would reject every draft under the unseeded rule
    tokens, num_emitted = random_accept(target, drafts, torch.full((num,), 2), torch.ones(num, dtype=torch.bool),
                                        probs[:, :-1].contiguous(), ones * 0.999, torch.ones(num, 2, 6))  # fmt: skip
    columns = torch.arange(3)[None, :]
    assert torch.equal(torch.where(columns < num_emitted[:, None], target, -1), tokens)
    first_accepted = target[:, 0] == 0
    assert torch.equal(num_emitted >= 2, first_accepted)
    assert abs(first_accepted.float().mean() - DISTRIBUTIONS[0, 0]) < 0.01


def test_synthetic_rule_pins_the_unconditional_rates() -> None:
    rates = torch.tensor([0.9, 0.6, 0.3])
    num = 40000
    gen = torch.Generator().manual_seed(3)
    target = torch.randint(0, 50, (num, 4), generator=gen)
    drafts = torch.randint(0, 50, (num, 3), generator=gen)
    tokens, num_emitted = synthetic_accept(
        target, drafts, torch.full((num,), 3), rates, torch.rand(num, 3, generator=gen)
    )
    for i, rate in enumerate(rates.tolist()):
        assert abs((num_emitted >= i + 2).float().mean() - rate) < 0.01
    ran = num_emitted == 2  # one draft accepted: the draft, then the target's token at position 1
    assert torch.equal(tokens[ran, 0], drafts[ran, 0]) and torch.equal(tokens[ran, 1], target[ran, 1])
    short = torch.tensor([1] * 4)  # k = 1 rows of a wider step: never past their one draft
    _, emitted = synthetic_accept(target[:4], drafts[:4], short, torch.ones(3), torch.zeros(4, 3))
    assert emitted.tolist() == [2, 2, 2, 2]
