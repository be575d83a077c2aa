"""The verify-step GDN ops (kernels/gdn_spec.py) against the one-token decode ops run token by token: outputs, the
conv window after every token in scratch, each token's delta-rule inputs in the row scratch, the live slots
untouched until the commit, and the commit: the conv window of the last accepted token, and the recurrent state
after replaying the accepted tokens, bit-equal to the state the verify op held after that token."""

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
from deltaserve.kernels.gdn_spec import verify_row_width

HK, HV, DK, DV, C, K = 2, 4, 8, 8, 12, 4
R = verify_row_width(HK, DK, HV, DV)
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


def _states_after_each_token(t: dict[str, torch.Tensor], index: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """(sequence, column) -> its slot's state after that column, by gdn_decode_ref one token at a time (a padded
    column: the last real state)."""
    ssm = t["ssm"].clone()
    states = {}
    for s, slot, j, row in verify_columns(index):
        if row is not None:
            one = slice(row, row + 1)
            gdn_decode_ref(t["q"][one], t["k"][one], t["v"][one], t["a"][one], t["b"][one], t["A_log"], t["dt_bias"],
                           ssm, torch.tensor([slot]))  # fmt: skip
        states[s, j] = ssm[slot].clone()
    return states


def test_gdn_verify_equals_decode_token_by_token() -> None:
    t = inputs()
    index = token_index(LENGTHS)
    width = max(LENGTHS)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    ssm = t["ssm"].clone()
    scratch = torch.full((4, width, R), float("nan"))
    out = torch.full_like(t["v"], float("nan"))  # poisoned: every row must be written
    gdn_verify_ref(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], ssm, slots, index, scratch, out)
    assert not out.isnan().any()
    assert torch.equal(ssm, t["ssm"]), "the live slots are read only"
    expected_ssm = t["ssm"].clone()
    for s, slot, j, row in verify_columns(index):
        if row is None:
            assert scratch[s, j].isnan().all(), "a padded column stores no row"
            continue
        one = slice(row, row + 1)
        want = gdn_decode_ref(t["q"][one], t["k"][one], t["v"][one], t["a"][one], t["b"][one], t["A_log"],
                              t["dt_bias"], expected_ssm, torch.tensor([slot]))  # fmt: skip
        torch.testing.assert_close(out[one], want, rtol=1e-6, atol=1e-6)
        # the row: the token's k, v, a and b exactly as given
        packed = torch.cat([t["k"][row].flatten(), t["v"][row].flatten(), t["a"][row], t["b"][row]])
        assert torch.equal(scratch[s, j], packed)
    assert scratch[len(SLOTS) :].isnan().all()


@pytest.mark.parametrize("accepted", [(1, 4, 0), (0, 0, 0), (1, 2, 0), (1, 3, 0)])
def test_commit_replays_the_accepted_tokens_to_the_verify_state(accepted: tuple[int, ...]) -> None:
    """After the verify, the commit's recurrent state is the state after token a_s (gdn_decode_ref token by token),
    whatever the step's width and the other sequences; the conv window is scratch entry a_s."""
    t = inputs()
    index = token_index(LENGTHS)
    width = max(LENGTHS)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    ssm = t["ssm"].clone()
    conv = t["conv"].clone()
    scratch_rows = torch.full((4, width, R), float("nan"))
    scratch_conv = torch.randn(4, width, K - 1, C)
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"])
    gdn_verify_ref(*args, ssm, slots, index, scratch_rows)
    spec_state_commit(conv, ssm, scratch_conv, scratch_rows, t["A_log"], t["dt_bias"], slots,
                      torch.tensor(accepted), width)  # fmt: skip
    decoded = _states_after_each_token(t, index)
    for s, (slot, a) in enumerate(zip(SLOTS, accepted, strict=True)):
        torch.testing.assert_close(ssm[slot], decoded[s, a], rtol=1e-6, atol=1e-6)
        assert torch.equal(conv[slot], scratch_conv[s, a])
        # the sequence committed alone, with a step as wide as its accepted run: the same bits
        replay = t["ssm"].clone()
        spec_state_commit(torch.zeros(6, K - 1, C), replay, scratch_conv[s : s + 1], scratch_rows[s : s + 1],
                          t["A_log"], t["dt_bias"], slots[s : s + 1], torch.tensor([a]), a + 1)  # fmt: skip
        assert torch.equal(replay[slot], ssm[slot])
    untouched = [i for i in range(6) if i not in SLOTS]
    assert torch.equal(ssm[untouched], t["ssm"][untouched])


def test_commit_replay_is_bit_equal_to_the_verify_twin_state() -> None:
    """The replay's state after each token against the verify twin's running state: the twin's output for token j
    is its state after j contracted with q̂_j, so a replay to j and the same contraction give the same bits."""
    t = inputs()
    index = token_index(LENGTHS)
    width = max(LENGTHS)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    scratch_rows = torch.full((4, width, R), float("nan"))
    out = gdn_verify_ref(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], t["ssm"].clone(), slots,
                         index, scratch_rows)  # fmt: skip
    group = HV // HK
    for s, slot, j, row in verify_columns(index):
        if row is None:
            continue
        replay = t["ssm"].clone()
        spec_state_commit(torch.zeros(6, K - 1, C), replay, torch.zeros(4, width, K - 1, C), scratch_rows,
                          t["A_log"], t["dt_bias"], slots, torch.full((3,), j), width)  # fmt: skip
        q = t["q"][row : row + 1].float()
        q_hat = (q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, dim=1) * DK**-0.5
        o = torch.einsum("shkv,shk->shv", replay[slot][None], q_hat)
        assert torch.equal(o.to(out.dtype), out[row : row + 1]), (s, j)


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


def test_commit_of_a_one_column_step_replays_its_token() -> None:
    """Width 1 (every chunk a plain decode): the verify left the live slot alone; the commit replays the one token."""
    t = inputs()
    index = token_index((1, 1, 1))
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    ssm, conv = t["ssm"].clone(), torch.zeros(6, K - 1, C)
    rows = torch.full((3, 1, R), float("nan"))
    gdn_verify_ref(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], ssm, slots, index, rows)
    assert torch.equal(ssm, t["ssm"])
    spec_state_commit(conv, ssm, torch.ones(3, 2, K - 1, C), rows, t["A_log"], t["dt_bias"], slots,
                      torch.zeros(3, dtype=torch.int64), 1)  # fmt: skip
    want = t["ssm"].clone()
    gdn_decode_ref(t["q"][:3], t["k"][:3], t["v"][:3], t["a"][:3], t["b"][:3], t["A_log"], t["dt_bias"], want, slots)
    torch.testing.assert_close(ssm, want, rtol=1e-6, atol=1e-6)
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
    scratch = torch.full((5, width, R), float("nan"))
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"])
    out = gdn_verify_ref(*args, ssm, slots, index, scratch)
    assert (out[_padded_rows(index, slots)] == 0).all(), "a padded sequence's rows are zeros"
    assert scratch[: len(slots)][slots < 0].isnan().all(), "a padded sequence writes no scratch"
    live_index, live_slots, live = _live_only(index, slots)
    want_scratch = torch.full_like(scratch, float("nan"))
    want = gdn_verify_ref(*args, t["ssm"].clone(), live_slots, live_index, want_scratch)
    rows = live_index[live_index >= 0]
    torch.testing.assert_close(out[rows], want[rows], rtol=1e-6, atol=1e-6)  # vectorised SiLU / einsum: last bit
    assert torch.equal(scratch[live].nan_to_num(), want_scratch[: len(live)].nan_to_num())
    assert torch.equal(scratch[live].isnan(), want_scratch[: len(live)].isnan())
    assert torch.equal(ssm, t["ssm"]), "no slot is written by the verify"


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
    t, index, _ = _padded_case()
    width = max(PADDED_LENGTHS)
    index = token_index((width,) * 4)  # every column real: each live sequence replays its accepted tokens
    rows = torch.full((5, width, R), float("nan"))
    live_slots = torch.tensor([slot if slot >= 0 else 5 for slot in slots], dtype=torch.int32)
    n = 4 * width
    gen = torch.Generator().manual_seed(2)
    args = [torch.randn(n, *shape, generator=gen) for shape in ((HK, DK), (HK, DK), (HV, DV), (HV,), (HV,))]
    gdn_verify_ref(*args, t["A_log"], t["dt_bias"], torch.randn(6, HV, DK, DV), live_slots, index, rows)
    conv = torch.randn(6, K - 1, C)
    ssm = torch.randn(6, HV, DK, DV)
    before_conv, before_ssm = conv.clone(), ssm.clone()
    scratch_conv = torch.arange(5 * width, dtype=torch.float32).view(5, width, 1, 1).expand(5, width, K - 1, C)
    accepted = torch.tensor([1, 2, 3, 0])
    spec_state_commit(conv, ssm, scratch_conv.contiguous(), rows, t["A_log"], t["dt_bias"],
                      torch.tensor(slots, dtype=torch.int32), accepted, width)  # fmt: skip
    for s, (slot, a) in enumerate(zip(slots, accepted.tolist(), strict=True)):
        if slot >= 0:
            assert (conv[slot] == s * width + a).all()
            want = before_ssm.clone()
            spec_state_commit(torch.zeros(6, K - 1, C), want, scratch_conv.contiguous()[s : s + 1], rows[s : s + 1],
                              t["A_log"], t["dt_bias"], torch.tensor([slot], dtype=torch.int32), torch.tensor([a]),
                              width)  # fmt: skip
            assert torch.equal(ssm[slot], want[slot]) and not torch.equal(ssm[slot], before_ssm[slot])
    untouched = [i for i in range(6) if i not in slots]
    assert torch.equal(conv[untouched], before_conv[untouched]) and torch.equal(ssm[untouched], before_ssm[untouched])
