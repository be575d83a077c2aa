"""Built-in tiny checkpoints: seeded random Qwen3.5 dense / Qwen3.5-MoE / Qwen3-Next models with a real tokenizer.

`make_tiny` writes a Hugging Face folder that transformers and deltaserve both load, a few MB in size, for tests
and for `deltaserve serve` with no model given (`default_model_dir`). The generator (and so torch) is imported on
first use, so that `deltaserve make-tiny --help` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltaserve import env
from deltaserve.tiny.spec import DEFAULT_MODEL_NAME, EXPERT_LAYOUTS, VARIANTS

if TYPE_CHECKING:
    from deltaserve.tiny.generate import default_model_dir, make_tiny

__all__ = ["EXPERT_LAYOUTS", "VARIANTS", "builtin_model_exists", "default_model_dir", "make_tiny"]


def builtin_model_exists() -> bool:
    """Whether the built-in checkpoint is already generated (answered without importing torch)."""
    return (env.cache_dir() / DEFAULT_MODEL_NAME / "config.json").is_file()


def __getattr__(name: str) -> Any:
    if name in ("make_tiny", "default_model_dir"):
        from deltaserve.tiny import generate

        return getattr(generate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
