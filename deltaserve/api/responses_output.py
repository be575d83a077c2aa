"""A choice's message deltas (chat_output.ChoiceProcessor's reasoning / content / tool_calls) -> Responses output
items, and the stream events that build them.

OutputItems is one state machine for both paths: streaming sends the events it returns, non-streaming keeps only
the finished items, so the same deltas give the same output (the chat processor's deltas differ by mode only in
the content around qwen3_coder tool calls, as vLLM's do). An item opens when a delta of a new kind arrives (reasoning,
text, or a tool call with a new index) and closes when the next one opens or the choice ends; vLLM's event order
per item: output_item.added, (content_part.added | reasoning_part.added), deltas, the matching .done events,
output_item.done. Events carry no sequence number; the stream numbers them as it sends them.

Logprobs (include=["message.output_text.logprobs"]) of tokens whose text is held back or is reasoning go with the
next text delta, so the message's logprobs cover every token up to its last text delta.
"""

from __future__ import annotations

import uuid
from typing import Any

Event = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self, *, with_logprobs: bool) -> None:
        self.with_logprobs = with_logprobs
        self.items: list[dict[str, Any]] = []  # finished output items, in order
        self.kind: str | None = None  # the open item's type: "message", "reasoning", "function_call" or None
        self.item: dict[str, Any] = {}
        self.text: list[str] = []  # the open item's text (or arguments)
        self.logprobs: list[dict[str, Any]] = []  # the open message's logprobs
        self.pending_logprobs: list[dict[str, Any]] = []  # logprobs not sent with a text delta yet
        self.call_index: int | None = None
        self.has_arguments = False

    @property
    def output_index(self) -> int:
        return len(self.items)

    def _where(self) -> dict[str, Any]:
        return {"output_index": self.output_index, "item_id": self.item["id"]}

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> list[Event]:
        """The events of one delta: reasoning first, then text, then tool-call fragments (the parsers' order)."""
        self.pending_logprobs += logprobs if self.with_logprobs else []
        events: list[Event] = []
        if delta.get("reasoning"):
            events += self._switch("reasoning")
            self.text.append(delta["reasoning"])
            events.append({"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                           "delta": delta["reasoning"]})  # fmt: skip
        if delta.get("content"):
            events += self._switch("message")
            self.text.append(delta["content"])
            sent, self.pending_logprobs = self.pending_logprobs, []
            self.logprobs += sent
            events.append({"type": "response.output_text.delta", **self._where(), "content_index": 0,
                           "delta": delta["content"], "logprobs": sent})  # fmt: skip
        for call in delta.get("tool_calls", []):
            if self.kind != "function_call" or call["index"] != self.call_index:
                events += self._switch("function_call", call)
            arguments = call["function"].get("arguments") or ""
            if arguments:
                self.text.append(arguments)
                self.has_arguments = True
                events.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": arguments})
        return events

    def _switch(self, kind: str, call: dict[str, Any] | None = None) -> list[Event]:
        if self.kind == kind and kind != "function_call":
            return []
        events = self.close()
        self.kind, self.text, self.logprobs = kind, [], []
        if kind == "message":
            self.item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                         "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [*events, self._added(), {"type": "response.content_part.added", **self._where(),
                                             "content_index": 0, "part": part}]  # fmt: skip
        if kind == "reasoning":
            self.item = {"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
            return [*events, self._added(), {"type": "response.reasoning_part.added", **self._where(),
                                             "content_index": 0, "part": part}]  # fmt: skip
        assert call is not None
        self.call_index, self.has_arguments = call["index"], False
        self.item = {"id": _id("fc"), "type": "function_call", "call_id": call.get("id") or _id("call"),
                     "name": call["function"].get("name") or "", "arguments": "", "status": "in_progress"}  # fmt: skip
        return [*events, self._added()]

    def _added(self) -> Event:
        return {"type": "response.output_item.added", "output_index": self.output_index, "item": dict(self.item)}

    def close(self) -> list[Event]:
        """Closes the open item (its .done events); call once more when the choice ends."""
        if self.kind is None:
            return []
        text = "".join(self.text)
        where = self._where()
        item = {**self.item, "status": "completed"}
        events: list[Event]
        if self.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [],
                    "logprobs": self.logprobs if self.with_logprobs else None}  # fmt: skip
            item["content"] = [part]
            events = [
                {"type": "response.output_text.done", **where, "content_index": 0, "text": text,
                 "logprobs": self.logprobs},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]  # fmt: skip
        elif self.kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            events = [
                {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text},
                {"type": "response.reasoning_part.done", **where, "content_index": 0, "part": part},
            ]
        else:
            item["arguments"] = text
            events = []
            if self.has_arguments:
                events.append({"type": "response.function_call_arguments.done", **where, "arguments": text,
                               "name": item["name"]})  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": self.output_index, "item": item})
        self.items.append(item)
        self.kind, self.item, self.call_index = None, {}, None
        return events
