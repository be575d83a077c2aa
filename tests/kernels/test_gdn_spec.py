"""The verify-step GDN ops (kernels/gdn_spec.py) against the one-token decode ops run token by token: outputs, the
conv window after every token in scratch and its live slot untouched until the commit, the recurrent state after
every token but the last in scratch and after the last column in the live slot, and the commit's choice of state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from deltaserve.kernels import (
    causal_conv1d_update_ref,
    causal_conv1d_verify_ref,
    gdn_decode_ref,
    gdn_verify_ref,
    spec_state_commit,
)

HK, HV, DK, DV, C, K = 2, 4, 8, 8, 12, 4
LENGTHS = (2, 5, 1)  # 1 + k per verify sequence: k = 1, 4, 0
SLOTS = (3, 0, 5)


def token_index(lengths: tuple[int, ...]) -> torch.Tensor:
    width = max(lengths)
    rows, start = [], 0
    for n in lengths:
        rows.append([start + j if j < n else -1 for j in range(width)])
        start += n
    return torch.tensor(rows, dtype=torch.int64)


def verify_columns(index: torch.Tensor) -> Iterator[tuple[int, int, int, int | None]]:
    """(sequence s, its slot, column j, the step row of token j or None where the column is padding), in order: the
    walk a token-by-token replay of the verify step takes."""
    for s, (slot, n) in enumerate(zip(SLOTS, LENGTHS, strict=True)):
        for j in range(max(LENGTHS)):
            yield s, slot, j, int(index[s, j]) if j < n else None


def inputs(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "q": rand(n, HK, DK).to(dtype), "k": rand(n, HK, DK).to(dtype), "v": rand(n, HV, DV).to(dtype),
        "a": rand(n, HV).to(dtype), "b": rand(n, HV).to(dtype), "A_log": rand(HV), "dt_bias": rand(HV).to(dtype),
        "ssm": rand(6, HV, DK, DV), "x": rand(n, C).to(dtype), "weight": rand(C, K).to(dtype),
        "conv": rand(6, K - 1, C).to(dtype),
    }  # fmt: skip


def test_gdn_verify_equals_decode_token_by_token() -> None:
    t = inputs()
    index = token_index(LENGTHS)
    width = max(LENGTHS)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    ssm = t["ssm"].clone()
    scratch = torch.full((4, width - 1, HV, DK, DV), float("nan"))
    out = torch.full_like(t["v"], float("nan"))  # poisoned: every row must be written
    gdn_verify_ref(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], ssm, slots, index, scratch, out)
    assert not out.isnan().any()
    expected_ssm = t["ssm"].clone()
    for s, slot, j, row in verify_columns(index):
        if row is not None:
            one = slice(row, row + 1)
            want = gdn_decode_ref(t["q"][one], t["k"][one], t["v"][one], t["a"][one], t["b"][one], t["A_log"],
                                  t["dt_bias"], expected_ssm, torch.tensor([slot]))  # fmt: skip
            torch.testing.assert_close(out[one], want, rtol=1e-6, atol=1e-6)
        # a padded column repeats the last real state; the last column's state is the live slot's
        got = scratch[s, j] if j < width - 1 else ssm[slot]
        torch.testing.assert_close(got, expected_ssm[slot], rtol=1e-6, atol=1e-6)
    untouched = [i for i in range(6) if i not in SLOTS]
    assert torch.equal(ssm[untouched], t["ssm"][untouched])
    assert scratch[len(SLOTS) :].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_verify_equals_update_token_by_token(dtype: torch.dtype) -> None:
    t = inputs(dtype)
    index = token_index(LENGTHS)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    conv = t["conv"].clone()
    scratch = torch.zeros(4, max(LENGTHS), K - 1, C, dtype=dtype)
    out = torch.full_like(t["x"], float("nan"))
    causal_conv1d_verify_ref(t["x"], t["weight"], conv, slots, index, scratch, out)
    assert torch.equal(conv, t["conv"])
    assert not out.isnan().any()
    expected = t["conv"].clone()
    for s, slot, j, row in verify_columns(index):
        if row is not None:
            want = causal_conv1d_update_ref(t["x"][row : row + 1], t["weight"], expected, torch.tensor([slot]))
            # the same arithmetic; the vectorised SiLU may differ from the one-row one in the last bit
            torch.testing.assert_close(out[row : row + 1], want, rtol=1e-6, atol=1e-6)
        # windows are copies: exact; a padded column repeats the last real window
        assert torch.equal(scratch[s, j], expected[slot])


def test_commit_takes_the_state_after_the_last_accepted_token() -> None:
    conv = torch.zeros(6, K - 1, C)
    ssm = torch.zeros(6, HV, DK, DV)
    ssm[list(SLOTS)] = -7.0  # the live slots as gdn_verify leaves them: the state after the last column
    width = max(LENGTHS)
    scratch_conv = torch.arange(4 * width, dtype=torch.float32).view(4, width, 1, 1).expand(4, width, K - 1, C)
    scratch_ssm = torch.arange(4 * (width - 1), dtype=torch.float32).view(4, width - 1, 1, 1, 1)
    scratch_ssm = scratch_ssm.expand(4, width - 1, HV, DK, DV)
    accepted = torch.tensor([1, 4, 0])  # the state after token 1, 4 (the last column: already live) and 0
    spec_state_commit(conv, ssm, scratch_conv.contiguous(), scratch_ssm.contiguous(),
                      torch.tensor(SLOTS, dtype=torch.int32), accepted, width)  # fmt: skip
    for s, (slot, a) in enumerate(zip(SLOTS, accepted.tolist(), strict=True)):
        assert (conv[slot] == s * width + a).all()
        assert (ssm[slot] == (-7.0 if a == width - 1 else s * (width - 1) + a)).all()
    untouched = [i for i in range(6) if i not in SLOTS]
    assert (conv[untouched] == 0).all() and (ssm[untouched] == 0).all()


def test_commit_of_a_one_column_step_copies_no_recurrent_state() -> None:
    """Width 1 (every chunk a plain decode): gdn_verify wrote the only state into the live slot; the recurrent
    scratch is not read (NaN here), the conv window is copied."""
    conv, ssm = torch.zeros(6, K - 1, C), torch.full((6, HV, DK, DV), 3.0)
    scratch_conv = torch.ones(3, 2, K - 1, C)
    scratch_ssm = torch.full((3, 1, HV, DK, DV), float("nan"))
    spec_state_commit(conv, ssm, scratch_conv, scratch_ssm, torch.tensor(SLOTS, dtype=torch.int32),
                      torch.zeros(3, dtype=torch.int64), 1)  # fmt: skip
    assert (ssm == 3.0).all()
    assert (conv[list(SLOTS)] == 1).all()


PADDED_SLOTS = (3, -1, 0, -1)  # sequences 1 and 3 are CUDA-graph padding (slot -1)
PADDED_LENGTHS = (2, 3, 4, 1)


def _padded_case(dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    t = inputs(dtype)
    n = sum(PADDED_LENGTHS)
    gen = torch.Generator().manual_seed(1)
    for name, shape in (("q", (n, HK, DK)), ("k", (n, HK, DK)), ("v", (n, HV, DV)), ("a", (n, HV)), ("b", (n, HV)),
                        ("x", (n, C))):  # fmt: skip
        t[name] = torch.randn(*shape, generator=gen).to(dtype)
    return t, token_index(PADDED_LENGTHS), torch.tensor(PADDED_SLOTS, dtype=torch.int32)


def _live_only(index: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The step without its padded sequences: their token_index rows and slots dropped."""
    live = [s for s, slot in enumerate(slots.tolist()) if slot >= 0]
    return index[live], slots[live], live


def _padded_rows(index: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    rows = index[slots < 0]
    return rows[rows >= 0]


def test_gdn_verify_skips_a_sequence_with_slot_below_zero() -> None:
    t, index, slots = _padded_case()
    ssm = t["ssm"].clone()
    width = max(PADDED_LENGTHS)
    scratch = torch.full((5, width - 1, HV, DK, DV), float("nan"))
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"])
    out = gdn_verify_ref(*args, ssm, slots, index, scratch)
    assert (out[_padded_rows(index, slots)] == 0).all(), "a padded sequence's rows are zeros"
    assert scratch[: len(slots)][slots < 0].isnan().all(), "a padded sequence writes no scratch"
    live_index, live_slots, live = _live_only(index, slots)
    want_scratch = torch.full_like(scratch, float("nan"))
    want_ssm = t["ssm"].clone()
    want = gdn_verify_ref(*args, want_ssm, live_slots, live_index, want_scratch)
    rows = live_index[live_index >= 0]
    torch.testing.assert_close(out[rows], want[rows], rtol=1e-6, atol=1e-6)  # vectorised SiLU / einsum: last bit
    assert torch.equal(scratch[live], want_scratch[: len(live)])
    assert torch.equal(ssm, want_ssm), "a padded sequence writes no slot; the live ones get their last state"


def test_conv_verify_skips_a_sequence_with_slot_below_zero() -> None:
    t, index, slots = _padded_case()
    conv = t["conv"].clone()
    width = max(PADDED_LENGTHS)
    scratch = torch.full((5, width, K - 1, C), float("nan"))
    out = causal_conv1d_verify_ref(t["x"], t["weight"], conv, slots, index, scratch)
    assert torch.equal(conv, t["conv"])
    assert (out[_padded_rows(index, slots)] == 0).all(), "a padded sequence's rows are zeros"
    assert scratch[: len(slots)][slots < 0].isnan().all(), "a padded sequence writes no scratch"
    live_index, live_slots, live = _live_only(index, slots)
    want_scratch = torch.full_like(scratch, float("nan"))
    want = causal_conv1d_verify_ref(t["x"], t["weight"], conv, live_slots, live_index, want_scratch)
    rows = live_index[live_index >= 0]
    torch.testing.assert_close(out[rows], want[rows], rtol=1e-6, atol=1e-6)  # vectorised SiLU / einsum: last bit
    assert torch.equal(scratch[live], want_scratch[: len(live)])


@pytest.mark.parametrize(
    "slots",
    [(-1, 4, -1, 0), (2, -1, 0, -1), (-1, -1, -1, -1)],
    ids=["padded-first", "padded-after-live", "all-padded"],
)
def test_commit_writes_nothing_for_a_sequence_with_slot_below_zero(slots: tuple[int, ...]) -> None:
    width = max(PADDED_LENGTHS)
    conv = torch.randn(6, K - 1, C)
    ssm = torch.randn(6, HV, DK, DV)
    before_conv, before_ssm = conv.clone(), ssm.clone()
    scratch_conv = torch.arange(5 * width, dtype=torch.float32).view(5, width, 1, 1).expand(5, width, K - 1, C)
    scratch_ssm = torch.arange(5 * (width - 1), dtype=torch.float32).view(5, width - 1, 1, 1, 1)
    scratch_ssm = scratch_ssm.expand(5, width - 1, HV, DK, DV)
    accepted = torch.tensor([1, 2, 3, 0])  # 3 = width - 1: that recurrent state is the live slot's already
    spec_state_commit(conv, ssm, scratch_conv.contiguous(), scratch_ssm.contiguous(),
                      torch.tensor(slots, dtype=torch.int32), accepted, width)  # fmt: skip
    for s, (slot, a) in enumerate(zip(slots, accepted.tolist(), strict=True)):
        if slot >= 0:
            assert (conv[slot] == s * width + a).all()
            want = before_ssm[slot] if a == width - 1 else torch.full_like(ssm[slot], s * (width - 1) + a)
            assert torch.equal(ssm[slot], want)
    untouched = [i for i in range(6) if i not in slots]
    assert torch.equal(conv[untouched], before_conv[untouched]) and torch.equal(ssm[untouched], before_ssm[untouched])
