"""Chat-template rendering with transformers' semantics, in a Jinja sandbox that bounds what one render can build.

This module is what a template worker process runs (template_pool.py owns the processes); it imports nothing heavy
(no torch, no transformers), so a worker starts in a fraction of a second.

The environment matches transformers' `apply_chat_template`: ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension and a `{% generation %}` tag, the `tojson` filter without HTML escaping,
and the `raise_exception`, `strftime_now`, `dict` and `namespace` globals; messages get the reasoning aliases
(`reasoning_content`, `thinking`) and continue_final_message cuts the prompt after the final message's text.

On top of the sandbox, one render is bounded in size: a string or list built by `*`, `+` or `%`, a width given to a
string method or filter, an exponent, and the rendered output are all capped, so a template cannot ask the C
runtime for gigabytes in one step. Time is bounded by the parent, which kills a worker that overruns (a thread
cannot be stopped; a process can).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers cuts a continued final message at this marker.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# String methods whose integer arguments size their result.
SIZING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "__mul__", "__rmul__"})
SIZING_FILTERS = ("center", "indent", "wordwrap", "truncate")
MAX_JSON_INDENT = 1024
# Numbers in a %-format or str.format string: a width or precision above the size bound is refused.
FORMAT_NUMBER = re.compile(r"\d+")
MAX_EXPONENT = 4096
NUM_CACHED_TEMPLATES = 16


class RenderLimitError(jinja2.TemplateError):
    """A render asked for more than its bounds allow."""


@dataclass(frozen=True)
class RenderLimits:
    max_output_chars: int = 32 * 2**20
    max_value_chars: int = 8 * 2**20  # one string or list built by an operator, or a width argument


@dataclass
class RenderJob:
    """Everything a worker needs for one render; plain data, so it pickles cheaply."""

    template: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # special tokens and chat_template_kwargs


def _length(value: Any) -> int | None:
    return len(value) if isinstance(value, str | list | tuple | bytes) else None


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every size-producing operation checked before the C runtime runs it."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: RenderLimits, **options: Any) -> None:
        super().__init__(**options)
        self.limits = limits

    def _refuse(self, what: str) -> RenderLimitError:
        return RenderLimitError(f"the chat template {what} (limit {self.limits.max_value_chars} characters)")

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        cap = self.limits.max_value_chars
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                size = _length(seq)
                if size is not None and isinstance(count, int) and size * max(count, 0) > cap:
                    raise self._refuse("repeats a value beyond the size bound")
        elif operator == "+":
            sizes = (_length(left), _length(right))
            if None not in sizes and sizes[0] + sizes[1] > cap:
                raise self._refuse("concatenates values beyond the size bound")
        elif operator == "**":
            if isinstance(right, int) and isinstance(left, int | float) and abs(right) > MAX_EXPONENT:
                raise RenderLimitError(f"the chat template raises to a power above {MAX_EXPONENT}")
        elif operator == "%" and isinstance(left, str) and self.is_wide_format(left):
            raise self._refuse("formats with a width beyond the size bound")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str | list | tuple) and name in SIZING_METHODS:
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and value > __self.limits.max_value_chars:
                    raise __self._refuse("asks for a string beyond the size bound")
        if isinstance(owner, str) and name == "replace" and len(args) >= 2:
            __self.check_replace(owner, args[0], args[1])
        return super().call(__context, __obj, *args, **kwargs)

    def check_replace(self, text: Any, old: Any, new: Any) -> None:
        """str.replace can multiply a string's length (an empty `old` inserts `new` between every character)."""
        if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
            return
        num_places = text.count(old) if old else len(text) + 1
        if len(text) + num_places * max(len(new) - len(old), 0) > self.limits.max_value_chars:
            raise self._refuse("replaces text beyond the size bound")

    def is_wide_format(self, text: str) -> bool:
        return any(
            len(digits) > 9 or int(digits) > self.limits.max_value_chars for digits in FORMAT_NUMBER.findall(text)
        )

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        # Jinja sandboxes str.format at attribute access; a wide field is refused there, before it is called.
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and self.is_wide_format(value.__self__):

            def refuse(*args: Any, **kwargs: Any) -> str:
                raise self._refuse("formats with a width beyond the size bound")

            return refuse
        return wrapped


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it to mask assistant tokens)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed attribute names (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805
        # Jinja's own signature trick, so that namespace(self=...) still works.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template namespace cannot hold the attribute {name!r}")


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # No HTML escaping (unlike Jinja's own tojson), and the json.dumps options templates use.
    if (isinstance(indent, int) and indent > MAX_JSON_INDENT) or (isinstance(indent, str) and len(indent) > 64):
        raise RenderLimitError(f"the chat template asks tojson for an indent above {MAX_JSON_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_spec: str) -> str:
    return datetime.now().strftime(format_spec)


def _bounded_filter(environment: BoundedEnvironment, name: str) -> None:
    original = environment.filters[name]

    def bounded(*args: Any, **kwargs: Any) -> Any:
        for value in (*args[1:], *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and value > environment.limits.max_value_chars:
                raise environment._refuse(f"passes a width beyond the size bound to the {name} filter")
        return original(*args, **kwargs)

    # Filters that take the environment or context declare it; the wrapper must declare the same.
    if hasattr(original, "jinja_pass_arg"):
        bounded.jinja_pass_arg = original.jinja_pass_arg  # type: ignore[attr-defined]
    environment.filters[name] = bounded


def _bounded_replace_filter(environment: BoundedEnvironment) -> None:
    original = environment.filters["replace"]

    def bounded(*args: Any, **kwargs: Any) -> Any:
        # do_replace(eval_ctx, s, old, new, count=None)
        if len(args) >= 4:
            environment.check_replace(args[1], args[2], args[3])
        return original(*args, **kwargs)

    bounded.jinja_pass_arg = original.jinja_pass_arg  # type: ignore[attr-defined]
    environment.filters["replace"] = bounded


def _bounded_format_filter(environment: BoundedEnvironment) -> None:
    original = environment.filters["format"]

    def bounded(value: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(value, str) and environment.is_wide_format(value):
            raise environment._refuse("formats with a width beyond the size bound")
        return original(value, *args, **kwargs)

    environment.filters["format"] = bounded


def build_environment(limits: RenderLimits) -> BoundedEnvironment:
    environment = BoundedEnvironment(
        limits, trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    for name in SIZING_FILTERS:
        _bounded_filter(environment, name)
    _bounded_format_filter(environment)
    _bounded_replace_filter(environment)
    # lipsum(n) writes n paragraphs of filler; no chat template needs it.
    environment.globals.pop("lipsum", None)
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    return environment


class TemplateCache:
    """Compiled templates by source text; compiling Qwen's template costs more than rendering it."""

    def __init__(self, limits: RenderLimits) -> None:
        self.environment = build_environment(limits)
        self.templates: dict[str, jinja2.Template] = {}

    def get(self, source: str) -> jinja2.Template:
        template = self.templates.pop(source, None)
        if template is None:
            template = self.environment.from_string(source)
            if len(self.templates) >= NUM_CACHED_TEMPLATES:
                self.templates.pop(next(iter(self.templates)))
        # Re-inserted, so the most recently used is last and the first is the one to evict.
        self.templates[source] = template
        return template


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(messages: list[dict[str, Any]], template: str) -> str:
    """Appends the continue tag to the final message's content; returns the text the prompt must end with."""
    final = messages[-1]
    content = final.get("content")
    if content is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in template:
        raise ValueError('continue_final_message is set to "content" but this is not an accepted field in the template')
    if isinstance(content, list):
        for block in reversed(content):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but the final message has no text to continue!")
    final["content"] = content + CONTINUE_TAG
    return content


def _cut_at_tag(rendered: str, final_text: str) -> str:
    if final_text.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the rendered chat: the chat "
            "template deletes part of it."
        )
    at = rendered.rindex(CONTINUE_TAG.strip())
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed the message's trailing whitespace, and the tag's with it.
    return rendered[:at].rstrip()


def _bounded_join(chunks: Iterator[str], max_chars: int) -> str:
    parts: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > max_chars:
            raise RenderLimitError(f"the rendered chat template is longer than {max_chars} characters")
        parts.append(chunk)
    return "".join(parts)


def render(cache: TemplateCache, job: RenderJob) -> str:
    """Renders one chat as transformers' apply_chat_template(tokenize=False) does, within the cache's bounds."""
    if job.continue_final_message and job.add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    if not job.messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    template = cache.get(job.template)
    messages = [_alias_reasoning(dict(message)) for message in job.messages]
    final_text = _tag_final_message(messages, job.template) if job.continue_final_message else None
    context = {**job.kwargs, "messages": messages, "tools": job.tools, "documents": job.documents,
               "add_generation_prompt": job.add_generation_prompt}  # fmt: skip
    rendered = _bounded_join(template.generate(**context), cache.environment.limits.max_output_chars)
    return _cut_at_tag(rendered, final_text) if final_text is not None else rendered
