"""deltaserve: an inference engine for the Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid model family.

The offline API mirrors vLLM's: `LLM(model_dir).generate(prompts, SamplingParams(...))`, and for scripts that step
the engine themselves `LLMEngine.from_engine_args(EngineArgs(model=model_dir))`, or with asyncio
`AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model_dir))`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltaserve.engine.request import CompletionOutput, RequestOutput, TextPrompt, TokensPrompt
from deltaserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from deltaserve.version import __version__

if TYPE_CHECKING:
    from deltaserve.engine.async_llm import AsyncLLM, AsyncLLMEngine
    from deltaserve.engine.engine import LLMEngine
    from deltaserve.engine.llm import LLM
    from deltaserve.engine_args import AsyncEngineArgs, EngineArgs


def __getattr__(name: str) -> Any:
    # LLM and LLMEngine pull in torch and the model; import them lazily so `import deltaserve` stays cheap.
    if name == "LLM":
        from deltaserve.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from deltaserve.engine.engine import LLMEngine

        return LLMEngine
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from deltaserve import engine_args

        return getattr(engine_args, name)
    if name in ("AsyncLLM", "AsyncLLMEngine"):
        from deltaserve.engine import async_llm

        return getattr(async_llm, name)
    raise AttributeError(name)


__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMEngine",
    "EngineArgs",
    "LLMEngine",
    "BeamSearchParams",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]
