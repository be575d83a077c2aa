"""Chat requests -> the prompt: message normalisation, the Jinja chat template, chat_template_kwargs, the token ids
and the processed images and videos (render_prompt), and the chat fields' checks (template trust, tools).

The template comes from the request (`chat_template`, only under --trust-request-chat-template, as in vLLM), else
`--chat-template`, else the checkpoint's tokenizer. Template kwargs are `--default-chat-template-kwargs`, overridden
by the request's `chat_template_kwargs`, overridden by what vLLM derives from the request (`reasoning_effort`, and
`enable_thinking = reasoning_effort != "none"` unless the request sets enable_thinking itself).

Rendering happens in a template worker process (template_pool.py); the message conversion before it runs on a
worker thread, so neither a hostile template nor a huge conversation touches the event loop.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from deltaserve.api.body import gc_paused
from deltaserve.api.errors import bad_request
from deltaserve.api.protocol import ChatCompletionRequest, ChatMessage, ContentPart, ToolDefinition
from deltaserve.api.settings import ServerState
from deltaserve.api.template import RenderJob
from deltaserve.api.template_pool import TemplateRenderError
from deltaserve.api.tokens import truncation_length
from deltaserve.engine.offline_chat import (  # shared with the offline LLM.chat
    RESERVED_TEMPLATE_KWARGS,
    TEXT_PART_FIELDS,
    TEXT_PART_TYPES,
)

logger = logging.getLogger(__name__)

UNTRUSTED_TEMPLATE_MESSAGE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)

# image / video parts (OpenAI's image_url, vLLM's video_url) and what the chat template sees for each
MEDIA_PART_TYPES = {"image_url": "image", "video_url": "video"}


def part_type(part: ContentPart | str) -> str:
    return "text" if isinstance(part, str) else part.type


def part_text(part: ContentPart | str) -> str | None:
    """A text part's text (a bare string is one), from the field its type keeps it in; None for other parts."""
    if isinstance(part, str):
        return part
    field = TEXT_PART_FIELDS.get(part.type)
    return getattr(part, field) if field is not None else None


def has_media(messages: list[ChatMessage]) -> bool:
    return any(
        isinstance(m.content, list) and any(part_type(part) in MEDIA_PART_TYPES for part in m.content) for m in messages
    )


def content_text(message: ChatMessage, index: int, allow_media: bool = False) -> str | None:
    """Content as text: parts are joined with newlines as vLLM's 'string' content format does. Media parts are
    refused unless the engine serves images and videos (then the template gets content lists instead)."""
    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part_type(part)
        if kind in MEDIA_PART_TYPES and allow_media:
            continue
        if kind not in TEXT_PART_TYPES:
            reason = (
                "this model is served as text only (no vision tower)"
                if kind in MEDIA_PART_TYPES
                else "deltaserve reads text, refusal, thinking, image_url and video_url parts"
            )
            raise bad_request(f"Content part type {kind!r} is not supported: {reason}.", f"messages.{index}.content")
        text = part_text(part)
        if text:  # vLLM drops a text part without text (no empty line in the join)
            texts.append(text)
    return "\n".join(texts)


def _media_content(message: ChatMessage) -> list[dict[str, Any]]:
    """A message's parts as the Qwen3.5 template renders them: text parts and {"type": "image" | "video"} markers
    in their order (the template writes each marker's vision_start + pad + vision_end)."""
    parts = []
    for part in message.content:
        if part_type(part) in MEDIA_PART_TYPES:
            parts.append({"type": MEDIA_PART_TYPES[part.type]})
        elif text := part_text(part):
            parts.append({"type": "text", "text": text})
    return parts


def _tool_call_dict(call: Any, index: int) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        # Qwen's template iterates arguments|items, so a JSON string is parsed into a mapping (as vLLM does).
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad_request(
                f"tool_calls arguments must be a JSON object, got {arguments[:100]!r}.", f"messages.{index}.tool_calls"
            ) from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments or {}}}


def to_template_messages(
    messages: list[ChatMessage], content_format: str = "auto", allow_media: bool = False
) -> list[dict[str, Any]]:
    """Messages as the template sees them; with content_format "openai" content is a list of text parts, and a
    message with image or video parts always keeps its parts as a list (the template places the media)."""
    converted = []
    for index, message in enumerate(messages):
        item: dict[str, Any] = {**(message.model_extra or {}), "role": message.role}
        content: Any = content_text(message, index, allow_media)
        if (
            allow_media
            and isinstance(message.content, list)
            and any(part_type(part) in MEDIA_PART_TYPES for part in message.content)
        ):
            content = _media_content(message)
        elif content_format == "openai" and content is not None:
            parts = message.content if isinstance(message.content, list) else [message.content]
            content = [{"type": "text", "text": text} for part in parts if (text := part_text(part))]
        item["content"] = content if content is not None or message.tool_calls else ""
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [_tool_call_dict(call, index) for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
        if reasoning is not None:
            item["reasoning"] = item["reasoning_content"] = reasoning
        converted.append(item)
    return converted


def template_kwargs(
    state: ServerState, request_kwargs: dict[str, Any] | None, reasoning_effort: str | None = None
) -> dict[str, Any]:
    """Server defaults < request chat_template_kwargs < what reasoning_effort implies (vLLM's merge order)."""
    merged = {**state.settings.default_chat_template_kwargs, **(request_kwargs or {})}
    if reasoning_effort is not None:
        merged["reasoning_effort"] = reasoning_effort
        if "enable_thinking" not in (request_kwargs or {}):
            merged["enable_thinking"] = reasoning_effort != "none"
    return {key: value for key, value in merged.items() if key not in RESERVED_TEMPLATE_KWARGS}


def check_request_template(state: ServerState, chat_template: str | None, kwargs: dict[str, Any] | None) -> None:
    """vLLM refuses a template sent with the request unless the server trusts them."""
    if state.settings.trust_request_chat_template:
        return
    if chat_template is not None or (kwargs and kwargs.get("chat_template") is not None):
        raise bad_request(UNTRUSTED_TEMPLATE_MESSAGE, "chat_template")


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    # transformers passes these (bos_token, eos_token, ...) to every template.
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {key: value for key, value in tokens.items() if isinstance(value, str | list)}


async def render_chat(
    state: ServerState,
    messages: list[ChatMessage],
    *,
    tools: list[ToolDefinition] | None,
    chat_template: str | None,
    kwargs: dict[str, Any],
    add_generation_prompt: bool,
    continue_final_message: bool,
    documents: list[dict[str, str]] | None = None,
) -> str:
    """The rendered prompt text; template errors (raise_exception, bad roles, overruns) are 400s."""
    tokenizer = state.engine.tokenizer
    template = chat_template or state.settings.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("The model has no chat template; pass --chat-template or use /v1/completions.")
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "continue_final_message"
        )
    if continue_final_message and messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs a final assistant message.", "continue_final_message")

    def build_job() -> RenderJob:
        with gc_paused():
            return _build_job()

    def _build_job() -> RenderJob:
        return RenderJob(
            template=template,
            messages=[
                _without_none(item)
                for item in to_template_messages(
                    messages, state.settings.chat_template_content_format, state.engine.mm_processor is not None
                )
            ],
            tools=[tool.model_dump(exclude_none=True) for tool in tools] if tools else None,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            kwargs={**_special_tokens(tokenizer), **kwargs},
        )

    job = await state.tokens.run(build_job)
    try:
        return await state.templates.render(job, is_request_template=chat_template is not None)
    except TemplateRenderError as exc:
        message = str(exc)
        logger.info("chat template error: %s", message)
        raise bad_request(f"The chat template failed to render: {message}", "messages") from None


def _without_none(message: dict[str, Any]) -> dict[str, Any]:
    # transformers drops None-valued keys: templates test for a key's presence, not for None.
    return {key: value for key, value in message.items() if value is not None}


def check_tool_choice(state: ServerState, tools: list[ToolDefinition] | None, tool_choice: Any) -> str | None:
    """Validates tools/tool_choice as vLLM does; returns the effective choice (None: tools are not parsed)."""
    if tools == []:
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools"
        )
    settings = state.settings
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tool_choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice"
            )
        return "auto"
    if tool_choice == "required":
        return "required"
    names = {tool.function.name for tool in tools}
    if tool_choice.function.name not in names:
        raise bad_request(
            f"Tool choice names the function {tool_choice.function.name!r}, which is not in `tools`.", "tool_choice"
        )
    return tool_choice.function.name


@dataclass
class ChatPrompt:
    """A rendered chat prompt: its text, its token ids and, with images or videos, their processed input."""

    text: str
    token_ids: list[int]
    mm_input: Any  # a deltaserve.multimodal MultimodalInput; None for text
    is_thinking_disabled: bool  # the template kwargs turn thinking off


async def render_prompt(state: ServerState, request: ChatCompletionRequest) -> ChatPrompt:
    """The messages through the chat template, then tokenised (truncate_prompt_tokens applied); images and videos
    are fetched, preprocessed and expanded into their placeholder tokens. Every failure is a 400."""
    kwargs = template_kwargs(state, request.chat_template_kwargs, request.reasoning_effort)
    hide_tools = state.settings.exclude_tools_when_tool_choice_none and request.tool_choice == "none"
    text = await render_chat(
        state,
        request.messages,
        tools=None if hide_tools else request.tools,
        chat_template=request.chat_template,
        kwargs=kwargs,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        documents=request.documents,
    )
    refs = _media_refs(state, request.messages)
    max_model_len = state.engine.max_model_len
    token_ids, _ = await state.tokens.encode(
        text,
        add_special_tokens=request.add_special_tokens,
        max_input_tokens=max_model_len,
        truncate=truncation_length(request.truncate_prompt_tokens, max_model_len),
        truncation_side=request.truncation_side,
        param="messages",
    )
    mm_input = None
    if refs is not None:
        kwargs_mm = (request.model_extra or {}).get("mm_processor_kwargs")
        if kwargs_mm is not None and not isinstance(kwargs_mm, dict):
            raise bad_request("mm_processor_kwargs must be an object.", "mm_processor_kwargs")
        try:
            # fetch, decode and preprocess off the event loop (Pillow, PyAV and the resize are CPU-heavy)
            token_ids, mm_input = await state.tokens.run(
                lambda: state.engine.mm_processor.process(list(token_ids), refs, kwargs_mm)
            )
        except ValueError as exc:  # a MediaError: corrupt bytes, wrong type, too many pixels, placeholder mismatch
            raise bad_request(str(exc), getattr(exc, "param", None) or "messages") from None
    is_thinking_disabled = kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False
    return ChatPrompt(text, list(token_ids), mm_input, is_thinking_disabled)


def _media_refs(state: ServerState, messages: list[ChatMessage]) -> Any:
    """The messages' image and video references (None without any); 400 when the model is served as text only."""
    if not has_media(messages):
        return None
    processor = state.engine.mm_processor
    if processor is None:
        index = next(i for i, m in enumerate(messages) if has_media([m]))
        raise bad_request("Image and video content parts are not supported: this model is served as text only.",
                          f"messages.{index}.content")  # fmt: skip
    try:
        return processor.parse_messages([m.model_dump(exclude_none=True) for m in messages])
    except ValueError as exc:  # a MediaError: a bad URL, a path outside the allowed folder, over the limits
        raise bad_request(str(exc), getattr(exc, "param", None) or "messages") from None
