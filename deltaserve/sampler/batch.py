"""Building a SamplingBatch: the host-side facts shared by every builder, and a builder from plain lists.

The runner's request table builds the step's batch from its persistent device tensors (runner/request_table.py);
tests and the start-up warm-up build one from SamplingParams and token lists with `build_sampling_batch`. Both go
through the helpers here, so the two cannot disagree on what a parameter means.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deltaserve.sampler.logits_processors import StaticBias, single_token_bad_words, static_bias_row
from deltaserve.sampler.penalties import PenaltyInputs
from deltaserve.sampler.sampler import NUM_PARAMS, SAMPLING_EPS, SamplingBatch, make_generator, row_seed
from deltaserve.sampler.transfer import to_device
from deltaserve.sampling_params import SamplingParams


def params_row(params: SamplingParams, vocab_size: int) -> list[float]:
    """One row of SamplingBatch.params: top_k 0 / -1 / >= V mean off and are stored as V."""
    top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    return [params.temperature, float(top_k), params.top_p, params.min_p, params.repetition_penalty,
            params.frequency_penalty, params.presence_penalty]  # fmt: skip


def has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def host_flags(values: np.ndarray, vocab_size: int) -> dict[str, int | bool]:
    """values: [B, NUM_PARAMS] on the host -> the SamplingBatch fields the sampler branches on (random rows only
    count for truncation, since a greedy row's argmax ignores it)."""
    is_random = values[:, 0] >= SAMPLING_EPS
    random_values = values[is_random]
    top_k = random_values[:, 1]
    truncating = top_k < vocab_size
    return {
        "num_random": int(is_random.sum()),
        "has_top_k": bool(truncating.any()),
        "max_top_k": int(top_k[truncating].max()) if truncating.any() else vocab_size,
        "has_top_p": bool((random_values[:, 2] < 1.0).any()),
        "has_min_p": bool((random_values[:, 3] > 0.0).any()),
    }


def seeded_generators(
    seeds: Sequence[int | None], token_indices: Sequence[int], is_random: Sequence[bool], device: torch.device
) -> dict[int, torch.Generator]:
    """Row -> the generator of the token it samples now, for seeded random rows."""
    return {
        row: make_generator(row_seed(seed, token_indices[row]), device)
        for row, seed in enumerate(seeds)
        if seed is not None and is_random[row]
    }


def min_tokens_keys(
    stop_ids: Sequence[Sequence[int]], is_under: Sequence[bool], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """Flat row * V + token indices of the stop ids of rows still under min_tokens (out-of-vocab ids dropped)."""
    keys = [
        row * vocab_size + t for row, ids in enumerate(stop_ids) if is_under[row] for t in ids if 0 <= t < vocab_size
    ]
    return to_device(keys, torch.int64, device) if keys else None


def build_sampling_batch(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    stop_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> SamplingBatch:
    """A SamplingBatch from plain per-row data (tests, warm-up). A seeded row samples token index len(outputs)."""
    values = np.array([params_row(p, vocab_size) for p in params], dtype=np.float32).reshape(-1, NUM_PARAMS)
    flags = host_flags(values, vocab_size)
    is_random = [p.temperature >= SAMPLING_EPS for p in params]
    generators = seeded_generators([p.seed for p in params], [len(o) for o in output_token_ids], is_random, device)
    penalty_rows = [row for row, p in enumerate(params) if has_penalty(p)]
    penalties = None
    if penalty_rows:
        counts = torch.zeros(len(penalty_rows), vocab_size, dtype=torch.int32)
        prompt_mask = torch.zeros(len(penalty_rows), vocab_size, dtype=torch.bool)
        for i, row in enumerate(penalty_rows):
            outputs = torch.tensor(list(output_token_ids[row]), dtype=torch.int64)
            counts[i] += torch.bincount(outputs[(outputs >= 0) & (outputs < vocab_size)], minlength=vocab_size).int()
            prompt = torch.tensor(list(prompt_token_ids[row]), dtype=torch.int64)
            prompt_mask[i, prompt[(prompt >= 0) & (prompt < vocab_size)]] = True
        penalties = PenaltyInputs(
            rows=to_device(penalty_rows, torch.int64, device), output_counts=counts.to(device),
            prompt_mask=prompt_mask.to(device),
        )  # fmt: skip
    is_under = [len(o) < p.min_tokens for p, o in zip(params, output_token_ids, strict=True)]
    asked = [p.num_logprobs if p.num_logprobs is not None else -1 for p in params]
    listed = [tuple(p.logprob_token_ids) if p.logprob_token_ids else None for p in params]
    bias_rows = [
        (row, bias)
        for row, p in enumerate(params)
        if (bias := static_bias_row(vocab_size, p.logit_bias, p.allowed_token_ids,
                                    single_token_bad_words(p.bad_words_token_ids))) is not None
    ]  # fmt: skip
    static_bias = None
    if bias_rows:
        static_bias = StaticBias(
            rows=to_device([row for row, _ in bias_rows], torch.int64, device),
            values=to_device(np.stack([bias for _, bias in bias_rows]), torch.float32, device),
        )
    return SamplingBatch(
        params=to_device(values, torch.float32, device),
        generators=generators,
        penalties=penalties,
        min_tokens_keys=min_tokens_keys(stop_token_ids, is_under, vocab_size, device),
        num_logprobs=tuple(asked) if any(n >= 0 for n in asked) else None,
        logprob_ids=tuple(listed) if any(ids is not None for ids in listed) else None,
        static_bias=static_bias,
        **flags,
    )
