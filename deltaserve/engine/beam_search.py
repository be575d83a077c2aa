"""Beam search's rules, shared by the server (/v1/completions `use_beam_search`, api/beam_search.py) and the offline
LLM.beam_search (engine/offline_beam.py), as vLLM 0.26 runs them; neither the engine nor a model is touched here.

A step gives every live beam the engine's logprobs of its next token (max_tokens 1, logprobs 2 * width, the
params' temperature): `expand_beams` extends each beam by each candidate, adding the candidate's logprob to the
beam's cumulative logprob. A candidate that is eos (eos_token_id None: ignore_eos) completes its beam; the others
are ranked by score and the best `width` live on. `best_beams` ranks the completed and the live ones once the
steps are done. vLLM's score (get_beam_search_score) is cumulative_logprob / L ** length_penalty, where L counts
the prompt's tokens and the beam's, less a final eos (the tokenizer's eos, even under ignore_eos, as vLLM has it).

BeamSearchSequence and BeamSearchOutput are the offline API's results, with vLLM's field names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from deltaserve.engine.request import Logprob


@dataclass
class Beam:
    tokens: list[int]  # the prompt's, then the beam's
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per step: the candidates the engine reported
    finish_reason: str | None = None
    stop_reason: int | None = None


def beam_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the length counts the prompt too, and not a final eos. Total for any finite
    length_penalty: where length ** length_penalty overflows (a penalty of 1e308) or underflows to 0 (-1e308), the
    score is the quotient's limit, where Python's float raised (an OverflowError, a ZeroDivisionError: a 500)."""
    length = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        length -= 1
    try:
        denominator = length**length_penalty
    except OverflowError:
        denominator = math.inf
    if denominator == 0.0:
        return -math.inf if cumulative_logprob < 0.0 else 0.0
    return cumulative_logprob / denominator


def beam_width_error(width: int, max_logprobs: int) -> str | None:
    """vLLM's words for a width whose 2 * width logprobs per step pass the logprobs cap (max_logprobs with -1
    already resolved to the vocabulary); None when the width fits."""
    if 2 * width > max_logprobs:
        return f"Requested sample logprobs of {2 * width}, which is greater than max allowed: {max_logprobs}"
    return None


def expand_beams(
    beams: list[Beam],
    step_logprobs: list[dict[int, Logprob]],
    width: int,
    eos_token_id: int | None,
    keep_eos: bool,
    score_eos_token_id: int | None,
    length_penalty: float,
) -> tuple[list[Beam], list[Beam]]:
    """One step: (the best `width` extensions of `beams`, best first; the beams an eos candidate completed, in
    candidate order). step_logprobs[i]: beam i's candidates (token id -> Logprob). eos_token_id: the token that
    completes a beam (None under ignore_eos); keep_eos: whether that eos stays in the completed beam's tokens.
    score_eos_token_id: the eos the score leaves out of the length (the tokenizer's, even under ignore_eos)."""
    candidates: list[Beam] = []
    finished: list[Beam] = []
    for beam, entries in zip(beams, step_logprobs, strict=True):
        for token_id, entry in entries.items():
            extended = Beam(beam.tokens + [token_id], beam.cumulative_logprob + entry.logprob,
                            beam.logprobs + [entries])  # fmt: skip
            if token_id == eos_token_id:
                if not keep_eos:
                    extended.tokens.pop()
                extended.finish_reason, extended.stop_reason = "stop", token_id
                finished.append(extended)
            else:
                candidates.append(extended)
    live = sorted(candidates, key=lambda b: _score(b, score_eos_token_id, length_penalty), reverse=True)
    return live[:width], finished


def best_beams(
    finished: list[Beam], live: list[Beam], width: int, score_eos_token_id: int | None, length_penalty: float
) -> list[Beam]:
    """The `width` best of the completed and the live beams, best first (a stable sort: ties keep that order)."""
    ranked = sorted(finished + live, key=lambda b: _score(b, score_eos_token_id, length_penalty), reverse=True)
    return ranked[:width]


def _score(beam: Beam, eos_token_id: int | None, length_penalty: float) -> float:
    return beam_score(beam.tokens, beam.cumulative_logprob, eos_token_id, length_penalty)


@dataclass
class BeamSearchSequence:
    """One returned beam, vLLM's fields: tokens are the prompt's then the beam's (an eos that completed it kept),
    text decodes all of them; logprobs hold, per generated token, the candidates its step reported. vLLM's offline
    search leaves finish_reason and stop_reason None; lora_request is always None (no LoRA here)."""

    orig_prompt: dict[str, Any]
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's result: its best `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]
