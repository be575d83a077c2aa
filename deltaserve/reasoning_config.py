"""vLLM's ReasoningConfig: the engine's reasoning start and end strings (--reasoning-parser's, or --reasoning-config's
own) and their token ids, which thinking-token budgets count and force (engine/thinking_budget.py).

vLLM 0.26 (vllm/config/reasoning.py) takes `reasoning_start_str` / `reasoning_end_str` from --reasoning-config when
given, else from the reasoning parser, and encodes each without special tokens; an engine where either is missing
has no markers, and a request with a budget is refused there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# vLLM's ReasoningConfig fields (vllm/config/reasoning.py); the token ids are derived, never given
REASONING_CONFIG_KEYS = ("reasoning_parser", "reasoning_start_str", "reasoning_end_str")
# the reasoning parsers' delimiters (vLLM's qwen3 parser: its THINK_START / THINK_END terminals)
QWEN3_MARKERS = ("<think>", "</think>")
PARSER_STRINGS = {"qwen3": QWEN3_MARKERS}
# vLLM's error when a request sets a budget on an engine without reasoning markers (v1/engine/input_processor.py)
NOT_CONFIGURED = (
    "thinking_token_budget is set but reasoning_config is not configured. Please set --reasoning-parser and/or "
    "--reasoning-config to use thinking_token_budget."
)


def parse_reasoning_config(value: str | dict[str, Any] | None) -> dict[str, str]:
    """vLLM's --reasoning-config JSON (or LLM(reasoning_config={...})) -> its fields; a key it does not have, or a
    value that is not a string, is refused by name."""
    if value is None:
        return {}
    data = value
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--reasoning-config is not valid JSON ({exc}): {value!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--reasoning-config must be a JSON object, got {value!r}")
    unknown = sorted(set(data) - set(REASONING_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"--reasoning-config: unknown field(s) {unknown}; vLLM's fields are {list(REASONING_CONFIG_KEYS)}"
        )
    for key, text in data.items():
        if not isinstance(text, str):
            raise ValueError(f"--reasoning-config: {key} must be a string, got {text!r}")
    return dict(data)


@dataclass(frozen=True)
class ReasoningMarkers:
    """The token ids of the reasoning start and end strings (each non-empty)."""

    start: tuple[int, ...]
    end: tuple[int, ...]


def resolve_markers(reasoning_parser: str | None, reasoning_config: str | dict[str, Any] | None,
                    encode: Any) -> ReasoningMarkers | None:  # fmt: skip
    """vLLM's ReasoningConfig.initialize_token_ids: the strings --reasoning-config gives, else the parser's (the
    config's own reasoning_parser, else --reasoning-parser's), each encoded without special tokens; None (budgets
    refused) when either string is missing. `encode`: text -> token ids."""
    fields = parse_reasoning_config(reasoning_config)
    parser = reasoning_parser or fields.get("reasoning_parser") or None
    start, end = fields.get("reasoning_start_str", ""), fields.get("reasoning_end_str", "")
    if parser is not None and (not start or not end):
        if parser not in PARSER_STRINGS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose from {tuple(PARSER_STRINGS)}")
        parser_start, parser_end = PARSER_STRINGS[parser]
        start, end = start or parser_start, end or parser_end
    if not start or not end:
        return None
    start_ids, end_ids = tuple(encode(start)), tuple(encode(end))
    if not start_ids or not end_ids:
        raise ValueError(
            f"ReasoningConfig: failed to tokenize reasoning strings: reasoning_start_str={start!r}, "
            f"reasoning_end_str={end!r}. Ensure the strings are valid tokens in the model's vocabulary."
        )
    return ReasoningMarkers(start_ids, end_ids)
