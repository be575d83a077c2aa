"""A qwen3_coder call's arguments: the parameters' text -> JSON, as vLLM 0.26's Qwen3 parser engine builds them.

The text between `<function=NAME>` and `</function>` holds `<parameter=KEY>VALUE</parameter>` blocks. vLLM reads
them with its arg converter (_qwen3_arg_converter in vllm/parser/qwen3.py): a parameter ends at `</parameter>` or
where the next `<parameter=` begins, one newline is trimmed from each end of its value, a repeated key keeps its
first place and its last value, and the key is the text after `=` up to `>` (leading whitespace dropped). Then
ParserEngine._fix_arg_types (vllm/parser/engine/parser_engine.py) converts each value by the tool's JSON schema
(convert_value here, vLLM's coerce_to_schema_type in vllm/tool_parsers/utils.py).

A finished call's arguments count only closed parameters (a value cut off by the length limit is left out). While
streaming, vLLM also reads the open parameter and sends the longest prefix of the JSON that cannot change as more
text comes (ParserEngine._safe_arg_prefix): up to the last key's `": "`, plus the value's text so far (no closing
quote) when that key's schema allows only strings, or when the function's schema names no parameters at all.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from typing import Any

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
    """No inf or nan anywhere in a JSON value (vLLM keeps such text a string)."""
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


def _trim_newlines(value: str) -> str:
    """One newline off each end: the Qwen3 template writes values on their own lines."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


# One closed parameter: `<parameter=KEY>` (whitespace allowed around `parameter` and `=`) and its value, up to
# `</parameter>` or the next `<parameter=` (which stays for the next match).
_CLOSED = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL)
_OPEN = re.compile(r"<\s*parameter\s*=\s*([^>]+)>(.*)$", re.DOTALL)  # the parameter still being written


def read_arguments(raw: str, schemas: dict[str, Any], *, is_partial: bool) -> dict[str, Any]:
    """The call's arguments from its body text, converted by the schemas (a function's `properties`)."""
    values: dict[str, str] = {key: _trim_newlines(value) for key, value in _CLOSED.findall(raw)}
    if is_partial:
        match = _OPEN.search(_CLOSED.sub("", raw))
        if match:
            values[match.group(1)] = _trim_newlines(match.group(2))
    return {key: convert_value(value, schemas.get(key)) for key, value in values.items()}


def arguments_json(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def _streams_as_text(key: str, schemas: dict[str, Any]) -> bool:
    """Whether a value of this key may go out before it closes: vLLM's _streamable_string_keys, which compares
    the key as written in the JSON (escaped) with the schema's names, and reads the types unaliased."""
    if not schemas:
        return True
    name = json.dumps(key, ensure_ascii=False)[1:-1]
    if name not in schemas:
        return False
    schema = schemas[name]
    return not isinstance(schema, dict) or _schema_types(schema) == {"string"}


def stable_prefix(arguments: dict[str, Any], schemas: dict[str, Any]) -> str:
    """The part of arguments_json(arguments) that more text cannot change; "" before the first key is known."""
    if not arguments:
        return ""
    *done, (key, value) = arguments.items()
    text = "{" + "".join(f"{json.dumps(k, ensure_ascii=False)}: {arguments_json(v)}, " for k, v in done)
    text += json.dumps(key, ensure_ascii=False) + ": "
    if isinstance(value, str) and _streams_as_text(key, schemas):
        text += json.dumps(value, ensure_ascii=False)[:-1]  # the open string, without its closing quote
    return text
