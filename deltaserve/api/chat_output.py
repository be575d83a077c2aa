"""One chat choice's generated text -> OpenAI message deltas: reasoning, content and tool calls.

A ChoiceProcessor chains the reasoning parser (whose content feeds the tool-call parser) and emits delta dicts;
streaming sends them as they come, and non-streaming folds them into one message with MessageBuilder, so both
paths give the same answer except where vLLM's differ: the qwen3_coder tool parser is built for one mode, since
vLLM strips the content before a call and drops the text after it only when not streaming. A message without tool
calls carries no `tool_calls` key (vLLM drops the empty list); under tool_choice "none" a streamed delta
the tool parser returns carries `"tool_calls": []`, as vLLM's does. ReasoningTokenCounter counts the generated tokens
inside <think> ... </think> by token id, for usage.completion_tokens_details.reasoning_tokens.
"""

from __future__ import annotations

from typing import Any, Protocol

from deltaserve.api.reasoning import THINK_END, THINK_START, Qwen3ReasoningParser


class ToolParser(Protocol):
    drops_calls: bool  # tool_choice "none": the calls are read for the content's sake and not returned

    @property
    def has_tool_calls(self) -> bool: ...

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]: ...

    def finish(self) -> tuple[str, list[dict[str, Any]]]: ...


class ReasoningTokenCounter:
    """Generated tokens between <think> and </think> (the prompt may open the block), the markers excluded."""

    def __init__(self, tokenizer: Any, *, is_open: bool) -> None:
        vocab = tokenizer.get_vocab()
        self.start_id = vocab.get(THINK_START)
        self.end_id = vocab.get(THINK_END)
        self.is_open = is_open
        self.num_tokens = 0

    def add(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            if token_id == self.start_id:
                self.is_open = True
            elif token_id == self.end_id:
                self.is_open = False
            elif self.is_open:
                self.num_tokens += 1


def merge_tool_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Coalesces the fragments of one call within a chunk into one entry per index, as clients expect."""
    merged: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        entry = merged.get(delta["index"])
        if entry is None:
            merged[delta["index"]] = {**delta, "function": dict(delta["function"])}
        else:
            entry["function"]["arguments"] = entry["function"].get("arguments", "") + delta["function"]["arguments"]
    return list(merged.values())


def merge_deltas(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    merged = dict(first)
    for key in ("reasoning", "content"):
        if key in second:
            merged[key] = merged.get(key, "") + second[key]
    if "tool_calls" in second:
        merged["tool_calls"] = merge_tool_deltas(merged.get("tool_calls", []) + second["tool_calls"])
    return merged


class ChoiceProcessor:
    def __init__(
        self,
        reasoning_parser: Qwen3ReasoningParser | None,
        tool_parser: ToolParser | None,
        is_reasoning_included: bool = True,
        reasoning_counter: ReasoningTokenCounter | None = None,
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.is_reasoning_included = is_reasoning_included
        self.reasoning_counter = reasoning_counter
        self.num_tokens = 0
        self.has_sent_role = False
        self.is_tool_call_finish = True  # False under a named tool_choice: vLLM's finish_reason stays "stop"
        self.pending_logprobs: list[dict[str, Any]] = []  # logprobs of tokens whose text is still held back
        self.pending_token_ids: list[int] = []  # return_token_ids: ids whose chunk is not sent yet

    @property
    def is_plain(self) -> bool:
        """No parser: every engine delta becomes a content chunk, even an empty one (as vLLM streams)."""
        return self.reasoning_parser is None and self.tool_parser is None

    @property
    def has_tool_calls(self) -> bool:
        return self.tool_parser is not None and self.tool_parser.has_tool_calls

    def _delta(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning and self.is_reasoning_included:
            delta["reasoning"] = reasoning
        if content or (self.is_plain and not calls):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = merge_tool_deltas(calls)
        return delta

    def _route(self, reasoning: str, content: str) -> dict[str, Any]:
        calls: list[dict[str, Any]] = []
        if self.tool_parser is not None and content:
            content, calls = self.tool_parser.feed(content)
            if self.tool_parser.drops_calls and (content or calls):
                # vLLM's DelegatingParser sets the tool_calls of each delta its tool parser returns under tool_choice
                # "none" to [] (_extract_tool_calls_streaming, vllm/parser/abstract_parser.py); the chunk still goes
                # out, `"tool_calls": []` and all, though it may have no content
                return {**self._delta(reasoning, content, []), "tool_calls": []}
        return self._delta(reasoning, content, calls)

    def count(self, token_ids: list[int]) -> None:
        self.num_tokens += len(token_ids)
        if self.reasoning_counter is not None:
            self.reasoning_counter.add(token_ids)

    @property
    def num_reasoning_tokens(self) -> int:
        return self.reasoning_counter.num_tokens if self.reasoning_counter is not None else 0

    def feed(self, text: str) -> dict[str, Any]:
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.feed(text)
        else:
            reasoning, content = "", text
        return self._route(reasoning, content)

    def finish(self) -> dict[str, Any]:
        """Flushes both parsers at the end of the sequence."""
        delta: dict[str, Any] = {}
        if self.reasoning_parser is not None:
            delta = self._route(*self.reasoning_parser.finish())
        if self.tool_parser is not None:
            content, calls = self.tool_parser.finish()
            delta = merge_deltas(delta, self._delta("", content, [] if self.tool_parser.drops_calls else calls))
        return delta

    def finish_reason(self, engine_reason: str) -> str:
        # A completed tool call ends the turn with "tool_calls"; a call cut off by the length limit stays "length".
        is_tool_calls = engine_reason == "stop" and self.has_tool_calls and self.is_tool_call_finish
        return "tool_calls" if is_tool_calls else engine_reason


class MessageBuilder:
    """Folds a choice's deltas into the non-streaming message."""

    def __init__(self, processor: ChoiceProcessor) -> None:
        self.processor = processor
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[dict[str, Any]] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def add(self, delta: dict[str, Any]) -> None:
        if "reasoning" in delta:
            self.reasoning.append(delta["reasoning"])
        if "content" in delta:
            self.content.append(delta["content"])
        for call in delta.get("tool_calls", []):
            entry = self.calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.get("id") or entry["id"]
            entry["name"] = call["function"].get("name") or entry["name"]
            entry["arguments"] += call["function"].get("arguments", "")

    def message(self) -> dict[str, Any]:
        """vLLM's ChatMessage serialised whole: the OpenAI fields it never fills are null, tool_calls is left out
        when empty (as vLLM's serializer drops it), and reasoning is null unless a reasoning parser produced some."""
        content = "".join(self.content)
        is_parsed = not self.processor.is_plain
        message: dict[str, Any] = {"role": "assistant", "content": None if is_parsed and not content else content}
        message.update(refusal=None, annotations=None, audio=None, function_call=None)
        tool_calls = [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for _, call in sorted(self.calls.items())
        ]
        if tool_calls:
            message["tool_calls"] = tool_calls
        message["reasoning"] = "".join(self.reasoning) or None
        return message
