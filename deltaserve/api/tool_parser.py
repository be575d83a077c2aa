"""The `qwen3_coder` tool-call parser (alias `qwen3_xml`): Qwen3.5's XML calls -> OpenAI tool_calls.

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Text before the first call stays content (less the whitespace that separates it from the call, which
the template adds back); text after it is dropped (the template tells the model to add no
suffix, and vLLM's parser drops it too). A value is converted by the tool's JSON-schema types as vLLM 0.26's
coerce_to_schema_type does (convert_value); a parameter the schema does not describe stays a string.
Call ids are vLLM's (new_tool_call_id). The parser is incremental: a call's id and name go out
as soon as `<function=NAME>` is complete, then one arguments fragment per finished parameter, then the closing
brace; the fragments concatenate to json.dumps of the arguments. finish() completes a call cut off by the
length limit.
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
    """States: 'content' (before any call), 'name' (reading <function=NAME>), 'body' (reading parameters),
    'between' (after a call: only further calls matter)."""

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            function = tool.get("function") or {}
            parameters = function.get("parameters") or {}
            self.schemas[function.get("name", "")] = parameters.get("properties") or {}
        self.mode = "content"
        self.pending = ""
        self.num_calls = 0
        self.function_name = ""
        self.num_args = 0
        self.opener = ""  # the <tool_call> (and whitespace before it) consumed before <function=, given back if none

    def _not_a_call(self, content: list[str]) -> None:
        """<tool_call> not followed by <function=...>: before any call it was content, after one it is dropped."""
        if self.has_tool_calls:
            self.mode = "between"
        else:
            content.append(self.opener)
            self.mode = "content"
        self.opener = ""

    @property
    def has_tool_calls(self) -> bool:
        return self.num_calls > 0

    def _open_call(self, name: str) -> dict[str, Any]:
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
            starts = [i for i in (text.find(CALL_START), text.find(FUNCTION_PREFIX)) if i != -1]
            if not starts:
                # Held back: a possible tag start, and the whitespace before it (dropped if a call follows).
                sendable = text[: len(text) - partial_tag_length(text, (CALL_START, FUNCTION_PREFIX))].rstrip()
                if self.mode == "content":
                    content.append(sendable)
                self.pending = text[len(sendable) :]
                return False
            start = min(starts)
            tag = CALL_START if text.startswith(CALL_START, start) else ""
            before = text[:start].rstrip()
            if self.mode == "content":
                content.append(before)
                # the whitespace before the tag goes with it: dropped if a call follows, given back if none does
                self.opener = text[len(before) : start] + tag
            else:
                self.opener = tag
            self.pending = text[start + len(tag) :]
            self.mode = "name"
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
            calls.append(self._open_call(stripped[len(FUNCTION_PREFIX) : close].strip()))
            self.pending, self.mode = stripped[close + 1 :], "body"
            return True
        return self._step_body(calls)

    def _step_body(self, calls: list[dict[str, Any]]) -> bool:
        text = self.pending
        begin = text.find(PARAMETER_PREFIX)
        function_end = text.find(FUNCTION_END)
        if function_end != -1 and (begin == -1 or function_end < begin):
            calls.append(self._close_call())
            rest = text[function_end + len(FUNCTION_END) :]
            stripped = rest.lstrip()
            self.pending = stripped[len(CALL_END) :] if stripped.startswith(CALL_END) else rest
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
        calls: list[dict[str, Any]] = []
        if self.mode == "content":
            return text, calls
        if self.mode == "name":
            if not self.has_tool_calls:
                return self.opener + text, calls  # an opened call without a complete name stays text
            return "", calls
        if self.mode == "body":
            begin = text.find(PARAMETER_PREFIX)
            name_end = text.find(">", begin) if begin != -1 else -1
            if name_end != -1:
                key = text[begin + len(PARAMETER_PREFIX) : name_end].strip()
                value = text[name_end + 1 :]
                value = value[: len(value) - partial_tag_length(value, (PARAMETER_END, FUNCTION_END))]
                calls.append(self._argument(key, value))
            calls.append(self._close_call())
        return "", calls
