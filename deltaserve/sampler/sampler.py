"""The batched sampler: logits [B, V] of one step + a SamplingBatch of tensors -> next token ids (+ logprobs), on
the device, with no host sync (the runner copies the result to the host when it needs it).

Semantics follow vLLM v1's `Sampler`:
  0. a token bitmask (grammars, multi-token bad words: vLLM applies it before the sampler) masks its rows;
  1. logprobs come from those logits (fp32 log_softmax before any other processing);
  2. the static bias (allowed_token_ids, single-token bad_words, logit_bias), min_tokens masks eos +
     stop_token_ids, then repetition, frequency and presence penalties, then forced tokens (a spent thinking budget's
     reasoning end) get vLLM's logit of 1e9;
  3. greedy rows (temperature < 1e-5) take the argmax of the processed logits;
  4. other rows: divide by temperature, min_p, top-k, top-p, then draw argmax(p / q) with q ~ Exp(1).
A seeded row draws q from a generator seeded by (its seed, the index of the token it samples), so its tokens do
not depend on the batch, on async scheduling or on preemptions. Unseeded rows share one generator seeded by the
engine's --seed. Not here: stop checks, detokenization, the per-row state (the runner's request table owns it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.sampler.logits_processors import StaticBias, apply_static_bias, apply_token_bitmask
from deltaserve.sampler.penalties import PenaltyInputs, apply_penalties, mask_min_tokens
from deltaserve.sampler.topk_topp import (
    MAX_TOPK_ONLY,
    apply_min_p,
    apply_top_k_only,
    apply_top_k_top_p,
    random_sample,
)
from deltaserve.sampler.transfer import to_device

# vLLM's _SAMPLING_EPS: below this temperature a request is greedy.
SAMPLING_EPS = 1e-5
# Columns of the per-row parameter tensor [B, NUM_PARAMS] (fp32; top_k is exact in fp32 below 2**24).
TEMPERATURE, TOP_K, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE = range(7)
NUM_PARAMS = 7
_MASK64 = 2**64 - 1
# the logit vLLM gives a forced token (its thinking-budget holder's fill value)
FORCED_LOGIT = 1e9


def row_seed(seed: int, token_index: int) -> int:
    """The generator seed of a seeded request's token_index-th sampled token (a 64-bit mix of both)."""
    return (seed * 0x9E3779B97F4A7C15 + token_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator seeded with `seed`; negative seeds wrap modulo 2**64 as torch.manual_seed does."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _MASK64)
    return generator


@dataclass
class SamplingBatch:
    """The sampling inputs of one step's B rows. Tensors live on the logits' device; the host-side facts (which
    processing any row needs) are decided by whoever builds it, so the sampler never syncs to find out."""

    params: torch.Tensor  # [B, NUM_PARAMS] fp32: temperature, top_k (V = off), top_p, min_p, three penalties
    num_random: int  # rows with temperature >= SAMPLING_EPS
    has_top_k: bool
    max_top_k: int  # largest top_k among truncating rows (vocab size when none)
    has_top_p: bool
    has_min_p: bool
    generators: dict[int, torch.Generator]  # seeded random rows -> the generator of the token they sample now
    penalties: PenaltyInputs | None = None
    min_tokens_keys: torch.Tensor | None = None  # [N] int64 flat row * V + token ids forced to -inf
    num_logprobs: tuple[int, ...] | None = None  # per row: logprobs asked for, -1 for none; None when no row asks
    # per row: the token ids whose logprobs it reports instead of a top-N (logprob_token_ids); None when no row lists
    logprob_ids: tuple[tuple[int, ...] | None, ...] | None = None
    static_bias: StaticBias | None = None  # allowed_token_ids, single-token bad_words, logit_bias
    # history constraints (grammars, multi-token bad words): packed int32 [C, ceil(V / 32)] for batch rows [C]
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None
    # forced tokens (a spent thinking budget's reasoning end): int64 [2, F], batch rows then their tokens
    forced: torch.Tensor | None = None
    # speculative decoding's random rule needs the distributions the rows drew from (sampler/rejection.py)
    keep_probs: bool = False

    @property
    def num_rows(self) -> int:
        return self.params.shape[0]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64 on the device
    # For rows that asked for logprobs (logprob_rows, in order): the sampled token's logprob [L] and rank [L], and
    # the top-N ids and logprobs [L, N] (N = the largest count asked; trimmed per row by the consumer).
    logprob_rows: tuple[int, ...] = ()
    sampled_logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # with SamplingBatch.keep_probs: each row's final distribution [B, V] fp32 (random rows; a greedy row's is not
    # used) and the raw logprobs [L, V] of the rows that asked for logprobs
    probs: torch.Tensor | None = None
    raw_logprobs: torch.Tensor | None = None


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
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        num_rows, vocab_size = logits.shape
        if batch.num_rows != num_rows:
            raise ValueError(f"got {num_rows} rows of logits for {batch.num_rows} sampling rows")
        if batch.token_bitmask is not None:
            # the caller's logits stay untouched (they may be a CUDA graph's buffer or a scorer's)
            logits = logits.to(torch.float32, copy=True)
            apply_token_bitmask(logits, batch.bitmask_rows, batch.token_bitmask)
        logprob_rows = tuple(r for r, n in enumerate(batch.num_logprobs or ()) if n >= 0)
        raw_logprobs = logprob_index = None
        if logprob_rows:
            rows = logits
            if len(logprob_rows) < num_rows:
                logprob_index = to_device(list(logprob_rows), torch.int64, logits.device)
                rows = logits.index_select(0, logprob_index)
            raw_logprobs = rows.log_softmax(dim=-1, dtype=torch.float32)  # [L, V]

        processed = logits
        has_processing = batch.min_tokens_keys is not None or batch.penalties is not None or batch.forced is not None
        if batch.num_random or has_processing or batch.static_bias is not None:
            # our own fp32 copy: everything below edits in place and the caller's logits stay untouched
            processed = logits.to(torch.float32, copy=True)
            if batch.static_bias is not None:
                apply_static_bias(processed, batch.static_bias)
            if batch.min_tokens_keys is not None:
                mask_min_tokens(processed, batch.min_tokens_keys)
            if batch.penalties is not None:
                apply_penalties(processed, batch.penalties, batch.params)
            if batch.forced is not None:
                # vLLM's force (ThinkingBudgetStateHolder): the token's logit becomes FORCED_LOGIT after the
                # penalties, so it wins greedy and random draws alike and the logprobs above stay the model's
                processed[batch.forced[0], batch.forced[1]] = FORCED_LOGIT

        kept: list[torch.Tensor] = []
        if batch.num_random == 0:
            token_ids = processed.argmax(dim=-1)  # [B]; first maximal index on ties
        elif batch.num_random == num_rows:
            token_ids = self._sample_random(processed, batch, kept)
        else:
            is_greedy = batch.params[:, TEMPERATURE] < SAMPLING_EPS  # [B]
            greedy_ids = processed.argmax(dim=-1)
            token_ids = torch.where(is_greedy, greedy_ids, self._sample_random(processed, batch, kept))
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            self._add_logprobs(out, raw_logprobs, logprob_rows, logprob_index, batch.num_logprobs or (),
                               batch.logprob_ids)  # fmt: skip
        if batch.keep_probs:
            out.probs = kept[0] if kept else None
            out.raw_logprobs = raw_logprobs
        return out

    def _sample_random(
        self, logits: torch.Tensor, batch: SamplingBatch, kept: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Temperature, min_p, top-k, top-p, then sampling over every row (the caller keeps greedy rows' argmax).
        logits: [B, V] fp32, edited in place. With batch.keep_probs the distribution drawn from joins `kept`."""
        vocab_size = logits.shape[1]
        params = batch.params
        temperature = params[:, TEMPERATURE]
        # greedy rows divide by 1: their draw is discarded, and a zero would turn the row into NaNs
        logits.div_(torch.where(temperature < SAMPLING_EPS, 1.0, temperature).unsqueeze(1))
        if batch.has_min_p:
            apply_min_p(logits, params[:, MIN_P])
        if batch.has_top_k or batch.has_top_p:
            top_k = params[:, TOP_K].to(torch.int64).clamp_(1, vocab_size) if batch.has_top_k else None
            if not batch.has_top_p and batch.max_top_k <= MAX_TOPK_ONLY:
                apply_top_k_only(logits, top_k, batch.max_top_k)
            else:
                apply_top_k_top_p(logits, top_k, params[:, TOP_P] if batch.has_top_p else None)
        probs = logits.softmax(dim=-1)  # [B, V] fp32
        if batch.keep_probs and kept is not None:
            kept.append(probs.clone())  # random_sample consumes its input
        return random_sample(probs, self._shared_generator(logits.device), batch.generators)

    @staticmethod
    def _add_logprobs(
        out: SamplerOutput,
        raw_logprobs: torch.Tensor,
        rows: tuple[int, ...],
        index: torch.Tensor | None,
        num_logprobs: tuple[int, ...],
        listed: tuple[tuple[int, ...] | None, ...] | None = None,
    ) -> None:
        """Sampled-token logprob and rank (vLLM: the count of logprobs >= its own) plus the top-N, or, for a row
        that lists token ids (logprob_token_ids), those ids' logprobs in its top-N columns, as vLLM's sampler
        gathers them. index: the rows' indices on the device, None when every row asked."""
        sampled = out.token_ids if index is None else out.token_ids.index_select(0, index)
        sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [L, 1]
        out.logprob_rows = rows
        out.sampled_logprobs = sampled_logprobs.squeeze(1)
        out.sampled_ranks = (raw_logprobs >= sampled_logprobs).sum(dim=-1)
        max_num = min(max(num_logprobs[r] for r in rows), raw_logprobs.shape[1])
        if max_num > 0:
            out.top_logprobs, out.top_ids = raw_logprobs.topk(max_num, dim=-1)  # [L, N] each
        lists = [(i, listed[r]) for i, r in enumerate(rows) if listed is not None and listed[r]]
        if lists and max_num > 0:
            ids = torch.zeros(len(lists), max_num, dtype=torch.int64)  # padded; the consumer reads num_logprobs
            for j, (_, row_ids) in enumerate(lists):
                ids[j, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.int64)
            at = to_device([i for i, _ in lists], torch.int64, raw_logprobs.device)
            ids = ids.to(raw_logprobs.device)
            out.top_ids = out.top_ids.index_copy(0, at, ids)
            out.top_logprobs = out.top_logprobs.index_copy(0, at, raw_logprobs.index_select(0, at).gather(1, ids))


def logprobs_to_host(
    out: SamplerOutput, token_ids: list[int], num_logprobs: tuple[int, ...], vocab_size: int
) -> list[tuple[tuple[int, float, int], ...] | None]:
    """Per row: ((token, logprob, rank) of the sampled token, then the top-N with ranks 1..N), None where not asked.
    Call after the copies to the host finished (the tensors may be host copies of SamplerOutput's)."""
    result: list[tuple[tuple[int, float, int], ...] | None] = [None] * len(token_ids)
    if not out.logprob_rows:
        return result
    sampled_lp = out.sampled_logprobs.tolist()
    ranks = out.sampled_ranks.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    for i, row in enumerate(out.logprob_rows):
        entries = [(token_ids[row], sampled_lp[i], int(ranks[i]))]
        for j in range(min(num_logprobs[row], vocab_size)):
            entries.append((int(top_ids[i][j]), top_lp[i][j], j + 1))
        result[row] = tuple(entries)
    return result
