"""Grammar backends for structured outputs: a request's StructuredOutputsParams -> a compiled grammar -> a matcher
that fills the packed token bitmask of the next token and accepts the sampled one.

xgrammar is the backend (vLLM's default, and what `auto` picks); the `--structured-outputs-config` backend names
vLLM knows but deltaserve does not implement are refused by name at start-up. Two halves:
- `check_structured_outputs` runs in the front end (API process, off the event loop): it parses the constraint
  without a tokenizer (cheap), so a malformed schema, regex or grammar is a 400 naming its field before anything
  reaches the engine core;
- `XGrammarBackend` runs in the engine core: it holds the tokenizer info and compiles (tokenizer-dependent, the
  costly part) on a worker thread (engine/structured.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deltaserve.sampling_params import StructuredOutputsParams

BACKENDS = ("auto", "xgrammar")
# vLLM's backends that deltaserve does not implement: refused by name
UNSUPPORTED_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")
# the string formats xgrammar's JSON-schema converter implements (vLLM's STRING_SUPPORTED_FORMATS)
STRING_FORMATS = frozenset(
    [
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    ]
)


class GrammarError(ValueError):
    """A constraint the backend cannot build (a 400 naming `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's --structured-outputs-config fields that change what deltaserve does."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: str | dict | None) -> StructuredOutputsConfig:
        """The flag's JSON (or a dict); unknown keys and unsupported backends are refused by name."""
        if value is None or value == "":
            return cls()
        data = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(data, dict):
            raise ValueError("--structured-outputs-config must be a JSON object")
        known = {"backend", "disable_any_whitespace", "disable_additional_properties", "reasoning_parser",
                 "reasoning_parser_plugin", "enable_in_reasoning"}  # fmt: skip
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--structured-outputs-config: unknown field(s) {unknown}; vLLM's are {sorted(known)}")
        backend = data.get("backend", "auto")
        if backend in UNSUPPORTED_BACKENDS:
            raise ValueError(
                f"--structured-outputs-config: backend {backend!r} is not supported by deltaserve; use 'xgrammar' "
                "(vLLM's default) or 'auto'"
            )
        if backend not in BACKENDS:
            raise ValueError(f"--structured-outputs-config: backend must be one of {BACKENDS}, got {backend!r}")
        if data.get("disable_additional_properties"):
            raise ValueError("disable_additional_properties is only supported for the guidance backend.")
        if data.get("reasoning_parser_plugin"):
            raise ValueError("--structured-outputs-config: reasoning_parser_plugin is not supported")
        return cls(
            backend=backend,
            disable_any_whitespace=bool(data.get("disable_any_whitespace", False)),
            reasoning_parser=str(data.get("reasoning_parser", "")),
            enable_in_reasoning=bool(data.get("enable_in_reasoning", False)),
        )


def choice_grammar(choices: list[str]) -> str:
    """EBNF that matches exactly one of the strings (quotes and backslashes escaped)."""
    escaped = (re.sub(r'(["\\])', r"\\\1", choice) for choice in choices)
    return "root ::= " + " | ".join(f'"{choice}"' for choice in escaped)


def _has_unsupported_json_features(schema: Any) -> bool:
    """JSON-schema keywords xgrammar does not enforce (vLLM refuses them for xgrammar too)."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind in ("integer", "number") and "multipleOf" in schema:
        return True
    if kind == "array" and any(k in schema for k in ("uniqueItems", "contains", "minContains", "maxContains")):
        return True
    if kind == "string" and "format" in schema and schema["format"] not in STRING_FORMATS:
        return True
    if kind == "object" and any(k in schema for k in ("patternProperties", "propertyNames")):
        return True
    for value in schema.values():
        items = value if isinstance(value, list) else [value]
        if any(isinstance(item, dict) and _has_unsupported_json_features(item) for item in items):
            return True
    return False


def json_schema_text(spec: StructuredOutputsParams, param: str) -> str:
    """The schema as JSON text; a string that is not JSON is refused naming the field."""
    if spec.json_object:
        return '{"type": "object"}'
    value = spec.json
    if isinstance(value, str):
        if not value.strip():
            raise GrammarError("structured_outputs.json cannot be an empty string", param)
        try:
            schema = json.loads(value)
        except json.JSONDecodeError:
            raise GrammarError("Invalid JSON grammar specification.", param) from None
    else:
        schema = value
    if not isinstance(schema, dict | bool):
        raise GrammarError("Invalid JSON grammar specification: a JSON schema is an object or a boolean.", param)
    if _has_unsupported_json_features(schema):
        raise GrammarError("The provided JSON schema contains features not supported by xgrammar.", param)
    return json.dumps(schema)


def check_structured_outputs(spec: StructuredOutputsParams, param: str = "structured_outputs") -> None:
    """vLLM's request validation for xgrammar: parse (not compile) the constraint; GrammarError names the field."""
    import xgrammar as xgr

    kind = spec.kind
    field_param = f"{param}.{kind}" if param == "structured_outputs" else param
    if kind == "choice":
        if not spec.choice:
            raise GrammarError(f"Choice '{spec.choice}' cannot be an empty list", field_param)
        if not all(isinstance(c, str) for c in spec.choice):
            raise GrammarError("structured_outputs.choice must be a list of strings", field_param)
        _parse(
            lambda: xgr.Grammar.from_ebnf(choice_grammar(spec.choice)),
            "Failed to transform choices into a grammar",
            field_param,
        )
    elif kind == "regex":
        _parse(lambda: xgr.Grammar.from_regex(spec.regex), "Failed to transform regex into a grammar", field_param)
    elif kind in ("json", "json_object"):
        if kind == "json_object" and spec.json_object is not True:
            raise GrammarError(
                "structured_outputs.json_object must be True if set; omit structured_outputs to disable structured "
                "outputs", field_param,
            )  # fmt: skip
        text = json_schema_text(spec, field_param)
        _parse(
            lambda: xgr.Grammar.from_json_schema(text, any_whitespace=not spec.disable_any_whitespace),
            "Failed to transform json schema into a grammar",
            field_param,
        )
    elif kind == "grammar":
        if not spec.grammar.strip():
            raise GrammarError("structured_outputs.grammar cannot be an empty string", field_param)
        _parse(lambda: xgr.Grammar.from_ebnf(spec.grammar), "Invalid grammar specification", field_param)
    elif kind == "structural_tag":
        _parse(
            lambda: xgr.Grammar.from_structural_tag(spec.structural_tag),
            "Invalid structural_tag specification",
            field_param,
        )


def _parse(build: Callable[[], object], failure: str, param: str) -> None:
    """Runs xgrammar's parse `build`; its error becomes a GrammarError `failure: <xgrammar's message>` on `param`."""
    try:
        build()
    except Exception as exc:
        raise GrammarError(f"{failure}: {_short(exc)}", param) from None


def _short(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return text.splitlines()[0] if text else type(exc).__name__


def cache_key(spec: StructuredOutputsParams, disable_any_whitespace: bool) -> str:
    """Compiled grammars are shared between requests with the same constraint."""
    return json.dumps(
        [spec.constraint_dict(), spec.disable_any_whitespace or disable_any_whitespace, spec.whitespace_pattern],
        sort_keys=True, default=str,
    )  # fmt: skip


class XGrammarBackend:
    """Compiles constraints against one tokenizer and makes matchers; `compile` is thread-safe (xgrammar's)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], config: StructuredOutputsConfig
    ) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.config = config
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=8)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        any_whitespace = not (spec.disable_any_whitespace or self.config.disable_any_whitespace)
        kind = spec.kind
        if kind in ("json", "json_object"):
            return self.compiler.compile_json_schema(json_schema_text(spec, "structured_outputs.json"),
                                                     any_whitespace=any_whitespace)  # fmt: skip
        if kind == "regex":
            return self.compiler.compile_regex(spec.regex)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(spec.choice))
        if kind == "grammar":
            return self.compiler.compile_grammar(spec.grammar)
        return self.compiler.compile_structural_tag(spec.structural_tag)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return GrammarMatcher(self.xgr.GrammarMatcher(compiled))


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Writes row `index` of an int32 [C, W] CPU bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepted tokens (a verify chunk's drafts, walked to fill their masks)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)
