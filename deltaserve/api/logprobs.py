"""The engine's per-token Logprob dicts in the two OpenAI shapes: completions' parallel lists and chat's entries.

Each engine entry maps token id -> Logprob for the sampled token plus the top-N candidates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deltaserve.engine.request import Logprob
from deltaserve.sampling_params import ALL_LOGPROBS

if TYPE_CHECKING:
    from deltaserve.api.protocol import CompletionRequest

# vLLM clamps -inf so the JSON stays valid.
MIN_LOGPROB = -9999.0


def _clamp(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


class TokenNamer:
    """How a token id is shown: its decoded text, or 'token_id:N' with return_tokens_as_token_ids."""

    def __init__(self, tokenizer: Any, as_token_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def __call__(self, token_id: int, logprob: Logprob | None = None) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])


def _top_entries(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The entry's num_top best ranked; all of them for -1 (chat's top_logprobs -1: the engine reported the whole
    vocabulary)."""
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0, -item[1].logprob))
    return ranked if num_top == ALL_LOGPROBS else ranked[:num_top]


def completion_top(request: CompletionRequest) -> int | None:
    """How many candidates a completion's top_logprobs lists: `logprobs`, or all of them (-1) with
    logprob_token_ids (vLLM's _create_completion_logprobs lists every entry then)."""
    return ALL_LOGPROBS if request.logprob_token_ids else request.logprobs


class CompletionLogprobs:
    """Accumulates completions' logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, namer: TokenNamer, num_top: int, initial_offset: int = 0) -> None:
        self.namer = namer
        self.num_top = num_top
        self.offset = initial_offset

    def build(self, token_ids: list[int], entries: list[dict[int, Logprob] | None] | None) -> dict[str, Any]:
        """An entry of None (the echoed prompt's first token, which has no logprob) gives null logprob and null
        top_logprobs, as vLLM; a position past the entries gives null logprob and empty top_logprobs."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        entries = entries or []
        for position, token_id in enumerate(token_ids):
            entry = entries[position] if position < len(entries) else {}
            if entry is None:
                token = self.namer(token_id)
                tokens.append(token)
                token_logprobs.append(None)
                top_logprobs.append(None)
                text_offset.append(self.offset)
                self.offset += len(token)
                continue
            sampled = entry.get(token_id)
            token = self.namer(token_id, sampled)
            tokens.append(token)
            token_logprobs.append(_clamp(sampled.logprob) if sampled is not None else None)
            top_logprobs.append(self._top(entry, token_id, sampled))
            text_offset.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}  # fmt: skip

    def _top(self, entry: dict[int, Logprob], token_id: int, sampled: Logprob | None) -> dict[str, float]:
        """vLLM's top_logprobs: the token first, then the num_top best by rank; where two share a text (distinct
        ids can decode alike: "" for a partial character) the later one's logprob stays under it, as in vLLM's dict
        (lm-eval's is-greedy check compares the token's logprob with these values)."""
        ranked = _top_entries(entry, self.num_top)
        if sampled is not None:
            ranked = [(token_id, sampled), *((tid, lp) for tid, lp in ranked if tid != token_id)]
        return {self.namer(tid, lp): _clamp(lp.logprob) for tid, lp in ranked}


def _chat_item(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _content_items(
    namer: TokenNamer,
    token_ids: list[int],
    entries: list[dict[int, Logprob]] | None,
    top: Callable[[dict[int, Logprob], int, Logprob | None], list[tuple[int, Logprob]]],
) -> list[dict[str, Any]]:
    """The logprobs.content items of chat and Responses: token, logprob, bytes, and the top_logprobs list, whose
    entries top(entry, token_id, sampled) picks (the two endpoints order them differently)."""
    items = []
    entries = entries or []
    for position, token_id in enumerate(token_ids):
        entry = entries[position] if position < len(entries) else {}
        sampled = entry.get(token_id)
        item = _chat_item(namer(token_id, sampled), _clamp(sampled.logprob) if sampled is not None else MIN_LOGPROB)
        item["top_logprobs"] = [
            _chat_item(namer(tid, lp), _clamp(lp.logprob)) for tid, lp in top(entry, token_id, sampled)
        ]
        items.append(item)
    return items


def _dict_order(entry: dict[int, Logprob], token_id: int, sampled: Logprob | None) -> list[tuple[int, Logprob]]:
    """The entries in the order of vLLM's per-position dict: the sampled token first, then the candidates by rank
    (a candidate that is the sampled token keeps the first place)."""
    ordered = [(token_id, sampled)] if sampled is not None else []
    return ordered + [(tid, lp) for tid, lp in _top_entries(entry, ALL_LOGPROBS) if tid != token_id]


def chat_logprobs(
    namer: TokenNamer, token_ids: list[int], entries: list[dict[int, Logprob]] | None, num_top: int
) -> list[dict[str, Any]]:
    """Chat's logprobs.content items: token, logprob, bytes and top_logprobs, as vLLM 0.26's _get_top_logprobs
    (vllm/entrypoints/openai/chat_completion/serving.py) takes them: the first num_top of the engine's dict, the
    sampled token first (so a sampled token outside the best num_top is listed, first), all of it for -1."""

    def top(entry: dict[int, Logprob], token_id: int, sampled: Logprob | None) -> list[tuple[int, Logprob]]:
        ordered = _dict_order(entry, token_id, sampled)
        return ordered if num_top == ALL_LOGPROBS else ordered[: max(num_top, 0)]

    return _content_items(namer, token_ids, entries, top)


def response_logprobs(
    namer: TokenNamer, token_ids: list[int], entries: list[dict[int, Logprob]] | None, num_top: int
) -> list[dict[str, Any]]:
    """vLLM 0.26's Responses logprobs (_create_response_logprobs, vllm/entrypoints/openai/responses/serving.py):
    token, logprob, bytes, and top_logprobs: the first num_top of the engine's dict (as chat's), none for 0."""

    def top(entry: dict[int, Logprob], token_id: int, sampled: Logprob | None) -> list[tuple[int, Logprob]]:
        return _dict_order(entry, token_id, sampled)[: max(num_top, 0)]

    return _content_items(namer, token_ids, entries, top)


def stream_logprobs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """response_logprobs' items as a Responses text delta carries them: token, logprob and top_logprobs (token and
    logprob), no bytes (vLLM's _create_stream_response_logprobs)."""
    return [
        {"token": item["token"], "logprob": item["logprob"],
         "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in item["top_logprobs"]]}
        for item in items
    ]  # fmt: skip


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs field: per prompt token (None for the first) token id -> logprob, rank, text."""
    if entries is None:
        return None
    return [
        None if entry is None else {
            str(tid): {"logprob": _clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in entries
    ]  # fmt: skip
