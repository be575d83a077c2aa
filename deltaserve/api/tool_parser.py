"""The `qwen3_coder` tool-call parser (alias `qwen3_xml`): Qwen3.5's XML calls -> OpenAI tool_calls.

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

The text around the calls comes back as vLLM 0.26's qwen3_coder chain returns it (its Qwen3Parser engine,
vllm/parser/qwen3.py and vllm/parser/engine/parser_engine.py, under DelegatingParser in
vllm/parser/abstract_parser.py), which is not the same in the two response modes:

- not streamed (is_streamed=False, as vLLM's parse): content is the text before the first call with the whitespace
  on both sides stripped (None when nothing is left, parser_engine.py's _strip_content_whitespace), or the whole
  text as generated when no call comes; text after a call is dropped.
- streamed (as vLLM's parse_delta): text before, between and after calls is content as it comes, whitespace
  included, except whitespace-only text while nothing else has been sent: it waits, goes out in front of the next
  other text, is dropped once a call opens, and is sent at the end if no call came (_events_to_delta's
  _deferred_content and _content_has_nonws).

In both, text between a call's </function> and its </tool_call> is dropped (vLLM's TOOL_BETWEEN state has no
content). Arguments are read and converted as tool_arguments.py describes. Call ids are vLLM's (new_tool_call_id).

Streamed deltas fall where vLLM's do (ParserEngine._handle_arg_chunk, _compute_arg_delta, _handle_tool_end): a
call's id and name go out with the first text after `<function=NAME>` (a possible tag at the end of the text waits,
as vLLM's lexer holds it), then, whenever the body grows, whatever the stable prefix of its arguments JSON gained:
`{"city": "` once `<parameter=city>` is complete, a string value token by token, a value that needs its whole text
(a number, a boolean, an array, a key the schema does not give as a plain string) only once the next parameter opens
or the call ends; at </function> the rest of the finished JSON (`"}`, `3}`). A call cut off by the length limit ends
with the JSON of its closed parameters: not streamed, an open parameter is left out; streamed, nothing more goes
out when that JSON does not continue what was sent (vLLM sends no closing brace then).

tool_choice "none" (is_tool_choice_none), as vLLM's DelegatingParser runs its engine-based tool parser then:
with tools sent, calls are read and thrown away (ParserEngine._suppress_tool_calls): the text outside them is the
content, untrimmed, whitespace-only text waiting only while nothing else was sent; with no tools, calls are read as
under "auto" (the content shaped by them) and the caller (chat_output) drops their deltas. In both a `<tool_call>`
drops the text after it up to `<function=` or `</tool_call>` (vLLM's TOOL_PREAMBLE state), and has_tool_calls
stays False.
"""

from __future__ import annotations

import uuid
from typing import Any

from deltaserve.api.reasoning import partial_tag_length
from deltaserve.api.tool_arguments import arguments_json, convert_value, read_arguments, stable_prefix

__all__ = ["QWEN3_TOOL_PARSERS", "Qwen3XMLToolParser", "convert_value", "new_tool_call_id"]

QWEN3_TOOL_PARSERS = ("qwen3_coder", "qwen3_xml")  # the --tool-call-parser names this parser serves

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FUNCTION_PREFIX = "<function="
FUNCTION_END = "</function>"
PARAMETER_PREFIX = "<parameter="
PARAMETER_END = "</parameter>"
# every tag vLLM's qwen3 lexer knows (qwen3_config's terminals but `>`): a body's text ending in the start of one
# waits for the next text
TAGS = ("<think>", "</think>", CALL_START, CALL_END, FUNCTION_PREFIX, FUNCTION_END, PARAMETER_PREFIX, PARAMETER_END)


def new_tool_call_id() -> str:
    """A call's id as vLLM 0.26's make_tool_call_id gives it for Qwen (entrypoints/chat_utils.py; only Kimi K2
    models get `functions.NAME:INDEX`): `chatcmpl-tool-` and random_uuid() of vllm/utils/__init__.py, the low 64
    bits of a uuid4 as 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


class Qwen3XMLToolParser:
    """States: 'content' (outside calls), 'name' (after <tool_call>, reading <function=NAME>), 'preamble' (under
    tool_choice "none", a <tool_call> not yet followed by <function=), 'body' (the parameters, up to </function>),
    'between' (after </function>, or a <tool_call> that held no call after a call: dropped up to </tool_call>)."""

    def __init__(
        self, tools: list[dict[str, Any]] | None, *, is_streamed: bool = True, is_tool_choice_none: bool = False
    ) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            function = tool.get("function") or {}
            parameters = function.get("parameters") or {}
            self.schemas[function.get("name", "")] = parameters.get("properties") or {}
        self.is_streamed = is_streamed
        self.drops_calls = is_tool_choice_none  # calls are read; ChoiceProcessor drops their deltas
        self.is_suppressed = is_tool_choice_none and bool(tools)  # ... nor do they shape the content
        self.mode = "content"
        self.pending = ""
        self.num_calls = 0
        self.function_name = ""
        self.call_id = ""
        self.body = ""  # the open call's text after <function=NAME>, as far as it is read
        self.sent_arguments = ""  # streamed: the arguments JSON sent so far for the open call
        self.is_name_sent = False
        self.opener = ""  # the <tool_call> consumed before <function=, given back if none follows
        self.has_sent_text = False  # streamed: content other than whitespace has gone out
        self.waiting = ""  # streamed: whitespace-only content waiting for other text (a call drops it)
        self.before_calls = ""  # not streamed: the text before the first call, stripped if a call comes

    @property
    def has_tool_calls(self) -> bool:
        """Calls were returned (finish_reason "tool_calls")."""
        return self.num_calls > 0 and not self.drops_calls

    @property
    def _is_shaped_by_calls(self) -> bool:
        """A call came and the content follows the rules for text around calls (not under tools + "none")."""
        return self.num_calls > 0 and not self.is_suppressed

    def _text(self, content: list[str], text: str) -> None:
        """Content outside calls, sent or held as vLLM returns it in this response mode."""
        if not text:
            return
        if not self.is_streamed:
            if not self._is_shaped_by_calls:  # text after a call is dropped
                self.before_calls += text
            return
        if self.has_sent_text:
            content.append(text)
        elif text.strip():
            content.append(self.waiting + text)
            self.waiting, self.has_sent_text = "", True
        elif not self._is_shaped_by_calls:
            self.waiting += text
        # whitespace only, after a call and before any other content: vLLM drops it

    def _not_a_call(self, content: list[str]) -> None:
        """<tool_call> not followed by <function=...>: before any call it was content, after one it is dropped."""
        if self.num_calls > 0:
            self.mode = "between"
        else:
            self._text(content, self.opener)
            self.mode = "content"
        self.opener = ""

    def _open_call(self, content: list[str], name: str) -> list[dict[str, Any]]:
        if self.num_calls == 0 and not self.is_suppressed:
            # the first call settles the text before it: stripped (not streamed); whitespace-only waiting text goes
            content.append(self.before_calls.strip())
            self.before_calls = self.waiting = ""
        self.function_name, self.call_id = name, new_tool_call_id()
        self.body, self.sent_arguments, self.is_name_sent = "", "", False
        self.num_calls += 1
        # not streamed, the name goes out at once (only the folded message is seen)
        return [] if self.is_streamed else [self._name_delta()]

    def _name_delta(self, arguments: str | None = None) -> dict[str, Any]:
        """The call's first delta: vLLM's DeltaToolCall with its id and name, and no arguments key unless the call
        ends in the same step (_handle_tool_end sends the name with the whole JSON)."""
        self.is_name_sent = True
        function = {"name": self.function_name} if arguments is None else {"name": self.function_name,
                                                                           "arguments": arguments}  # fmt: skip
        return {"index": self.num_calls - 1, "id": self.call_id, "type": "function", "function": function}

    def _args_delta(self, fragment: str) -> dict[str, Any]:
        return {"index": self.num_calls - 1, "function": {"arguments": fragment}}

    @property
    def _call_schemas(self) -> dict[str, Any]:
        return self.schemas.get(self.function_name, {})

    def _read_body(self, calls: list[dict[str, Any]], text: str) -> None:
        """More of the open call's body: streamed, the name on the first text, then what the stable prefix of the
        arguments JSON gained."""
        if not text:
            return
        self.body += text
        if not self.is_streamed:
            return
        if not self.is_name_sent:
            calls.append(self._name_delta())
        prefix = stable_prefix(read_arguments(self.body, self._call_schemas, is_partial=True), self._call_schemas)
        # vLLM sends nothing when the prefix does not continue what went out (a repeated key, say)
        if prefix != self.sent_arguments and prefix.startswith(self.sent_arguments):
            calls.append(self._args_delta(prefix[len(self.sent_arguments) :]))
            self.sent_arguments = prefix

    def _close_call(self, calls: list[dict[str, Any]]) -> None:
        """</function> (or the end of generation): the finished arguments, or streamed what they add."""
        self.mode = "between"
        final = arguments_json(read_arguments(self.body, self._call_schemas, is_partial=False))
        if not self.is_streamed:
            calls.append(self._args_delta(final))
            return
        sent = self.sent_arguments
        rest = final[len(sent) :] if len(final) > len(sent) and final.startswith(sent) else ""
        if not self.is_name_sent:
            calls.append(self._name_delta(rest))
        elif rest:
            calls.append(self._args_delta(rest))
        self.sent_arguments = final if rest else sent

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Returns (content delta, tool-call deltas)."""
        self.pending += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while self.pending and self._step(content, calls):
            pass
        return "".join(content), [] if self.is_suppressed else calls  # vLLM ignores the calls' events then

    def _step(self, content: list[str], calls: list[dict[str, Any]]) -> bool:
        """Consumes what it can of self.pending; False when it must wait for more text."""
        text = self.pending
        if self.mode in ("content", "between"):
            # Between </function> and </tool_call> only the closing tag or another call matters.
            tags = (CALL_START, FUNCTION_PREFIX) if self.mode == "content" else (CALL_START, FUNCTION_PREFIX, CALL_END)
            found = [(i, tag) for tag in tags if (i := text.find(tag)) != -1]
            if not found:
                keep = partial_tag_length(text, tags)  # a possible tag start waits for more text
                if self.mode == "content":
                    self._text(content, text[: len(text) - keep])
                self.pending = text[len(text) - keep :]
                return False
            start, tag = min(found)
            if self.mode == "content":
                self._text(content, text[:start])
            if tag == CALL_END:
                self.pending, self.mode = text[start + len(tag) :], "content"
            elif tag == CALL_START:
                self.pending, self.opener = text[start + len(tag) :], tag
                self.mode = "preamble" if self.drops_calls else "name"
            else:  # a bare <function=: the name step reads it
                self.pending, self.mode, self.opener = text[start:], "name", ""
            return True
        if self.mode == "preamble":
            return self._step_preamble()
        if self.mode == "name":
            stripped = text.lstrip()
            if not stripped.startswith(FUNCTION_PREFIX):
                if FUNCTION_PREFIX.startswith(stripped):
                    return False  # maybe the start of <function=: wait for more text
                self._not_a_call(content)
                return True
            close = stripped.find(">")
            if close == -1:
                return False
            calls += self._open_call(content, stripped[len(FUNCTION_PREFIX) : close].strip())
            self.opener = ""
            self.pending, self.mode = stripped[close + 1 :], "body"
            return True
        return self._step_body(calls)

    def _step_preamble(self) -> bool:
        """tool_choice "none": after <tool_call>, vLLM drops everything up to <function= or </tool_call>."""
        text = self.pending
        found = [(i, tag) for tag in (FUNCTION_PREFIX, CALL_END) if (i := text.find(tag)) != -1]
        if not found:
            self.pending = text[len(text) - partial_tag_length(text, (FUNCTION_PREFIX, CALL_END)) :]
            return False
        start, tag = min(found)
        if tag == CALL_END:
            self.pending, self.mode = text[start + len(tag) :], "content"
        else:
            self.pending, self.mode = text[start:], "name"
        self.opener = ""
        return True

    def _step_body(self, calls: list[dict[str, Any]]) -> bool:
        text = self.pending
        end = text.find(FUNCTION_END)
        if end != -1:
            self._read_body(calls, text[:end])
            self._close_call(calls)
            self.pending = text[end + len(FUNCTION_END) :]
            return True
        keep = partial_tag_length(text, TAGS)
        self._read_body(calls, text[: len(text) - keep])
        self.pending = text[len(text) - keep :]
        return False

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """Flushes at the end of generation: ends a call that was cut off, or returns held text as content."""
        text, self.pending = self.pending, ""
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        if self.mode == "content":
            self._text(content, text)
        elif self.mode == "name" and self.num_calls == 0 and not self.drops_calls:
            self._text(content, self.opener + text)  # an opened call without a complete name stays text
        elif self.mode == "body":
            self._read_body(calls, text)
            self._close_call(calls)
        if not self._is_shaped_by_calls:
            # no call came (or tools + "none"): the held text is content as generated, whitespace and all
            content.append(self.waiting + self.before_calls)
            self.waiting = self.before_calls = ""
        return "".join(content), [] if self.is_suppressed else calls
