"""Request timing (gamma gaps rescaled as vLLM does) and the random dataset's lengths, ids and retries."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deltaserve.bench.dataset import (
    Tokenizer,
    allowed_token_ids,
    decode_to_target_len,
    length_bounds,
    sample_random,
)
from deltaserve.bench.traffic import send_offsets


def test_infinite_rate_sends_everything_at_once() -> None:
    assert send_offsets(4, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 4
    assert send_offsets(0, 2.0, 1.0, np.random.default_rng(0)) == []


def test_infinite_burstiness_is_constant_spacing() -> None:
    offsets = send_offsets(5, 2.0, math.inf, np.random.default_rng(0))
    assert offsets == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.5])


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 3.0])
def test_gamma_gaps_are_rescaled_to_end_at_n_over_rate(burstiness: float) -> None:
    offsets = send_offsets(200, 8.0, burstiness, np.random.default_rng(1))
    assert offsets[-1] == pytest.approx(200 / 8.0)
    assert all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    other = send_offsets(200, 8.0, burstiness, np.random.default_rng(2))
    assert other != offsets and other[-1] == pytest.approx(offsets[-1])


def test_burstier_traffic_has_more_variable_gaps() -> None:
    bursty = np.diff(send_offsets(2000, 10.0, 0.25, np.random.default_rng(0)))
    even = np.diff(send_offsets(2000, 10.0, 4.0, np.random.default_rng(0)))
    assert bursty.std() > 2 * even.std()
    with pytest.raises(ValueError):
        send_offsets(3, 1.0, 0.0, np.random.default_rng(0))


def test_length_bounds_follow_vllm_range_ratio() -> None:
    assert length_bounds(1024, 0.0) == (1024, 1024)
    assert length_bounds(100, 0.25) == (75, 125)
    assert length_bounds(3, 0.5, floor_at=1) == (1, 5)
    assert length_bounds(1, 0.9, floor_at=1) == (1, 2)


def test_fixed_lengths_consecutive_ids_and_reproducibility(word_tokenizer: Tokenizer) -> None:
    requests = sample_random(word_tokenizer, 6, input_len=32, output_len=8, seed=3, request_id_prefix="r")
    assert [r.prompt_len for r in requests] == [32] * 6
    assert [r.expected_output_len for r in requests] == [8] * 6
    assert [r.request_id for r in requests] == [f"r{i}" for i in range(6)]
    allowed = allowed_token_ids(word_tokenizer.vocab_size, word_tokenizer.all_special_ids)
    for r in requests:
        ids = word_tokenizer.encode(r.prompt)
        positions = np.searchsorted(allowed, ids)
        # Consecutive allowed ids, wrapping around the allowed vocabulary.
        assert all((b - a) % len(allowed) == 1 for a, b in zip(positions, positions[1:], strict=False))
        assert word_tokenizer.vocab_size - 1 not in ids  # the special id is never sampled
    again = sample_random(word_tokenizer, 6, input_len=32, output_len=8, seed=3, request_id_prefix="r")
    assert [r.prompt for r in again] == [r.prompt for r in requests]
    other = sample_random(word_tokenizer, 6, input_len=32, output_len=8, seed=4)
    assert [r.prompt for r in other] != [r.prompt for r in requests]


def test_ranged_lengths_and_shared_prefix(word_tokenizer: Tokenizer) -> None:
    requests = sample_random(word_tokenizer, 200, input_len=40, output_len=10, range_ratio=0.5, prefix_len=7)
    inputs = [r.prompt_len - 7 for r in requests]
    outputs = [r.expected_output_len for r in requests]
    assert min(inputs) >= 20 and max(inputs) <= 60 and len(set(inputs)) > 10
    assert min(outputs) >= 5 and max(outputs) <= 15
    prefixes = {tuple(word_tokenizer.encode(r.prompt)[:7]) for r in requests}
    assert len(prefixes) == 1
    with pytest.raises(ValueError):
        sample_random(word_tokenizer, 1, range_ratio=1.0)
    with pytest.raises(ValueError):
        sample_random(word_tokenizer, 1, input_len=0, prefix_len=0)


class MergingTokenizer:
    """A lossy tokenizer: decoding glues every pair "a b" to "ab", which re-encodes as one id."""

    vocab_size = 50
    all_special_ids = [0]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"{a}_{b}" if b is not None else f"{a}" for a, b in _pairs(token_ids))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(word.split("_")[0]) for word in text.split()]

    def num_special_tokens_to_add(self) -> int:
        return 0


def _pairs(ids: list[int]) -> list[tuple[int, int | None]]:
    return [(ids[i], ids[i + 1] if i + 1 < len(ids) else None) for i in range(0, len(ids), 2)]


def test_decode_to_target_len_pads_then_gives_up_with_a_mismatch() -> None:
    rng = np.random.default_rng(0)
    prompt, ids, mismatch = decode_to_target_len(MergingTokenizer(), list(range(1, 9)), 8, rng)
    # Every decode halves the ids, so the target is never met: after 10 retries the residual is reported.
    assert mismatch == len(ids) - 8 and mismatch != 0
    assert prompt


def test_decode_to_target_len_truncates_when_too_long(word_tokenizer: Tokenizer) -> None:
    prompt, ids, mismatch = decode_to_target_len(word_tokenizer, list(range(1, 21)), 12, np.random.default_rng(0))
    assert mismatch == 0 and len(ids) == 12 and word_tokenizer.encode(prompt) == ids
