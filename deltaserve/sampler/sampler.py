"""The batched sampler: logits [B, V] of one step + per-sequence sampling state -> one token id per row (+ logprobs).

Semantics follow vLLM v1's `Sampler`:
  1. logprobs come from the raw logits (fp32 log_softmax before any processing);
  2. min_tokens masks eos + stop_token_ids, then repetition, frequency and presence penalties;
  3. greedy rows (temperature < 1e-5) take the argmax of the processed logits;
  4. other rows: divide by temperature, min_p, top-k, top-p, then draw argmax(p / q) with q ~ Exp(1).
A seeded row draws q only from its own generator, so it samples the same tokens whatever the batch holds.
Everything is batched torch; the only host sync is the final `.tolist()`. Not here: stop checks, detokenization.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deltaserve.sampler.penalties import apply_penalties, has_penalties, mask_min_tokens
from deltaserve.sampler.topk_topp import (
    MAX_TOPK_ONLY,
    apply_min_p,
    apply_top_k_only,
    apply_top_k_top_p,
    random_sample,
)
from deltaserve.sampler.transfer import to_device
from deltaserve.sampling_params import SamplingParams

# vLLM's _SAMPLING_EPS: below this temperature a request is greedy.
SAMPLING_EPS = 1e-5


@dataclass
class SequenceSamplingState:
    """One running sequence as the sampler sees it; the engine keeps one per sequence and appends outputs."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # The model's eos ids. The sampler uses them only to mask eos while len(output) < min_tokens, which vLLM does
    # even with ignore_eos, so pass them regardless; stopping on eos is the engine's job.
    eos_token_ids: frozenset[int] = frozenset()
    # Made by make_generator(params.seed, device); created lazily by the sampler when left None for a seeded request.
    generator: torch.Generator | None = None
    # Caches of the penalties: distinct prompt ids on the logits' device, output ids as a growing int64 buffer.
    prompt_token_set: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    output_id_buffer: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    num_buffered_output_ids: int = field(default=0, init=False, repr=False, compare=False)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: [(token_id, logprob, rank)], the sampled token first, then the top-N with ranks 1..N (N =
    # params.logprobs); an empty list for rows that did not ask. None when no row asked.
    logprobs: list[list[tuple[int, float, int]]] | None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's private generator; negative seeds wrap modulo 2**64 as torch.manual_seed does."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _rows_view(x: torch.Tensor, rows: list[int], num_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x itself when `rows` is every row, else a copy of those rows plus their index tensor."""
    if len(rows) == num_rows:
        return x, None
    index = to_device(rows, torch.int64, x.device)
    return x.index_select(0, index), index


class Sampler:
    """Stateless apart from the generator that unseeded rows share (one per device, seeded by the engine seed)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = make_generator(self.seed, device)
        return generator

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> SamplerOutput:
        num_rows, vocab_size = logits.shape
        if len(states) != num_rows:
            raise ValueError(f"got {num_rows} rows of logits for {len(states)} sequences")
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=None)
        logprob_rows = [row for row, s in enumerate(states) if s.params.logprobs is not None]
        random_rows = [row for row, s in enumerate(states) if s.params.temperature >= SAMPLING_EPS]
        has_min_tokens = any(len(s.output_token_ids) < s.params.min_tokens for s in states)
        has_any_penalty = any(has_penalties(s) for s in states)

        raw_logprobs = None
        if logprob_rows:
            raw_logits, _ = _rows_view(logits, logprob_rows, num_rows)
            raw_logprobs = raw_logits.log_softmax(dim=-1, dtype=torch.float32)  # [L, V]

        processed = logits
        if random_rows or has_min_tokens or has_any_penalty:
            # our own fp32 copy: everything below edits in place and the caller's logits stay untouched
            processed = logits.to(torch.float32, copy=True)
            if has_min_tokens:
                mask_min_tokens(processed, states)
            if has_any_penalty:
                apply_penalties(processed, states)

        if len(random_rows) < num_rows:
            token_ids = processed.argmax(dim=-1)  # [B]; first maximal index on ties
            if random_rows:
                random_logits, index = _rows_view(processed, random_rows, num_rows)
                token_ids.index_copy_(0, index, self._sample_random(random_logits, [states[r] for r in random_rows]))
        else:
            token_ids = self._sample_random(processed, states)

        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids.tolist(), logprobs=None)
        return self._with_logprobs(token_ids, raw_logprobs, logprob_rows, states)

    def _sample_random(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
        """Temperature, min_p, top-k, top-p, then sampling, for rows that are all non-greedy. logits: [R, V] fp32."""
        num_rows, vocab_size = logits.shape
        device = logits.device
        params = [s.params for s in states]
        if any(p.temperature != 1.0 for p in params):
            logits.div_(to_device([p.temperature for p in params], torch.float32, device).unsqueeze(1))

        min_p_rows = [row for row, p in enumerate(params) if p.min_p > 0.0]
        if min_p_rows:
            sub, index = _rows_view(logits, min_p_rows, num_rows)
            apply_min_p(sub, to_device([params[r].min_p for r in min_p_rows], torch.float32, device))
            if index is not None:
                logits.index_copy_(0, index, sub)

        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        truncated_rows = [row for row, p in enumerate(params) if top_ks[row] < vocab_size or p.top_p < 1.0]
        if truncated_rows:
            sub, index = _rows_view(logits, truncated_rows, num_rows)
            sub_top_ks = [top_ks[r] for r in truncated_rows]
            max_top_k = max(sub_top_ks)
            has_top_p = any(params[r].top_p < 1.0 for r in truncated_rows)
            top_k = to_device(sub_top_ks, torch.int64, device)
            if not has_top_p and max_top_k <= MAX_TOPK_ONLY:
                apply_top_k_only(sub, top_k, max_top_k)
            else:
                top_p = (
                    to_device([params[r].top_p for r in truncated_rows], torch.float32, device) if has_top_p else None
                )
                apply_top_k_top_p(sub, top_k if min(sub_top_ks) < vocab_size else None, top_p)
            if index is not None:
                logits.index_copy_(0, index, sub)

        row_generators: dict[int, torch.Generator] = {}
        for row, state in enumerate(states):
            if state.params.seed is None:
                continue
            if state.generator is None or state.generator.device.type != device.type:
                state.generator = make_generator(state.params.seed, device)
            row_generators[row] = state.generator
        probs = logits.softmax(dim=-1)  # [R, V] fp32
        return random_sample(probs, self._shared_generator(device), row_generators)

    def _with_logprobs(
        self,
        token_ids: torch.Tensor,
        raw_logprobs: torch.Tensor,
        logprob_rows: list[int],
        states: list[SequenceSamplingState],
    ) -> SamplerOutput:
        """Sampled-token logprob and rank (vLLM: count of logprobs >= its own) plus the top-N, in one transfer."""
        num_rows = token_ids.shape[0]
        vocab_size = raw_logprobs.shape[1]
        num_logprobs = [min(states[r].params.logprobs, vocab_size) for r in logprob_rows]
        max_num_logprobs = max(num_logprobs)
        sampled, _ = _rows_view(token_ids, logprob_rows, num_rows)
        sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [L, 1]
        ranks = (raw_logprobs >= sampled_logprobs).sum(dim=-1)  # [L]
        parts = [token_ids, sampled_logprobs.squeeze(1), ranks]
        if max_num_logprobs > 0:
            top_logprobs, top_ids = raw_logprobs.topk(max_num_logprobs, dim=-1)  # [L, N] each
            parts += [top_ids.flatten(), top_logprobs.flatten()]
        # one float64 tensor holds ids, ranks (exact below 2**53) and fp32 logprobs (exact), so one copy to host
        values = torch.cat([p.to(torch.float64) for p in parts]).tolist()

        num_lp_rows = len(logprob_rows)
        sampled_lp = values[num_rows : num_rows + num_lp_rows]
        rank_values = values[num_rows + num_lp_rows : num_rows + 2 * num_lp_rows]
        top_start = num_rows + 2 * num_lp_rows
        top_size = num_lp_rows * max_num_logprobs
        logprobs: list[list[tuple[int, float, int]]] = [[] for _ in range(num_rows)]
        for i, row in enumerate(logprob_rows):
            entries = [(int(values[row]), sampled_lp[i], int(rank_values[i]))]
            base = i * max_num_logprobs
            for j in range(num_logprobs[i]):
                top_id = int(values[top_start + base + j])
                entries.append((top_id, values[top_start + top_size + base + j], j + 1))
            logprobs[row] = entries
        return SamplerOutput(token_ids=[int(v) for v in values[:num_rows]], logprobs=logprobs)
