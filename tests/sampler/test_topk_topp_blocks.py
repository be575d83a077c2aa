"""The truncations run a block of rows at a time (sampler/topk_topp.py `row_blocks`) to bound their temporaries:
each block's result must be the same bits as one pass over every row, for every truncation and for uneven last
blocks, and the blocks must cover every row exactly once."""

from __future__ import annotations

import pytest
import torch

from deltaserve.sampler import topk_topp
from deltaserve.sampler.topk_topp import apply_min_p, apply_top_k_only, apply_top_k_top_p, row_blocks


def _one_pass(monkeypatch: pytest.MonkeyPatch, fn, logits: torch.Tensor, *args) -> torch.Tensor:  # noqa: ANN001
    """fn over all rows in one block (the pre-blocking behaviour)."""
    whole = logits.clone()
    with monkeypatch.context() as patch:
        patch.setattr(topk_topp, "BLOCK_ELEMENTS", whole.numel())
        assert len(row_blocks(*whole.shape)) == 1
        fn(whole, *args)
    return whole


@pytest.mark.parametrize("rows_per_block", [1, 3, 7])
def test_blocked_truncations_equal_one_pass(monkeypatch: pytest.MonkeyPatch, rows_per_block: int) -> None:
    torch.manual_seed(0)
    num_rows, vocab = 10, 97
    logits = torch.randn(num_rows, vocab) * 3
    logits[2, :5] = logits[2, 5]  # ties at the k-th value
    top_k = torch.tensor([1, 5, 6, 97, 40, 2, 97, 13, 8, 50])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.1, 0.7, 1.0, 0.3, 0.95, 0.6])
    min_p = torch.tensor([0.0, 0.1, 0.05, 0.5, 0.2, 0.0, 0.3, 0.01, 0.9, 0.4])
    cases = [
        (apply_top_k_top_p, (top_k, top_p)),
        (apply_top_k_top_p, (top_k, None)),
        (apply_top_k_top_p, (None, top_p)),
        (apply_top_k_only, (top_k.clamp(max=13), 13)),
        (apply_min_p, (min_p,)),
    ]
    for fn, args in cases:
        expected = _one_pass(monkeypatch, fn, logits, *args)
        blocked = logits.clone()
        with monkeypatch.context() as patch:
            patch.setattr(topk_topp, "BLOCK_ELEMENTS", rows_per_block * vocab)
            assert len(row_blocks(num_rows, vocab)) == -(-num_rows // rows_per_block)
            fn(blocked, *args)
        assert torch.equal(blocked, expected), f"{fn.__name__} with {rows_per_block} rows a block"
        assert not torch.equal(blocked, logits), f"{fn.__name__} truncated nothing: the case checks nothing"


def test_row_blocks_cover_every_row_once() -> None:
    for num_rows, vocab in [(0, 10), (1, 10), (1024, 248_320), (135, 248_320), (136, 248_320), (5, 2**26)]:
        covered = [r for block in row_blocks(num_rows, vocab) for r in range(num_rows)[block]]
        assert covered == list(range(num_rows))
    # Qwen3.5's vocabulary: a batch of 128 rows is one block, the warm-up's 1,024 rows eight
    assert len(row_blocks(128, 248_320)) == 1
    assert len(row_blocks(1024, 248_320)) == 8
