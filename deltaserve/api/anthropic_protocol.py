"""The request bodies of POST /v1/messages and /v1/messages/count_tokens, Anthropic's Messages API as vLLM 0.26
models it (vllm/entrypoints/anthropic/protocol.py): its fields, defaults and checks.

Fields vLLM's models do not have (Anthropic's `thinking`, `service_tier`, `container`, ...) are accepted and logged
as ignored (vLLM drops them in silence); the content blocks keep vLLM's flat shape, one model for every block type.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class AnthropicModel(BaseModel):
    # extra fields are kept so that they can be logged as ignored (serving_anthropic.py)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, protected_namespaces=())


class ContentBlock(AnthropicModel):
    """One content block: text, image, tool_use, tool_result, tool_reference, thinking or redacted_thinking."""

    type: Literal["text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking"]
    text: str | None = None
    source: dict[str, Any] | None = None  # an image's: {"type": "base64", "media_type", "data"} or {"type": "url"}
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    tool_name: str | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class Message(AnthropicModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(AnthropicModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_by_default(cls, value: dict[str, Any]) -> dict[str, Any]:
        return value if "type" in value else {**value, "type": "object"}  # vLLM's default


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice.name is required when type is 'tool'")  # vLLM's words
        return self


class JsonOutputFormat(AnthropicModel):
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    type: Literal["json_schema"] = "json_schema"


class OutputConfig(AnthropicModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(AnthropicModel):
    model: str
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's addition

    @field_validator("model")
    @classmethod
    def _model_given(cls, value: str) -> str:
        if not value:
            raise ValueError("Model is required")  # vLLM's words
        return value


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    # vLLM's disaggregation parameters, which need a connector deltaserve does not have (logged when set)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("max_tokens must be positive")  # vLLM's words
        return value
