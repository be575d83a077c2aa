"""The body of POST /v1/responses (vLLM's ResponsesRequest fields) and its translation into a chat request.

A Responses request is served through the chat path: `to_chat_request` turns `instructions` + `input` into chat
messages (a string is one user turn; message, reasoning, function_call and function_call_output items become the
system / user / assistant / tool turns of the chat template, merged as vLLM merges them), the flat function tools
into chat tools (none under tool_choice "none", as vLLM renders them), `tool_choice`, `reasoning.effort`,
`text.format`, `max_output_tokens`, `truncation`, `include`, `include_reasoning` and `chat_template_kwargs` into
their chat fields. Sampling fields are the chat path's own (vLLM's Responses fields, plus deltaserve's sampling
extensions such as min_p, which vLLM's Responses endpoint ignores).

Refused in vLLM's envelope, as vLLM 0.26 refuses them with its response store off (its default): a
`previous_response_id` (404: nothing is stored), `background` (400), a `prompt` template (400),
`enable_response_messages`, and vLLM's tool_choice checks (a 400 for "required" or a named function without
`tools`, or a name that no tool has; without tools "auto" is echoed as "none"), the validators' errors naming
their field as vLLM's do. Refused where vLLM would silently drop them: built-in tools (no tool server),
`conversation`, input items other than messages, reasoning, function calls and their outputs, and file or audio
parts. input_image parts go to the chat path as image_url parts (served with a vision tower, refused without one).
`store` is accepted and ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from deltaserve.api.errors import APIError, ParamValueError, bad_request
from deltaserve.api.protocol import APIModel, ChatCompletionRequest, SamplingRequest
from deltaserve.api.sampling import log_ignored_fields

INCLUDABLE = Literal[
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
]
# SamplingRequest fields a Responses body may carry as well (deltaserve's sampling extensions); the others have no
# place in a Response (n > 1, prompt logprobs, token ids) and are ignored like any unknown field.
NOT_PASSED = frozenset({"n", "stream", "stream_options", "prompt_logprobs", "return_token_ids", "model", "request_id"})
PASSED_SAMPLING_FIELDS = frozenset(SamplingRequest.model_fields) - NOT_PASSED
# Content parts read as text; input_image goes to the chat path as image_url, file and audio parts are refused.
TEXT_PARTS = ("input_text", "output_text", "text")
REFUSED_PARTS = {"input_file": "file", "input_audio": "audio"}


class ReasoningConfig(APIModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(APIModel):
    """vLLM's ResponsesRequest fields that deltaserve reads; SamplingRequest fields ride along as extras."""

    @model_validator(mode="before")
    @classmethod
    def _vllm_checks(cls, data: Any) -> Any:
        """vLLM's ResponsesRequest validators, in their words and fields: validate_background, validate_prompt,
        check_tool_usage (without tools, "auto" and "none" become "none"; "required" or a named function is
        refused; a named function must be one of the tools)."""
        if not isinstance(data, dict):
            return data
        if data.get("background") and not data.get("store", True):
            raise ParamValueError("background can only be used when `store` is true", "background")
        if data.get("prompt") is not None:
            raise ParamValueError("prompt template is not supported", "prompt")
        tools, choice = data.get("tools"), data.get("tool_choice", "auto")
        is_named = isinstance(choice, dict) and choice.get("type") == "function"
        if not tools:
            if choice in ("auto", "none"):
                return {**data, "tool_choice": "none"}
            if choice == "required":
                raise ParamValueError("Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
        names = {tool.get("name") for tool in tools or [] if isinstance(tool, dict)}
        if is_named and (not choice.get("name") or choice["name"] not in names):
            raise ParamValueError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        return data

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_logprobs: int | None = 0
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    include: list[INCLUDABLE] | None = None
    request_id: str | None = None
    enable_response_messages: bool = False
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning (and the logprobs) out of the output
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.include) and "message.output_text.logprobs" in self.include


def check_unsupported(request: ResponsesRequest) -> None:
    """The parts deltaserve does not serve, refused before any work (vLLM's checks first, in its order)."""
    if request.background:
        raise APIError(
            "This server does not store responses (store=true is accepted and ignored) and therefore does not "
            "support the background mode.",
            err_type="invalid_request_error",
            param="background",
        )
    if request.previous_response_id is not None:
        raise APIError(
            f"Response with id '{request.previous_response_id}' not found.",
            status=404,
            err_type="invalid_request_error",
            param="response_id",
        )
    if request.enable_response_messages:
        raise bad_request("enable_response_messages is not supported.", "enable_response_messages")
    if (request.model_extra or {}).get("conversation") is not None:
        raise bad_request("conversation is not supported: this server does not store responses.", "conversation")


def _part_text(part: Any, param: str) -> str:
    """A text part's text; file and audio parts (and anything unknown) are refused."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        return part.get("text") or ""
    if kind == "refusal":
        return part.get("refusal") or ""
    what = REFUSED_PARTS.get(kind, "this kind of")
    raise bad_request(f"Content part type {kind!r} is not supported: deltaserve does not read {what} input.", param)


def _text_of(content: Any, param: str) -> str:
    """Content as text: a string, or its parts' texts joined with newlines (the chat path's rule)."""
    if isinstance(content, str):
        return content
    return "\n".join(_part_text(part, f"{param}.{index}") for index, part in enumerate(content or []))


def _message_content(content: Any, param: str) -> Any:
    """A user / system message's content as chat content: a string, or parts (images become image_url parts,
    which the chat path serves, or refuses for a text-only model)."""
    if isinstance(content, str) or not any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return _text_of(content, param)
    parts = []
    for index, part in enumerate(content):
        if part.get("type") != "input_image":
            parts.append({"type": "text", "text": _part_text(part, f"{param}.{index}")})
        elif part.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise bad_request("input_image parts need an image_url (file ids are not supported).",
                              f"{param}.{index}")  # fmt: skip
    return parts


def _assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def input_messages(request: ResponsesRequest) -> tuple[list[dict[str, Any]], bool]:
    """(the chat messages of instructions + input, whether the last one is an unfinished assistant message that
    the model continues). Consecutive assistant items (reasoning, text, calls) merge into one turn, as in vLLM."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        return [*messages, {"role": "user", "content": request.input}], False
    is_partial = False
    for index, item in enumerate(request.input):
        param = f"input.{index}"
        kind = item.get("type", "message")
        previous = _assistant(messages)
        if kind == "message" and item.get("role") != "assistant":
            if item.get("role") not in ("user", "system", "developer"):
                raise bad_request(f"Unknown message role {item.get('role')!r}.", f"{param}.role")
            content = _message_content(item.get("content"), f"{param}.content")
            messages.append({"role": item["role"], "content": content})
        elif kind == "message":
            text = _text_of(item.get("content"), f"{param}.content")
            if previous is not None and previous.get("content") is None:
                previous["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise bad_request("Encrypted content is not supported.", f"{param}.encrypted_content")
            parts = item.get("content") or item.get("summary") or []
            reasoning = (parts[0].get("text") or "") if parts else ""
            if previous is not None and previous.get("reasoning") is None:
                previous["reasoning"] = reasoning
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}}  # fmt: skip
            if previous is not None:
                previous.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text_of(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
        else:
            raise bad_request(f"Input items of type {kind!r} are not supported.", f"{param}.type")
        is_partial = kind in ("message", "reasoning") and item.get("status") in ("in_progress", "incomplete")
    if not messages:
        raise bad_request("input must not be empty.", "input")
    return messages, is_partial and messages[-1]["role"] == "assistant"


def chat_tools(request: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The tools the prompt gets: none under tool_choice "none", as vLLM's construct_tool_dicts gives none (its chat
    endpoint keeps them)."""
    tools = function_tools(request)
    return tools if tools and request.tool_choice != "none" else None


def function_tools(request: ResponsesRequest) -> list[dict[str, Any]]:
    """Flat Responses function tools as chat tools; built-in tools are refused (no tool server)."""
    tools = []
    for index, tool in enumerate(request.tools):
        if tool.get("type") != "function":
            raise bad_request(f"Tool type {tool.get('type')!r} is not supported: deltaserve serves function tools "
                              "only (no built-in tools).", f"tools.{index}.type")  # fmt: skip
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(request: ResponsesRequest, has_tools: bool) -> Any:
    choice = request.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise bad_request(f"tool_choice {choice!r} is not supported: use none, auto, required or "
                              '{"type": "function", "name": ...}.', "tool_choice")  # fmt: skip
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice {choice!r} is not supported.", "tool_choice")
    return choice if has_tools else None  # no tools: "none" (the request's checks refused the rest)


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format -> the chat response_format (json_schema as vLLM maps it; json_object and text too)."""
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name") or "response", "schema": fmt.get("schema"), "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise bad_request(f"text.format type {fmt.get('type')!r} is not supported.", "text.format")


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves a Responses request (its checks are the chat path's)."""
    messages, is_partial = input_messages(request)
    tools = chat_tools(request)
    extra = request.model_extra or {}
    passed = {name: value for name, value in extra.items() if name in PASSED_SAMPLING_FIELDS}
    unknown = {name: value for name, value in extra.items() if name not in ChatCompletionRequest.model_fields}
    dropped = {name: value for name, value in extra.items() if name not in passed and name not in unknown}
    if dropped:  # chat-only names (messages, max_tokens, ...) mean nothing here; logged as ignored
        log_ignored_fields(APIModel.model_validate(dropped))
    body: dict[str, Any] = {
        **unknown,  # refused (UNSUPPORTED_FIELDS) or logged as ignored by the chat path's checks
        **passed,
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "tools": tools,
        "tool_choice": chat_tool_choice(request, tools is not None),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": response_format(request.text),
        "reasoning_effort": request.reasoning.effort if request.reasoning else None,
        "include_reasoning": request.include_reasoning,
        "chat_template_kwargs": request.chat_template_kwargs,
        "logprobs": request.wants_logprobs,
        "top_logprobs": (request.top_logprobs or 0) if request.wants_logprobs else None,
        "add_generation_prompt": not is_partial,
        "continue_final_message": is_partial,
        "stream": request.stream,
    }
    if request.truncation == "auto":
        body["truncate_prompt_tokens"] = -1  # vLLM: keep the last max_model_len tokens
    return ChatCompletionRequest.model_validate(body)
