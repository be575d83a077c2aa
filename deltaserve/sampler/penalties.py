"""Logit processors that look at token history: repetition/frequency/presence penalties and min_tokens masking.

Both edit fp32 logits [B, V] in place, as vLLM v1's `apply_all_penalties` and `MinTokensLogitsProcessor` do, but
sparsely: only the (row, token) entries that occur in a prompt or an output are touched, so no dense [B, V] count
tensor is built. Not here: sampling, temperature, top-k/top-p (see `topk_topp.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from deltaserve.sampler.transfer import to_device

if TYPE_CHECKING:
    from deltaserve.sampler.sampler import SequenceSamplingState


def mask_min_tokens(logits: torch.Tensor, states: list[SequenceSamplingState]) -> None:
    """While a row has fewer than min_tokens outputs, its eos ids and stop_token_ids get -inf."""
    num_rows, vocab_size = logits.shape
    keys: list[int] = []
    for row, state in enumerate(states):
        if len(state.output_token_ids) >= state.params.min_tokens:
            continue
        # vLLM masks every stop token id (eos included) even when ignore_eos is set; out-of-vocab ids cannot be hit
        stop_ids = state.eos_token_ids.union(state.params.stop_token_ids)
        keys.extend(row * vocab_size + token_id for token_id in stop_ids if 0 <= token_id < vocab_size)
    if keys:
        logits.view(-1).index_fill_(0, to_device(keys, torch.int64, logits.device), float("-inf"))


def has_penalties(state: SequenceSamplingState) -> bool:
    params = state.params
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _prompt_token_set(state: SequenceSamplingState, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The distinct in-vocabulary prompt ids of a sequence, cached on its state (the prompt never changes)."""
    cached = state.prompt_token_set
    if cached is None or cached.device.type != device.type:
        unique_ids = np.unique(np.asarray(state.prompt_token_ids, dtype=np.int64))
        unique_ids = unique_ids[(unique_ids >= 0) & (unique_ids < vocab_size)]
        cached = to_device(unique_ids, torch.int64, device)
        state.prompt_token_set = cached
    return cached


def _output_array(state: SequenceSamplingState) -> np.ndarray:
    """state.output_token_ids as int64, kept in a growing buffer on the state so a step copies only the new ids.

    output_token_ids is append-only; if it got shorter the buffer is rebuilt.
    """
    token_ids = state.output_token_ids
    num_ids = len(token_ids)
    buffer = state.output_id_buffer
    num_buffered = state.num_buffered_output_ids if num_ids >= state.num_buffered_output_ids else 0
    if buffer is None or len(buffer) < num_ids:
        grown = np.empty(max(64, 2 * num_ids), dtype=np.int64)
        if buffer is not None:
            grown[:num_buffered] = buffer[:num_buffered]
        buffer = state.output_id_buffer = grown
    if num_ids > num_buffered:
        buffer[num_buffered:num_ids] = token_ids[num_buffered:]
    state.num_buffered_output_ids = num_ids
    return buffer[:num_ids]


def _output_keys(
    states: list[SequenceSamplingState], rows: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Flat indices row * V + token of every output token of `rows`, repeats kept (they are the counts)."""
    arrays = [_output_array(states[row]) for row in rows]
    offsets = np.repeat(np.asarray(rows, dtype=np.int64) * vocab_size, [len(a) for a in arrays])
    return to_device(np.concatenate(arrays) + offsets, torch.int64, device)


def apply_penalties(logits: torch.Tensor, states: list[SequenceSamplingState]) -> None:
    """vLLM's order: repetition (prompt + output tokens), then frequency and presence (output tokens only)."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    flat_logits = logits.view(-1)
    repetition_rows = [row for row, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    frequency_rows = [
        row for row, s in enumerate(states) if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0
    ]

    if repetition_rows:
        prompt_sets = [_prompt_token_set(states[row], vocab_size, device) for row in repetition_rows]
        prompt_lens = [t.numel() for t in prompt_sets]
        row_offsets = to_device([row * vocab_size for row in repetition_rows], torch.int64, device)
        prompt_keys = torch.cat(prompt_sets) + torch.repeat_interleave(
            row_offsets, to_device(prompt_lens, torch.int64, device), output_size=sum(prompt_lens)
        )
        output_keys = _output_keys(states, repetition_rows, vocab_size, device)
        keys = torch.cat([prompt_keys, output_keys])  # [N] with repeats; every repeat writes the same value
        penalties = to_device([s.params.repetition_penalty for s in states], torch.float32, device)
        row_penalty = penalties[keys // vocab_size]  # [N]
        values = flat_logits[keys]
        flat_logits[keys] = torch.where(values > 0, values / row_penalty, values * row_penalty)

    if frequency_rows:
        if frequency_rows == repetition_rows:
            keys = output_keys
        else:
            keys = _output_keys(states, frequency_rows, vocab_size, device)
        # each key's number of occurrences, by binary search in the sorted keys (no host sync; order is irrelevant)
        keys = torch.sort(keys).values  # [N]
        counts = torch.searchsorted(keys, keys, right=True) - torch.searchsorted(keys, keys)
        rows = keys // vocab_size
        frequency = to_device([s.params.frequency_penalty for s in states], torch.float32, device)[rows]
        presence = to_device([s.params.presence_penalty for s in states], torch.float32, device)[rows]
        values = flat_logits[keys]
        flat_logits[keys] = values - frequency * counts.to(torch.float32) - presence
