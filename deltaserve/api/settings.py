"""What the HTTP server knows besides the engine: its settings, the engine interface it codes against, its state.

`EngineClient` is the structural interface of deltaserve.engine.async_engine.AsyncEngine; tests substitute a
scripted fake with the same shape (tests/api/fake_engine.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from deltaserve.engine.request import RequestOutput
from deltaserve.reasoning_config import PARSER_STRINGS
from deltaserve.sampling_params import MAX_LOGPROBS, SamplingParams, resolve_num_logprobs

if TYPE_CHECKING:
    from deltaserve.api.metrics import ServerMetrics
    from deltaserve.api.template_pool import TemplatePool
    from deltaserve.api.tokens import Tokens

# vLLM caps n at VLLM_MAX_N_SEQUENCES (16384); a tighter one keeps a single request from claiming every state slot
# and KV block.
MAX_N = 128
# The largest request body accepted (--max-request-body-bytes); vLLM has no limit. A 262,144-token prompt is
# about 1 MiB of text or 2 MiB of token ids, so this leaves room for batched prompts and long chats.
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# How long a request body may stall between two reads before the request gets a 408 (--timeout-request-body).
DEFAULT_BODY_READ_TIMEOUT_S = 20.0
# The most prompt-logprob entries one completions response may carry (--max-prompt-logprob-entries; vLLM has no
# bound): n x prompt tokens x (prompt_logprobs + 1), plus (logprobs + 1) per prompt token with echo. About 140 MB
# of JSON; docs/limits.md says how it was chosen.
DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES = 2**21

REASONING_PARSERS = tuple(PARSER_STRINGS)
TOOL_CALL_PARSERS = ("qwen3_coder", "qwen3_xml", "hermes")


class EngineClient(Protocol):
    """What the server needs from the engine.

    generate() yields delta RequestOutputs; RequestOutput.num_cached_tokens (prefix-cache hits) and .metrics
    (engine-side timestamps, may be None) feed usage details and /metrics. stats() returns an EngineStats.
    """

    tokenizer: Any
    max_model_len: int
    default_sampling: dict[str, Any]

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    @property
    def is_dead(self) -> bool: ...

    # the core has sent nothing, not even a heartbeat, for its timeout: /health fails while this holds
    @property
    def is_hung(self) -> bool: ...

    # the multimodal processor (deltaserve.multimodal.processor.MultimodalProcessor) when the engine serves images
    # and videos, else None; generate() then takes the processed input as mm_input=
    mm_processor: Any

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> Any: ...

    # drops the prefix cache's unused blocks and checkpoints; False when some were in use (POST /reset_prefix_cache)
    async def reset_prefix_cache(self) -> bool: ...


@dataclass
class ServerSettings:
    """Server-side options from `deltaserve serve`, named after vLLM's flags."""

    model_root: str  # the model as given on the command line: vLLM's ModelCard.root
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)  # --api-key (any of them), else VLLM_API_KEY
    chat_template: str | None = None  # --chat-template, already read from its file
    chat_template_content_format: str = "auto"  # "openai": content parts reach the template as a list
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    trust_request_chat_template: bool = False
    response_role: str = "assistant"
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    # --enable-per-request-metrics: a response's `metrics` (TTFT, queue time, ...) when one stream made it
    enable_per_request_metrics: bool = False
    # --enable-log-requests / --max-log-len: each request's id and SamplingParams logged (its prompt at DEBUG)
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # what responses carry as system_fingerprint (api/fingerprint.py); None: null, as --fingerprint-mode none
    system_fingerprint: str | None = None
    enable_tokenizer_info_endpoint: bool = False
    enable_request_id_headers: bool = False
    disable_fastapi_docs: bool = False
    disable_log_stats: bool = False  # no periodic stats line (api/stat_logger.py)
    log_stats_interval_s: float = 10.0  # VLLM_LOG_STATS_INTERVAL
    server_dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: the development routes (POST /reset_prefix_cache)
    root_path: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    max_logprobs: int = MAX_LOGPROBS  # -1: no cap but the vocabulary (ServerState.max_logprobs resolves it)
    max_prompt_logprob_entries: int = DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES
    scheduling_policy: str = "fcfs"  # --scheduling-policy (the engine's too): a request priority needs "priority"
    host: str = "127.0.0.1"
    port: int = 8000
    is_https: bool = False
    # CORS: no origin is allowed unless --allowed-origins names it (vLLM 0.26 still defaults to "*").
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # Chat templates render in worker processes: how many, the time bound of one render, a worker's address space.
    num_template_workers: int = 2
    template_timeout_s: float = 5.0
    template_memory_bytes: int = 2 * 2**30

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose from {REASONING_PARSERS}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; choose from {TOOL_CALL_PARSERS}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}")
        if not self.body_read_timeout_s > 0:
            raise ValueError(f"body_read_timeout_s must be positive, got {self.body_read_timeout_s}")
        if self.max_prompt_logprob_entries < 1:
            raise ValueError(f"max_prompt_logprob_entries must be positive, got {self.max_prompt_logprob_entries}")

    @property
    def model_name(self) -> str:
        """The name responses carry and metrics are labelled with: the first served name."""
        return self.served_model_names[0]


@dataclass
class ServerState:
    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    tokens: Tokens
    templates: TemplatePool
    created: int = field(default_factory=lambda: int(time.time()))
    num_inflight: int = 0  # generation requests being served: GET /load's server_load

    @property
    def vocab_size(self) -> int:
        """Token-id bounds: the model's vocabulary (config vocab_size, as vLLM bounds logit_bias), which pads past
        the tokenizer's; an engine that does not say falls back to the tokenizer's length."""
        return getattr(self.engine, "vocab_size", None) or len(self.engine.tokenizer)

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for per position: --max-logprobs, whose -1 (vLLM's "no cap") is the
        vocabulary."""
        return resolve_num_logprobs(self.settings.max_logprobs, self.vocab_size)
