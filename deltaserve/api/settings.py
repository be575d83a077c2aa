"""What the HTTP server knows besides the engine: its settings, the engine interface it codes against, its state.

`EngineClient` is the structural interface of deltaserve.engine.async_engine.AsyncEngine; tests substitute a
scripted fake with the same shape.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from deltaserve.engine.request import RequestOutput
from deltaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deltaserve.api.metrics import ServerMetrics

# vLLM has no cap on n; one keeps a single request from claiming every state slot and KV block.
MAX_N = 128
# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20

REASONING_PARSERS = ("qwen3",)
TOOL_CALL_PARSERS = ("qwen3_coder", "qwen3_xml")


class EngineClient(Protocol):
    tokenizer: Any
    max_model_len: int
    default_sampling: dict[str, Any]

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    @property
    def is_dead(self) -> bool: ...

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> Any: ...


@dataclass
class ServerSettings:
    """Server-side options from `deltaserve serve`, named after vLLM's flags."""

    model_root: str  # the model as given on the command line: vLLM's ModelCard.root
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None  # --chat-template, already read from its file
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    # CORS, with vLLM's defaults (everything allowed), so browser clients work unchanged.
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose from {REASONING_PARSERS}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; choose from {TOOL_CALL_PARSERS}")

    @property
    def model_name(self) -> str:
        """The name responses carry and metrics are labelled with: the first served name."""
        return self.served_model_names[0]


@dataclass
class ServerState:
    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    num_inflight: int = 0  # generation requests being served: GET /load's server_load

    @property
    def vocab_size(self) -> int:
        return len(self.engine.tokenizer)
