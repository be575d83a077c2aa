"""Built-in tiny checkpoints: seeded random Qwen3.5 dense / Qwen3.5-MoE / Qwen3-Next models with a real tokenizer.

`make_tiny` writes a Hugging Face folder that transformers and deltaserve both load, a few MB in size, for tests
and gates. `trained_model_dir(variant)` is the same checkpoint trained on the shipped corpus (package data;
deltaserve/tiny/train.py made it): well conditioned, so bf16 exactness claims mean something on it; the trained
dense one is also what `deltaserve serve` serves when given no model (deltaserve/default_model.py). The
generator (and so torch) is imported on first use, so that `deltaserve make-tiny --help` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltaserve.tiny.spec import EXPERT_LAYOUTS, VARIANTS

if TYPE_CHECKING:
    from deltaserve.tiny.generate import make_tiny
    from deltaserve.tiny.trained import trained_model_dir

__all__ = ["EXPERT_LAYOUTS", "VARIANTS", "make_tiny", "trained_model_dir"]


def __getattr__(name: str) -> Any:
    if name == "make_tiny":
        from deltaserve.tiny import generate

        return generate.make_tiny
    if name == "trained_model_dir":
        from deltaserve.tiny import trained

        return trained.trained_model_dir
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
