"""Request bodies of the OpenAI-compatible API as pydantic models, with vLLM's field names and defaults.

Unknown fields are accepted, ignored and logged (vLLM's OpenAIBaseModel allows extras). Sampling fields default to
None so that the server can tell "unset" (take the model's generation_config default) from an explicit value.
`stream_options` without `stream` is refused as vLLM refuses it. A completion prompt is validated by its shape in
Python rather than as a four-way pydantic union, which walks a million-token list several times.
Responses are built as plain dicts by the serving modules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from deltaserve import env
from deltaserve.api.errors import ParamValueError
from deltaserve.sampling_params import (
    BUDGET_MESSAGE,
    ParamError,
    RepetitionDetectionParams,
    check_thinking_token_budget,
)

TOKEN_IDS = TypeAdapter(list[int])
TOKEN_ID_LISTS = TypeAdapter(list[list[int]])
TEXTS = TypeAdapter(list[str])
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class APIModel(BaseModel):
    # NaN/Infinity never reach the sampler; extra fields are ignored as vLLM does.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, protected_namespaces=())


class StreamOptions(APIModel):
    # False as in vLLM since PR #36379: an empty stream_options object asks for no usage chunk
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_listed_and_prompt_logprobs(data: dict[str, Any], is_chat: bool) -> None:
    """The first checks of vLLM's check_logprobs (its request models' validator): logprob_token_ids against beam
    search (and, for completions, echo without generation) and without logprobs, then prompt_logprobs. A value that
    is not an int is left to the field's own validation."""
    if data.get("logprob_token_ids"):
        if data.get("use_beam_search"):
            raise ParamValueError("`logprob_token_ids` is not supported with beam search.", "logprob_token_ids")
        if is_chat and not data.get("logprobs"):
            raise ParamValueError("when using `logprob_token_ids`, `logprobs` must be set to true.",
                                  "logprob_token_ids")  # fmt: skip
        if not is_chat and data.get("echo") and data.get("max_tokens") == 0:
            raise ParamValueError("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because "
                                  "no output tokens are generated.", "logprob_token_ids")  # fmt: skip
        if not is_chat and data.get("logprobs") is None:
            raise ParamValueError("when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids")
    count = data.get("prompt_logprobs")
    if _is_int(count):
        if data.get("stream") and (count > 0 or count == -1):
            raise ParamValueError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if count < -1:
            raise ParamValueError("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", count)


class SamplingRequest(APIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extensions)."""

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        # vLLM's check, truthiness included: an empty stream_options object passes.
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ParamValueError("Stream options can only be defined when `stream=True`.", "stream_options")
        return data

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # vLLM's bounds: a 400 from validation
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # vLLM's: logprobs of these token ids at each generated position instead of a top-N (needs logprobs)
    logprob_token_ids: list[int] | None = None
    return_token_ids: bool | None = None
    # structured outputs: vLLM's object, and the older guided_* names (mapped onto it)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    use_beam_search: bool = False
    return_tokens_as_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None
    # vLLM's field and bounds: an int64; anything but 0 needs --scheduling-policy priority (lower runs first)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    # vLLM's: a non-negative int, or -1 (None) for no budget; needs --reasoning-parser / --reasoning-config
    thinking_token_budget: int | None = None
    # vLLM's: stop on a repeated token pattern (finish_reason "repetition")
    repetition_detection: RepetitionDetectionParams | None = None

    @field_validator("thinking_token_budget", mode="before")
    @classmethod
    def _thinking_token_budget(cls, value: Any) -> Any:
        # vLLM's ThinkingTokenBudget validator, before pydantic's int coercion (so 1.0 and true are refused)
        try:
            return check_thinking_token_budget(value)
        except ParamError as exc:
            raise ParamValueError(BUDGET_MESSAGE, exc.param, value) from None


class CompletionRequest(SamplingRequest):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]], checked by _prompt_shape
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    length_penalty: float = 1.0  # beam search: a finished beam's score is cumulative logprob / length ** this

    @model_validator(mode="before")
    @classmethod
    def _check_logprobs(cls, data: Any) -> Any:
        # vLLM's completion check_logprobs, in its order and words
        if isinstance(data, dict):
            _check_listed_and_prompt_logprobs(data, is_chat=False)
            if _is_int(count := data.get("logprobs")) and count < 0:
                raise ParamValueError("`logprobs` must be a positive value.", "logprobs", count)
        return data

    @model_validator(mode="before")
    @classmethod
    def _prompt_list_length(cls, data: Any) -> Any:
        # vLLM's bound on the prompts one request batches (a list of token ids is one prompt; vLLM looks at the
        # first item only)
        prompt = data.get("prompt") if isinstance(data, dict) else None
        is_batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        if is_batch and len(prompt) > (most := env.max_completion_prompts()):
            raise ParamValueError(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of {most}. To increase this "
                "limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
                "prompt",
            )
        return data

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_max_tokens_is_the_default(cls, value: Any) -> Any:
        # vLLM's normalize_null_max_tokens: an explicit null is the default 16, not "the rest of the context"
        return 16 if value is None else value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists")
        if not value:
            return value
        first = value[0]
        if isinstance(first, str):
            return TEXTS.validate_python(value)
        if isinstance(first, list):
            return TOKEN_ID_LISTS.validate_python(value)
        return TOKEN_IDS.validate_python(value)


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
    refusal: str | None = None  # a "refusal" part's text
    thinking: str | None = None  # a "thinking" part's text


class ToolCallFunction(APIModel):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(APIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(APIModel):
    role: str
    content: str | list[ContentPart | str] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: the response carries `prompt_text`, the prompt the chat template rendered (a stream: its first chunk)
    return_prompt_text: bool | None = None
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
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_logprobs(cls, data: Any) -> Any:
        # vLLM's chat check_logprobs, in its order and words
        if isinstance(data, dict):
            _check_listed_and_prompt_logprobs(data, is_chat=True)
            top = data.get("top_logprobs")
            if _is_int(top) and top < -1:
                raise ParamValueError("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
            if _is_int(top) and (top == -1 or top > 0) and not data.get("logprobs"):
                raise ParamValueError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        return data


class BatchChatCompletionRequest(APIModel):
    """vLLM's /v1/chat/completions/batch body: `messages` is a non-empty list of non-empty conversations; every other
    field is a chat request's, passed through as one (chat_requests). What one non-streamed choice per
    conversation cannot carry is refused up front, in vLLM's words (stream and tools: see docs/compatibility.md)."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(min_length=1)
    tool_choice: Literal["none"] | None = "none"  # vLLM's: tools are refused, so no other choice is valid

    @model_validator(mode="before")
    @classmethod
    def _check_batch_mode(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("use_beam_search"):
            raise ValueError(
                "Batch chat completions do not support beam search. Please set `use_beam_search` to False."
            )
        if data.get("logprob_token_ids") and not data.get("logprobs"):
            raise ValueError("when using `logprob_token_ids`, `logprobs` must be set to true.")
        n = data.get("n", 1)
        if n is not None and n != 1:
            raise ValueError("Batch chat completions do not support `n > 1`. Please set `n` to 1.")
        if data.get("stream"):
            raise ValueError("Batch chat completions do not support streaming. Please set `stream` to False.")
        if data.get("tools") is not None:
            raise ValueError("Batch chat completions do not support tool use. Please omit `tools`.")
        return data

    def chat_requests(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation, as vLLM's to_chat_completion_request builds them: the other fields,
        those set to null left out, validated once as a chat request (a bad value is that request's 400)."""
        shared = {name: value for name, value in (self.model_extra or {}).items() if value is not None}
        if self.tool_choice is not None:
            shared["tool_choice"] = self.tool_choice
        first = ChatCompletionRequest.model_validate({**shared, "messages": self.messages[0]})
        return [first, *(first.model_copy(update={"messages": messages}) for messages in self.messages[1:])]


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


# vLLM request fields that would change the tokens if they were dropped, and that the engine cannot honour:
# refused by name (field -> what it needs), never silently ignored.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "structural_tag": "structured outputs",
    "prompt_embeds": "prompt embeddings; send text or token ids",
    "logits_processors": "custom logits processors",
    "min_tokens_per_step": "per-step token minimums",
}
# vLLM request fields that cannot change a token here (they steer scheduling, caching, transfer or extensions):
# accepted, and logged as ignored in vLLM's words.
# (cache_salt is not among them: the prefix cache honours it, api/sampling.py cache_salt_of.)
IGNORED_FIELDS = frozenset({
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "media_io_kwargs", "return_token_offsets", "return_assistant_tokens_mask",
    "service_tier", "store", "metadata", "prediction", "modalities", "audio", "web_search_options",
    "safety_identifier", "prompt_cache_key", "verbosity",
})  # fmt: skip
