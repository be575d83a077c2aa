"""deltaserve: an inference engine for the Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid model family.

The offline API mirrors vLLM's: `LLM(model_dir).generate(prompts, SamplingParams(...))`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltaserve.engine.request import CompletionOutput, RequestOutput, TextPrompt, TokensPrompt
from deltaserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from deltaserve.engine.llm import LLM


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the model; import it lazily so `import deltaserve` stays cheap.
    if name == "LLM":
        from deltaserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]
