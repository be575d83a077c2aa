"""A choice's message deltas (chat_output.ChoiceProcessor's reasoning / content / tool_calls) -> Responses output
items and stream events, built as vLLM 0.26 builds them for a text model.

The Response's `output` (the non-streamed body, and the `response.completed` event of a stream) is output_items:
the non-streamed parse of the whole generation as one reasoning item, one message and one function_call item per
call, in that order (vLLM's build_response_output_items, vllm/entrypoints/openai/responses/utils.py). Their ids are
`rs_`, `msg_` and `fc_` with 16 hex digits, a reasoning item's status is null, a call's call_id is the tool
parser's id (`chatcmpl-tool-` and 16 hex digits), and the message's logprobs cover every generated token.

A stream's events come from StreamEvents, vLLM's SimpleStreamingEventProcessor
(vllm/entrypoints/openai/responses/streaming_events.py) fed the streamed parse: an item opens when a delta of
another kind arrives (reasoning, text, or a call with a new index) and closes when the next opens or the choice
ends, with vLLM's events per item: output_item.added, (content_part.added | reasoning_part.added), the deltas, the
matching .done events, output_item.done. Streamed items are vLLM's own: their ids are bare 16 hex digits and a
call's call_id is `call_` and 16 hex digits, none of them the ids of the completed Response's items (vLLM builds
that one again from the whole text). A text delta carries the logprobs of the engine step that produced it; the
tokens of steps that produce reasoning, a call, or nothing keep none, and output_text.done carries none, as in vLLM.
Events carry no sequence number; the stream numbers them as it sends them.
"""

from __future__ import annotations

import uuid
from typing import Any

from deltaserve.api.tool_parser import new_tool_call_id

Event = dict[str, Any]


def random_id() -> str:
    """vLLM's random_uuid (vllm/utils/__init__.py): the low 64 bits of a uuid4 as 16 hex digits."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def output_items(
    reasoning: str,
    content: str,
    calls: list[dict[str, Any]],
    logprobs: list[dict[str, Any]] | None,
    *,
    is_parsed: bool = True,
) -> list[dict[str, Any]]:
    """The Response's output from the non-streamed parse (calls: {id, name, arguments} in index order); empty
    reasoning or text makes no item, except that a server without parsers always answers one message (with no
    content part when the text is empty), as vLLM's fallback does."""
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append({"id": f"rs_{random_id()}", "summary": [], "type": "reasoning",
                      "content": [{"text": reasoning, "type": "reasoning_text"}], "status": None})  # fmt: skip
    if content or not is_parsed:
        part = {"annotations": [], "text": content, "type": "output_text", "logprobs": logprobs}
        items.append({"id": f"msg_{random_id()}", "content": [part] if content else [], "role": "assistant",
                      "status": "completed", "type": "message"})  # fmt: skip
    for call in calls:
        items.append({"arguments": call["arguments"], "call_id": call["id"] or new_tool_call_id(),
                      "name": call["name"], "type": "function_call", "id": f"fc_{random_id()}",
                      "status": "completed"})  # fmt: skip
    return items


def _pieces(delta: dict[str, Any]) -> list[tuple[str, Any]]:
    """vLLM's split_delta: reasoning, then text, then the tool-call fragments of each index, one piece each."""
    pieces: list[tuple[str, Any]] = []
    if "reasoning" in delta:
        pieces.append(("reasoning", delta["reasoning"]))
    if delta.get("content"):
        pieces.append(("message", delta["content"]))
    pieces += [("function_call", call) for call in delta.get("tool_calls", [])]
    return pieces


class StreamEvents:
    """The events of one streamed choice, item by item."""

    def __init__(self) -> None:
        self.output_index = 0
        self.kind: str | None = None  # the open item's type: "reasoning", "message", "function_call" or None
        self.item_id = ""
        self.text: list[str] = []  # the open item's text (or arguments)
        self.call: dict[str, Any] = {}  # the open call's call_id, name and index
        self.has_arguments = False

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self.output_index}

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> list[Event]:
        """The events of one engine step's delta; logprobs: the step's tokens', sent with its text."""
        events: list[Event] = []
        for kind, piece in _pieces(delta):
            is_new_call = kind == "function_call" and piece["index"] != self.call.get("index")
            if kind != self.kind or is_new_call:
                events += self.close()
                events += self._open(kind, piece)
            if kind == "function_call":
                arguments = piece["function"].get("arguments") or ""
                if arguments:
                    self.text.append(arguments)
                    self.has_arguments = True
                    events.append({"type": "response.function_call_arguments.delta", **self._where(),
                                   "delta": arguments})  # fmt: skip
            elif kind == "reasoning":
                self.text.append(piece)
                events.append({"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                               "delta": piece})  # fmt: skip
            else:
                self.text.append(piece)
                events.append({"type": "response.output_text.delta", **self._where(), "content_index": 0,
                               "delta": piece, "logprobs": logprobs})  # fmt: skip
        return events

    def _open(self, kind: str, piece: Any) -> list[Event]:
        self.kind, self.item_id, self.text = kind, random_id(), []
        where = {"output_index": self.output_index}
        if kind == "message":
            item = {"id": self.item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"}
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
            added = {"type": "response.content_part.added", **self._where(), "content_index": 0, "part": part}
            return [{"type": "response.output_item.added", **where, "item": item}, added]
        if kind == "reasoning":
            item = {"id": self.item_id, "summary": [], "type": "reasoning", "status": "in_progress"}
            part = {"text": "", "type": "reasoning_text"}
            added = {"type": "response.reasoning_part.added", **self._where(), "content_index": 0, "part": part}
            return [{"type": "response.output_item.added", **where, "item": item}, added]
        self.has_arguments = False
        self.call = {"call_id": f"call_{random_id()}", "name": piece["function"].get("name") or "",
                     "index": piece["index"]}  # fmt: skip
        return [{"type": "response.output_item.added", **where, "item": self._call_item("", "in_progress")}]

    def _call_item(self, arguments: str, status: str) -> dict[str, Any]:
        return {"arguments": arguments, "call_id": self.call["call_id"], "name": self.call["name"],
                "type": "function_call", "id": self.item_id, "status": status}  # fmt: skip

    def close(self) -> list[Event]:
        """The open item's .done events; call once more when the choice ends."""
        if self.kind is None:
            return []
        text = "".join(self.text)
        where = self._where()
        events: list[Event]
        if self.kind == "message":
            part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
            item = {"id": self.item_id, "content": [part] if text else [], "role": "assistant", "status": "completed",
                    "type": "message", "summary": []}  # fmt: skip
            events = [
                {"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]
        elif self.kind == "reasoning":
            part = {"text": text, "type": "reasoning_text"}
            item = {"id": self.item_id, "summary": [], "type": "reasoning", "content": [part], "status": "completed"}
            events = [
                {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text},
                {"type": "response.reasoning_part.done", **where, "content_index": 0, "part": part},
            ]
        else:
            item = self._call_item(text, "completed")
            events = []
            if self.has_arguments:
                events.append({"type": "response.function_call_arguments.done", **where, "arguments": text,
                               "name": self.call["name"]})  # fmt: skip
            self.call = {}
        events.append({"type": "response.output_item.done", "output_index": self.output_index, "item": item})
        self.output_index += 1
        self.kind = None
        return events
