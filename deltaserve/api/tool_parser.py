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
content). A value is converted by the tool's JSON-schema types as vLLM 0.26's coerce_to_schema_type does
(convert_value); a parameter the schema does not describe stays a string. Call ids are vLLM's (new_tool_call_id).
The parser is incremental: a call's id and name go out as soon as `<function=NAME>` is complete, then one
arguments fragment per finished parameter, then the closing brace; the fragments concatenate to json.dumps of the
arguments. finish() completes a call cut off by the length limit.
"""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from typing import Any

from deltaserve.api.reasoning import partial_tag_length

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FUNCTION_PREFIX = "<function="
FUNCTION_END = "</function>"
PARAMETER_PREFIX = "<parameter="
PARAMETER_END = "</parameter>"

# vLLM's tool_parsers/utils.py _TYPE_ALIASES: a schema type's other spellings
TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
    "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
    "float": "number", "float32": "number", "float64": "number", "double": "number",
    "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array",
}  # fmt: skip
ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
              (dict, "object"))  # fmt: skip


def new_tool_call_id() -> str:
    """A call's id as vLLM 0.26's make_tool_call_id gives it for Qwen (entrypoints/chat_utils.py; only Kimi K2
    models get `functions.NAME:INDEX`): `chatcmpl-tool-` and random_uuid() of vllm/utils/__init__.py, the low 64
    bits of a uuid4 as 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


def _schema_types(schema: dict[str, Any]) -> set[str]:
    """vLLM's extract_types_from_schema: `type`, the enum values' types, anyOf / oneOf / allOf; "string" if none."""
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types |= {t for t in kind if isinstance(t, str)}
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            types.add("null" if value is None else next((t for cls, t in ENUM_TYPES if isinstance(value, cls)), ""))
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        if isinstance(choices, list):
            for sub in choices:
                types |= _schema_types(sub) if isinstance(sub, dict) else {"string"}
    types.discard("")
    return types or {"string"}


def _is_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_is_finite(v) for v in value.values())
    return True


def convert_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text -> a JSON value, as vLLM's coerce_to_schema_type: a parameter the tool's schema does not
    describe stays a string; otherwise the schema's types are tried null > integer > number > boolean > object >
    array > string, and with none of them fitting the text is read as JSON, else kept as a string."""
    if not isinstance(schema, dict):
        return raw
    types = {TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in _schema_types(schema)}
    if "null" in types and raw.lower() == "null":
        return None
    if "integer" in types:
        with contextlib.suppress(ValueError):
            return int(raw)
    if "number" in types:
        with contextlib.suppress(ValueError):
            number = float(raw)
            if math.isfinite(number):
                return number if number != int(number) else int(number)
    if "boolean" in types and raw.lower().strip() in ("true", "1", "false", "0"):
        return raw.lower().strip() in ("true", "1")
    if "object" in types or "array" in types:
        with contextlib.suppress(ValueError, RecursionError):
            value = json.loads(raw)
            if _is_finite(value):
                return value
    if "string" in types:
        return raw
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    return value if _is_finite(value) else raw


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3XMLToolParser:
    """States: 'content' (outside calls), 'name' (after <tool_call>, reading <function=NAME>), 'body' (reading
    parameters), 'between' (after </function>, or a <tool_call> that held no call after a call: dropped up to
    </tool_call>)."""

    def __init__(self, tools: list[dict[str, Any]] | None, *, is_streamed: bool = True) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            function = tool.get("function") or {}
            parameters = function.get("parameters") or {}
            self.schemas[function.get("name", "")] = parameters.get("properties") or {}
        self.is_streamed = is_streamed
        self.mode = "content"
        self.pending = ""
        self.num_calls = 0
        self.function_name = ""
        self.num_args = 0
        self.opener = ""  # the <tool_call> consumed before <function=, given back if none follows
        self.has_sent_text = False  # streamed: content other than whitespace has gone out
        self.waiting = ""  # streamed: whitespace-only content waiting for other text (a call drops it)
        self.before_calls = ""  # not streamed: the text before the first call, stripped if a call comes

    def _text(self, content: list[str], text: str) -> None:
        """Content outside calls, sent or held as vLLM returns it in this response mode."""
        if not text:
            return
        if not self.is_streamed:
            if not self.has_tool_calls:  # text after a call is dropped
                self.before_calls += text
            return
        if self.has_sent_text:
            content.append(text)
        elif text.strip():
            content.append(self.waiting + text)
            self.waiting, self.has_sent_text = "", True
        elif not self.has_tool_calls:
            self.waiting += text
        # whitespace only, after a call and before any other content: vLLM drops it

    def _not_a_call(self, content: list[str]) -> None:
        """<tool_call> not followed by <function=...>: before any call it was content, after one it is dropped."""
        if self.has_tool_calls:
            self.mode = "between"
        else:
            self._text(content, self.opener)
            self.mode = "content"
        self.opener = ""

    @property
    def has_tool_calls(self) -> bool:
        return self.num_calls > 0

    def _open_call(self, content: list[str], name: str) -> dict[str, Any]:
        if not self.has_tool_calls:
            # the first call settles the text before it: stripped (not streamed); whitespace-only waiting text goes
            content.append(self.before_calls.strip())
            self.before_calls = self.waiting = ""
        self.function_name, self.num_args = name, 0
        self.num_calls += 1
        return {"index": self.num_calls - 1, "id": new_tool_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}  # fmt: skip

    def _argument(self, key: str, raw: str) -> dict[str, Any]:
        schema = self.schemas.get(self.function_name, {}).get(key)
        value = convert_value(_strip_one_newline(raw), schema)
        fragment = ("{" if self.num_args == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self.num_args += 1
        return self._args_delta(fragment + json.dumps(value, ensure_ascii=False))

    def _close_call(self) -> dict[str, Any]:
        self.mode = "between"
        return self._args_delta("{}" if self.num_args == 0 else "}")

    def _args_delta(self, fragment: str) -> dict[str, Any]:
        return {"index": self.num_calls - 1, "function": {"arguments": fragment}}

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Returns (content delta, tool-call deltas)."""
        self.pending += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while self.pending and self._step(content, calls):
            pass
        return "".join(content), calls

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
                self.pending, self.mode, self.opener = text[start + len(tag) :], "name", tag
            else:  # a bare <function=: the name step reads it
                self.pending, self.mode, self.opener = text[start:], "name", ""
            return True
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
            calls.append(self._open_call(content, stripped[len(FUNCTION_PREFIX) : close].strip()))
            self.opener = ""
            self.pending, self.mode = stripped[close + 1 :], "body"
            return True
        return self._step_body(calls)

    def _step_body(self, calls: list[dict[str, Any]]) -> bool:
        text = self.pending
        begin = text.find(PARAMETER_PREFIX)
        function_end = text.find(FUNCTION_END)
        if function_end != -1 and (begin == -1 or function_end < begin):
            calls.append(self._close_call())
            self.pending = text[function_end + len(FUNCTION_END) :]
            return True
        if begin == -1:
            return False
        name_end = text.find(">", begin)
        if name_end == -1:
            return False
        key = text[begin + len(PARAMETER_PREFIX) : name_end].strip()
        value_start = name_end + 1
        # A value ends at </parameter>, or where the next parameter or the function's end begins.
        ends = [
            i for i in (text.find(t, value_start) for t in (PARAMETER_END, PARAMETER_PREFIX, FUNCTION_END)) if i != -1
        ]
        if not ends:
            return False
        value_end = min(ends)
        calls.append(self._argument(key, text[value_start:value_end]))
        after = value_end + len(PARAMETER_END) if text.startswith(PARAMETER_END, value_end) else value_end
        self.pending = text[after:]
        return True

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """Flushes at the end of generation: completes a call that was cut off, or returns held text as content."""
        text, self.pending = self.pending, ""
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        if self.mode == "content":
            self._text(content, text)
        elif self.mode == "name" and not self.has_tool_calls:
            self._text(content, self.opener + text)  # an opened call without a complete name stays text
        elif self.mode == "body":
            begin = text.find(PARAMETER_PREFIX)
            name_end = text.find(">", begin) if begin != -1 else -1
            if name_end != -1:
                key = text[begin + len(PARAMETER_PREFIX) : name_end].strip()
                value = text[name_end + 1 :]
                value = value[: len(value) - partial_tag_length(value, (PARAMETER_END, FUNCTION_END))]
                calls.append(self._argument(key, value))
            calls.append(self._close_call())
        if not self.has_tool_calls:
            # no call came: the held text is content as generated, whitespace and all
            content.append(self.waiting + self.before_calls)
            self.waiting = self.before_calls = ""
        return "".join(content), calls
