"""The `hermes` tool-call parser: Qwen3 / Qwen3-Next's JSON calls inside <tool_call> tags -> OpenAI tool_calls.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

As vLLM's hermes parser: text before the first call is content (as generated, whitespace included); each call's
arguments are json.dumps of the "arguments" object (a string value is passed through as it is); text after the
calls is dropped. A block whose JSON does not parse is not a call: before any call it stays content, so a
malformed first call returns the whole output as content, as vLLM does.

Incremental with the interface of Qwen3XMLToolParser (feed / finish / has_tool_calls): content streams until a
possible `<tool_call>` prefix; a call goes out whole (id, name and arguments in one delta) once its closing tag
arrives, so streamed and non-streamed results are the same by construction. finish() parses a call cut off
without its closing tag if its JSON is complete, and returns it as content otherwise.
"""

from __future__ import annotations

import json
from typing import Any

from deltaserve.api.reasoning import partial_tag_length
from deltaserve.api.tool_parser import new_tool_call_id

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


def parse_call(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's text, or None if it is not a JSON object with a string name."""
    try:
        call = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return call["name"], arguments


class HermesToolParser:
    """States: 'content' (before any call), 'call' (inside <tool_call>), 'between' (after a call)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # vLLM's hermes parser is not engine-based: under tool_choice "none" it is not run at all (see serving_chat)
        self.drops_calls = False
        self.mode = "content"
        self.pending = ""
        self.num_calls = 0

    @property
    def has_tool_calls(self) -> bool:
        return self.num_calls > 0

    def _call_delta(self, name: str, arguments: str) -> dict[str, Any]:
        self.num_calls += 1
        return {"index": self.num_calls - 1, "id": new_tool_call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}  # fmt: skip

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Returns (content delta, tool-call deltas)."""
        self.pending += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while self.pending:
            if self.mode in ("content", "between"):
                start = self.pending.find(CALL_START)
                if start == -1:
                    keep = partial_tag_length(self.pending, (CALL_START,))
                    if self.mode == "content":
                        content.append(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                if self.mode == "content":
                    content.append(self.pending[:start])
                self.pending = self.pending[start + len(CALL_START) :]
                self.mode = "call"
            else:
                end = self.pending.find(CALL_END)
                if end == -1:
                    break
                block, self.pending = self.pending[:end], self.pending[end + len(CALL_END) :]
                parsed = parse_call(block.strip())
                if parsed is not None:
                    calls.append(self._call_delta(*parsed))
                elif not self.has_tool_calls:
                    content.append(CALL_START + block + CALL_END)
                self.mode = "between" if self.has_tool_calls else "content"
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """Flushes at the end of generation: an unclosed call is a call if its JSON is whole, else content."""
        text, self.pending = self.pending, ""
        if self.mode == "content":
            return text, []
        if self.mode == "call":
            parsed = parse_call(text.strip())
            if parsed is not None:
                return "", [self._call_delta(*parsed)]
            if not self.has_tool_calls:
                return CALL_START + text, []
        return "", []
