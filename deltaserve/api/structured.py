"""Request fields -> one StructuredOutputsParams, as vLLM 0.26 reads them, checked off the event loop.

Sources, in vLLM's order of precedence: `structured_outputs` (json, regex, choice, grammar, json_object,
structural_tag and its options), the older `guided_*` names (mapped onto the same fields), then `response_format`
(json_object, json_schema, structural_tag), which overrides the constraint as vLLM's
structured_outputs_from_response_format does. The constraint is parsed (not compiled: that needs the tokenizer and
happens in the engine core) on a worker thread, so a malformed schema, regex or grammar is a 400 naming its field
and a large schema never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from deltaserve.api.errors import bad_request
from deltaserve.api.protocol import SamplingRequest
from deltaserve.engine.grammar import BACKENDS, GrammarError, check_structured_outputs
from deltaserve.sampling_params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
OPTION_FIELDS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
THINK_END = "</think>"
KNOWN_FIELDS = frozenset(StructuredOutputsParams.CONSTRAINTS + OPTION_FIELDS + ("disable_fallback", "backend"))


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
    if request.guided_whitespace_pattern is not None:
        fields.setdefault("whitespace_pattern", request.guided_whitespace_pattern)
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
