"""Sampler semantics on the CPU: greedy, seeded reproducibility, truncation, penalties, min_tokens, logprobs and
sampling statistics, each checked against a hand computation in plain torch. Rows are described as plain data
(RowState) and turned into the sampler's tensors by the same builder the start-up warm-up uses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from deltaserve.sampler import Sampler, build_sampling_batch, logprobs_to_host
from deltaserve.sampler.penalties import apply_penalties, mask_min_tokens
from deltaserve.sampling_params import SamplingParams


@dataclass
class RowState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list | None


def _state(
    prompt: list[int] | None = None, output: list[int] | None = None, eos: tuple[int, ...] = (), **params: object
) -> RowState:
    return RowState(SamplingParams(**params), prompt or [0], output or [], frozenset(eos))


def _batch(states: list[RowState], vocab_size: int, device: str = "cpu"):  # noqa: ANN202 - a SamplingBatch
    stop_ids = [tuple(s.eos_token_ids | set(s.params.stop_token_ids)) for s in states]
    return build_sampling_batch(
        [s.params for s in states], [s.prompt_token_ids for s in states], [s.output_token_ids for s in states],
        stop_ids, vocab_size, torch.device(device),
    )  # fmt: skip


def _sample(sampler: Sampler, logits: torch.Tensor, states: list[RowState]) -> Sampled:
    batch = _batch(states, logits.shape[1], str(logits.device))
    out = sampler(logits, batch)
    token_ids = out.token_ids.tolist()
    if batch.num_logprobs is None:
        return Sampled(token_ids, None)
    per_row = logprobs_to_host(out, token_ids, batch.num_logprobs, logits.shape[1])
    return Sampled(token_ids, [list(entries) if entries is not None else [] for entries in per_row])


def _sample_steps(sampler: Sampler, logits_rows: list[torch.Tensor], states: list[RowState]) -> list[list[int]]:
    """Run len(logits_rows[0]) steps; logits_rows[i][t] is row i's logits at step t. Returns tokens per row."""
    num_steps = logits_rows[0].shape[0]
    tokens: list[list[int]] = [[] for _ in states]
    for step in range(num_steps):
        logits = torch.stack([rows[step] for rows in logits_rows])
        out = _sample(sampler, logits, states)
        for row, token_id in enumerate(out.token_ids):
            tokens[row].append(token_id)
            states[row].output_token_ids.append(token_id)
    return tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000).to(dtype)
    logits[2, 10] = logits[2, 500] = logits[2].max() + 1  # tie: the first maximal index wins
    before = logits.clone()
    out = _sample(Sampler(), logits, [_state(temperature=0.0) for _ in range(6)])
    expected = logits.float().argmax(dim=-1).tolist()
    assert out.token_ids == expected
    assert out.token_ids[2] == 10
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_ignore_sampling_params() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    states = [_state(temperature=0.0, top_k=3), _state(temperature=1.0, seed=1), _state(temperature=0.0), _state()]
    out = _sample(Sampler(), logits, states)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[2] == logits[2].argmax().item()


def test_seeded_rows_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(2)
    num_steps, vocab = 12, 500
    target = torch.randn(num_steps, vocab)
    others = [torch.randn(num_steps, vocab) for _ in range(4)]

    def target_state() -> RowState:
        return _state(prompt=[1, 2, 3], seed=1234, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01)

    alone = _sample_steps(Sampler(seed=0), [target], [target_state()])[0]
    other_states = [_state(seed=7), _state(temperature=0.0), _state(), _state(seed=99, top_p=0.5)]
    in_batch = _sample_steps(
        Sampler(seed=5), [others[0], target, *others[1:]], [other_states[0], target_state()] + other_states[1:]
    )[1]
    other_states = [_state(seed=8), _state(), _state(temperature=0.3), _state(temperature=0.0)]
    reordered = _sample_steps(Sampler(seed=6), [*others, target], [*other_states, target_state()])[-1]
    assert alone == in_batch == reordered
    # seeded draws depend on (seed, token index) only: a resumed row (outputs already there) continues the stream
    state = target_state()
    resumed = _sample_steps(Sampler(), [target[:4]], [state])[0]
    assert resumed + _sample_steps(Sampler(seed=9), [target[4:]], [state])[0] == alone


def test_different_seeds_differ() -> None:
    logits = torch.zeros(30, 1000)  # uniform: 30 draws from 1000 tokens
    first = _sample_steps(Sampler(), [logits], [_state(seed=1)])[0]
    second = _sample_steps(Sampler(), [logits], [_state(seed=2)])[0]
    again = _sample_steps(Sampler(), [logits], [_state(seed=1)])[0]
    assert first != second
    assert first == again


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-9}, {"top_k": 1, "top_p": 0.5}, {"min_p": 1.0}])
def test_degenerate_truncation_is_greedy(params: dict) -> None:
    torch.manual_seed(3)
    logits = torch.randn(16, 2000) * 3
    out = _sample(Sampler(), logits, [_state(temperature=1.5, **params) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_keeps_only_tokens_above_threshold() -> None:
    probs = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08])
    logits = probs.log().expand(4000, -1).contiguous()
    out = _sample(Sampler(), logits, [_state(min_p=0.5) for _ in range(4000)])  # threshold 0.2: tokens 0 and 1
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5)
    assert counts[2:].sum() == 0
    assert abs(counts[0] / 4000 - 0.40 / 0.65) < 0.03


def test_top_k_keeps_ties_and_renormalises() -> None:
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.0]).expand(3000, -1).contiguous()
    out = _sample(Sampler(), logits, [_state(top_k=2) for _ in range(3000)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5)
    assert counts[3:].sum() == 0 and counts[1] > 0 and counts[2] > 0  # the tie at the 2nd value is kept


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    ("params", "keep"),
    [({}, None), ({"temperature": 0.7}, None), ({"top_k": 4, "temperature": 1.3}, 4), ({"top_p": 0.8}, "p")],
)
def test_sampling_matches_softmax(params: dict, keep: int | str | None) -> None:
    """Chi-square over 8 tokens (df <= 7; 99.9% critical value 24.3) with the shared generator, fixed seed."""
    num_samples = 20000
    logits = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, -1.0, 0.8, 1.5])
    expected = (logits / params.get("temperature", 1.0)).softmax(-1)
    order = expected.argsort(descending=True)
    if keep == 4:
        expected[order[4:]] = 0
    elif keep == "p":
        # smallest top set whose mass reaches 0.8
        num_kept = int((expected[order].cumsum(0) < 0.8).sum()) + 1
        expected[order[num_kept:]] = 0
    expected /= expected.sum()
    out = _sample(Sampler(seed=11), logits.expand(num_samples, -1).contiguous(), [_state(**params)] * num_samples)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).float()
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    assert _chi_square(counts[support], expected[support]) < 24.3


def test_seeded_row_sampling_matches_softmax() -> None:
    logits = torch.tensor([[0.5, -0.2, 1.0, 0.0]])
    state = _state(seed=3)
    tokens = []
    sampler = Sampler()
    for _ in range(3000):
        token = _sample(sampler, logits, [state]).token_ids[0]
        tokens.append(token)
        state.output_token_ids.append(token)  # the row's next token index: a fresh draw
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    assert _chi_square(counts, logits[0].softmax(-1)) < 16.3  # df 3, 99.9%


def test_penalties_match_hand_computation() -> None:
    torch.manual_seed(4)
    vocab = 12
    logits = torch.randn(3, vocab) * 2
    states = [
        _state(prompt=[1, 2, 2], output=[2, 5, 5, 5, 7], repetition_penalty=1.5),
        _state(prompt=[0, 3], output=[3, 4, 4], frequency_penalty=0.5, presence_penalty=0.25),
        _state(prompt=[9], output=[9, 10, 10], repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.0),
    ]
    expected = logits.clone()
    for row, state in enumerate(states):
        p = state.params
        seen = set(state.prompt_token_ids) | set(state.output_token_ids)
        for token in seen:
            value = expected[row, token].item()
            expected[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(state.output_token_ids):
            count = state.output_token_ids.count(token)
            expected[row, token] -= p.frequency_penalty * count + p.presence_penalty
    processed = logits.clone()
    batch = _batch(states, vocab)
    apply_penalties(processed, batch.penalties, batch.params)
    torch.testing.assert_close(processed, expected)
    untouched = torch.ones(3, vocab, dtype=torch.bool)
    untouched[0, [1, 2, 5, 7]] = untouched[1, [3, 4]] = untouched[2, [9, 10]] = False
    assert torch.equal(processed[untouched], logits[untouched])


def test_penalties_count_every_output() -> None:
    """Frequency counts are the outputs' bincount, whatever order and repeats they come in."""
    logits = torch.zeros(1, 6)
    for output in ([1, 2], [1, 2, 2, 3], [4]):
        state = _state(output=list(output), frequency_penalty=1.0)
        processed = logits.clone()
        batch = _batch([state], 6)
        apply_penalties(processed, batch.penalties, batch.params)
        expected = -torch.bincount(torch.tensor(output), minlength=6).float().unsqueeze(0)
        assert torch.equal(processed, expected)


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    assert _sample(Sampler(), logits, [_state(prompt=[0], temperature=0.0)]).token_ids == [0]
    assert _sample(Sampler(), logits, [_state(prompt=[0], temperature=0.0, repetition_penalty=1.2)]).token_ids == [1]
    # a negative logit is multiplied: -1.0 * 1.2 < -1.1, so token 3 now beats token 2 among the rest
    processed = logits.clone()
    batch = _batch([_state(prompt=[2], repetition_penalty=1.2)], 4)
    apply_penalties(processed, batch.penalties, batch.params)
    assert processed[0, 2] == pytest.approx(-1.2) and processed[0, 3] == -1.1


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]]).repeat(3, 1)
    states = [
        _state(output=[3], eos=(0,), min_tokens=3, temperature=0.0),
        _state(output=[3], eos=(0,), min_tokens=3, stop_token_ids=[1], temperature=0.0),
        _state(output=[3, 3, 3], eos=(0,), min_tokens=3, stop_token_ids=[1], temperature=0.0),
    ]
    assert _sample(Sampler(), logits, states).token_ids == [1, 2, 0]
    masked = logits.clone()
    batch = _batch([_state(output=[], eos=(0, 99), min_tokens=1, ignore_eos=True)] * 3, 4)
    mask_min_tokens(masked, batch.min_tokens_keys)
    assert torch.isinf(masked[:, 0]).all() and torch.isfinite(masked[:, 1:]).all()


def test_logprobs_rank_and_top_n_from_raw_logits() -> None:
    torch.manual_seed(5)
    logits = torch.randn(4, 50).to(torch.bfloat16)
    logits[3] = torch.linspace(-3, 0, 50).to(torch.bfloat16)
    logits[3, 7] = logits[3, 8] = 1.0  # tie at the top: vLLM's rank counts logprobs >= the sampled one
    states = [
        _state(logprobs=3, temperature=0.0, repetition_penalty=2.0, prompt=list(range(50))),
        _state(),
        _state(logprobs=0, seed=4, temperature=2.0),
        _state(logprobs=5, temperature=0.0),
    ]
    out = _sample(Sampler(), logits, states)
    assert out.logprobs is not None and out.logprobs[1] == []
    raw = logits.float().log_softmax(-1)
    for row in (0, 2, 3):
        entries = out.logprobs[row]
        token_id, logprob, rank = entries[0]
        assert token_id == out.token_ids[row]
        assert logprob == pytest.approx(raw[row, token_id].item(), abs=1e-6)
        assert rank == int((raw[row] >= raw[row, token_id]).sum())
        top = raw[row].topk(states[row].params.logprobs)
        assert [e[0] for e in entries[1:]] == top.indices.tolist()
        assert [e[1] for e in entries[1:]] == pytest.approx(top.values.tolist(), abs=1e-6)
        assert [e[2] for e in entries[1:]] == list(range(1, len(entries)))
    assert len(out.logprobs[2]) == 1
    assert out.logprobs[3][0][0] == 7 and out.logprobs[3][0][2] == 2  # ties count against the sampled token


def test_logprobs_ignore_processing() -> None:
    """Penalties and temperature change the choice, not the reported logprob (vLLM's raw_logprobs mode)."""
    logits = torch.tensor([[3.0, 2.0, -1.0]])
    out = _sample(Sampler(), logits, [_state(prompt=[0], temperature=0.0, repetition_penalty=2.0, logprobs=1)])
    assert out.token_ids == [1]
    assert out.logprobs[0][0][1] == pytest.approx(logits.log_softmax(-1)[0, 1].item())
    assert out.logprobs[0][0][2] == 2


@pytest.mark.gpu
def test_cuda_large_vocab_batch_matches_cpu_semantics() -> None:
    torch.manual_seed(6)
    num_rows, vocab = 512, 248320
    logits = torch.randn(num_rows, vocab, device="cuda").to(torch.bfloat16)
    params = [
        {"temperature": 0.0},
        {"seed": 1, "top_k": 20, "top_p": 0.95},
        {"min_p": 0.05, "repetition_penalty": 1.1, "logprobs": 5},
        {"frequency_penalty": 0.5, "presence_penalty": 0.5, "top_p": 0.9},
    ]
    states = [
        _state(prompt=list(range(row, row + 300)), output=[1, 2, 2], **params[row % 4]) for row in range(num_rows)
    ]
    out = _sample(Sampler(), logits, states)
    assert len(out.token_ids) == num_rows and all(0 <= t < vocab for t in out.token_ids)
    greedy = [row for row in range(num_rows) if row % 4 == 0]
    assert [out.token_ids[row] for row in greedy] == logits[greedy].float().argmax(-1).tolist()
    seeded_alone = _sample(Sampler(), logits[1:2], [_state(prompt=list(range(1, 301)), output=[1, 2, 2], **params[1])])
    assert seeded_alone.token_ids[0] == out.token_ids[1]
    assert not math.isnan(out.logprobs[2][0][1])


def test_top_k_rows_beside_untruncated_rows() -> None:
    """A batch mixing top_k rows and rows without top_k: only the former are truncated (top-k only path)."""
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.5, 0.0]).expand(4000, -1).contiguous()
    states = [_state(top_k=2) if row % 2 == 0 else _state() for row in range(4000)]
    tokens = torch.tensor(_sample(Sampler(seed=3), logits, states).token_ids)
    assert tokens[0::2].max() <= 1
    assert tokens[1::2].max() >= 3  # the untruncated rows reach past the top 2
