"""The rejection rule (sampler/rejection.py): greedy acceptance of drafts against the target's tokens."""

from __future__ import annotations

import torch

from deltaserve.sampler.rejection import greedy_accept


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
