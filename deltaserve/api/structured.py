"""Request fields -> one StructuredOutputsParams, as vLLM 0.26 reads them, checked off the event loop.

A chat request's constraint comes from resolve_chat_constraint: the structured-output fields, or, for tool_choice
"required" or a named function, a structural tag of the tools' schemas (never both).

Sources, in vLLM's order of precedence: `structured_outputs` (json, regex, choice, grammar, json_object,
structural_tag and its options), the older `guided_*` names (mapped onto the same fields), then `response_format`
(json_object, json_schema, structural_tag), which overrides the constraint as vLLM's
structured_outputs_from_response_format does. The constraint is parsed (not compiled: that needs the tokenizer and
happens in the engine core) on a worker thread, so a malformed schema, regex or grammar is a 400 naming its field
and a large schema never stalls the event loop.

Options vLLM 0.26 accepts and never reads with its xgrammar backend (whitespace_pattern and
disable_additional_properties shape only its guidance backend's JSON grammar, and only from the server-wide config;
`backend` and `disable_fallback` are not fields of its StructuredOutputsParams, so its request parser drops them) are
accepted here too, and logged as ignored (log_ignored_options) rather than dropped silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import OrderedDict
from typing import Any

from deltaserve.api.errors import bad_request
from deltaserve.api.protocol import ChatCompletionRequest, SamplingRequest
from deltaserve.api.sampling import warn_once_per_set
from deltaserve.engine.grammar import BACKENDS, GrammarError, check_structured_outputs
from deltaserve.sampling_params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
OPTION_FIELDS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
KNOWN_FIELDS = frozenset(StructuredOutputsParams.CONSTRAINTS + OPTION_FIELDS + ("disable_fallback", "backend"))
# accepted and without effect with xgrammar, in vLLM 0.26 too (the module docstring): logged when set
IGNORED_OPTIONS = ("whitespace_pattern", "disable_additional_properties", "backend", "disable_fallback")
NUM_LOGGED_OPTION_SETS = 64
_logged_option_sets: OrderedDict[frozenset[str], None] = OrderedDict()
logger = logging.getLogger(__name__)


def log_ignored_options(names: set[str]) -> None:
    """One warning for each new set of ignored structured-output options a request sets, so a client learns they
    changed nothing without one line per request."""
    message = ("The following structured-output options were present in the request but ignored (the xgrammar "
               "backend does not read them)")  # fmt: skip
    warn_once_per_set(logger, _logged_option_sets, NUM_LOGGED_OPTION_SETS, frozenset(names), message)


def _from_structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object.", "structured_outputs")
    unknown = sorted(set(value) - KNOWN_FIELDS)
    if unknown:
        raise bad_request(f"structured_outputs has unknown field(s) {unknown}.", "structured_outputs")
    fields = {k: v for k, v in value.items() if k in StructuredOutputsParams.CONSTRAINTS + OPTION_FIELDS}
    if fields.get("structural_tag") is not None and not isinstance(fields["structural_tag"], str):
        fields["structural_tag"] = json.dumps(fields["structural_tag"])
    return {k: v for k, v in fields.items() if v is not None}


def _from_response_format(response_format: Any) -> dict[str, Any] | None:
    """The constraint response_format asks for, or None for text / no response_format."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise bad_request("response_format must be an object.", "response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if schema is None:
            raise bad_request(
                "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                "response_format",
            )
        return {"json": schema}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(response_format)}
    raise bad_request(
        f"response_format type must be one of 'text', 'json_object', 'json_schema', 'structural_tag'; got {kind!r}.",
        "response_format",
    )


def structured_fields(request: SamplingRequest, response_format: Any) -> tuple[dict[str, Any], str] | None:
    """(StructuredOutputsParams fields, the request field they came from), or None for an unconstrained request."""
    fields: dict[str, Any] = {}
    param = "structured_outputs"
    if request.structured_outputs is not None:
        fields = _from_structured_outputs(request.structured_outputs)
    for name, target in GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None and target not in fields:
            fields[target] = value
            param = name
    ignored = set()
    if isinstance(request.structured_outputs, dict):
        ignored = {name for name in IGNORED_OPTIONS if request.structured_outputs.get(name) not in (None, False)}
    if request.guided_whitespace_pattern is not None:
        fields.setdefault("whitespace_pattern", request.guided_whitespace_pattern)
        ignored.add("guided_whitespace_pattern")
    log_ignored_options(ignored)
    backend = request.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not supported; deltaserve implements {BACKENDS}.",
            "guided_decoding_backend",
        )
    overrides = _from_response_format(response_format)
    if overrides is not None:
        fields = {k: v for k, v in fields.items() if k in OPTION_FIELDS} | overrides
        param = "response_format"
    if not any(k in StructuredOutputsParams.CONSTRAINTS for k in fields):
        if fields and request.structured_outputs is not None:
            raise bad_request(
                "You must use one kind of structured outputs constraint but none are specified.", "structured_outputs"
            )
        return None
    return fields, param


def build_spec(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    """StructuredOutputsParams from checked fields, parsed by the backend; a 400 names the offending field."""
    try:
        spec = StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), param) from None
    try:
        check_structured_outputs(spec, param)
    except GrammarError as exc:
        raise bad_request(str(exc), exc.param or param) from None
    spec.is_checked = True
    return spec


async def resolve_structured_outputs(
    request: SamplingRequest, response_format: Any = None
) -> StructuredOutputsParams | None:
    """The request's constraint, parsed on a worker thread; None when it has none."""
    found = structured_fields(request, response_format)
    if found is None:
        return None
    return await asyncio.to_thread(build_spec, *found)


# a bound on each whitespace run inside forced tool-call arguments: a real model writes one newline or an
# indentation; a degenerate one cannot spend its whole budget on blanks
MAX_TOOL_WHITESPACE = 16


def _call_tag(name: str, schema: dict[str, Any], parser: str | None) -> dict[str, Any]:
    """One call in the model's own format: hermes JSON in tags (Qwen3-Next), else qwen3_coder XML (Qwen3.5/3.6)."""
    if parser == "hermes":
        content = {"type": "json_schema", "json_schema": schema, "style": "json",
                   "max_whitespace_cnt": MAX_TOOL_WHITESPACE}  # fmt: skip
        return {"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
                "content": content, "end": "}\n</tool_call>"}  # fmt: skip
    # qwen3_coder XML, one parameter per required property in schema order, laid out exactly as the chat
    # template shows the model (the parser strips one newline around a value and converts it by the schema type)
    properties = schema.get("properties") or {}
    elements: list[dict[str, Any]] = []
    for key in schema.get("required") or []:
        elements += [{"type": "const_string", "value": f"<parameter={key}>\n"},
                     _xml_value(properties.get(key) or {}),
                     {"type": "const_string", "value": "\n</parameter>\n"}]  # fmt: skip
    content = {"type": "sequence", "elements": elements} if elements else {"type": "const_string", "value": ""}
    return {"type": "tag", "begin": f"<tool_call>\n<function={name}>\n", "content": content,
            "end": "</function>\n</tool_call>"}  # fmt: skip


def _xml_value(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter's value: a string is raw text (an enum one of its values), anything else is JSON."""
    enum = schema.get("enum")
    is_string = schema.get("type") == "string" or (
        "type" not in schema and enum is not None and all(isinstance(v, str) for v in enum)
    )
    if not is_string:
        return {
            "type": "json_schema",
            "json_schema": schema,
            "style": "json",
            "max_whitespace_cnt": MAX_TOOL_WHITESPACE,
        }
    if enum is not None:
        return {"type": "regex", "pattern": "|".join(f"({re.escape(value)})" for value in enum)}
    # free text up to the closing tag (no '<', so '</parameter>' cannot appear inside it)
    return {"type": "regex", "pattern": "[^<]*"}


def forced_tool_call_fields(
    tools: list[Any], tool_choice: str, parser: str | None, is_parallel: bool
) -> dict[str, Any]:
    """The structural tag of tool_choice "required" (one call or more of any tool; one when parallel_tool_calls
    is false) or of a named function (exactly one call of it), with nothing before or after the calls."""
    chosen = [tool for tool in tools if tool_choice == "required" or tool.function.name == tool_choice]
    tags = []
    for tool in chosen:
        schema = tool.function.parameters or {"type": "object", "properties": {}}
        tags.append(_call_tag(tool.function.name, schema, parser))
    is_single = tool_choice != "required" or not is_parallel
    tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                                                 "at_least_one": True, "stop_after_first": is_single}}  # fmt: skip
    return {"structural_tag": json.dumps(tag)}


async def resolve_tool_call_constraint(
    tools: list[Any], tool_choice: str, parser: str | None, is_parallel: bool
) -> StructuredOutputsParams:
    fields = forced_tool_call_fields(tools, tool_choice, parser, is_parallel)
    return await asyncio.to_thread(build_spec, fields, "tools")


async def resolve_chat_constraint(
    request: ChatCompletionRequest, tool_choice: str | None, parser: str | None
) -> StructuredOutputsParams | None:
    """A chat request's constraint: its structured-output fields, or the forced tool call of tool_choice
    "required" or a named function (`tool_choice` as check_tool_choice returns it)."""
    structured = await resolve_structured_outputs(request, request.response_format)
    if tool_choice in (None, "auto"):
        return structured
    # "required" or a named function: the call is generated through a grammar of the tools' schemas
    if structured is not None:
        raise bad_request("You can only either use constraints for structured outputs or tools, not both.",
                          "tool_choice")  # fmt: skip
    return await resolve_tool_call_constraint(
        request.tools or [], tool_choice, parser, request.parallel_tool_calls is not False
    )
