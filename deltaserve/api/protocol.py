"""Request bodies of the OpenAI-compatible API as pydantic models, with vLLM's field names and defaults.

Unknown fields are accepted and ignored (vLLM's OpenAIBaseModel allows extras). Sampling fields default to None
so that the server can tell "unset" (take the model's generation_config default) from an explicit value.
Responses are built as plain dicts by the serving modules.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIModel(BaseModel):
    # NaN/Infinity never reach the sampler; extra fields are ignored as vLLM does.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, protected_namespaces=())


class StreamOptions(APIModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingRequest(APIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    use_beam_search: bool = False
    return_tokens_as_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None
    priority: int = 0


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class FunctionDefinition(APIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(APIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(APIModel):
    name: str


class NamedToolChoice(APIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ContentPart(APIModel):
    type: str
    text: str | None = None


class ToolCallFunction(APIModel):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(APIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(APIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    include_reasoning: bool = True
    echo: bool = False


class TokenizeCompletionRequest(APIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(APIModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None


class DetokenizeRequest(APIModel):
    model: str | None = None
    tokens: list[int]


# Structured-output fields that need constrained decoding, which the engine does not have: refused, not ignored.
UNSUPPORTED_STRUCTURED_FIELDS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)
