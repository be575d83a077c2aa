"""The model `deltaserve serve` and `deltaserve generate` run when given none: a tiny checkpoint shipped in the package.

It is the trained tiny dense checkpoint (Qwen3.5 dense layout, 8 layers, hidden size 64, a real tokenizer and chat
template) that the package ships as data; the tiny-model harness (deltaserve/tiny/) made it and its training.json
states the recipe. Serving reads its files and imports none of the harness, so `deltaserve serve` with no MODEL
starts at once, on any machine, with nothing generated or downloaded.
"""

from __future__ import annotations

from pathlib import Path

# The name the built-in checkpoint answers to in /v1/models and in requests' "model" field.
SERVED_NAME = "deltaserve-tiny"
# Package data: the shipped trained dense checkpoint, read in place (never written to).
MODEL_DIR = Path(__file__).resolve().parent / "tiny" / "trained" / "dense"


def model_dir() -> Path:
    """The built-in checkpoint's folder; a clear error when an install left the package data out."""
    if not (MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the built-in tiny checkpoint is missing from {MODEL_DIR} (package data of deltaserve): reinstall "
            "deltaserve, or give a MODEL"
        )
    return MODEL_DIR
