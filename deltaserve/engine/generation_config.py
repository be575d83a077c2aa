"""Model-provided generation defaults: sampling parameters and eos ids from generation_config.json / config.json.

This is vLLM's `--generation-config auto`: the checkpoint's recommended sampling parameters become the defaults of
every request, and a field the user sets wins. Reading only; choosing "auto" vs "vllm" (no defaults) is the caller's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Sampling fields taken from generation_config.json, with the type SamplingParams expects.
# vLLM reads the first five; the penalties are read too because Qwen publishes them as recommended settings.
SAMPLING_DEFAULT_FIELDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
}


def _read_json(path: Path) -> dict[str, Any]:
    """The file's object, or {} when it is missing or unreadable (vLLM ignores a broken generation config)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def load_generation_defaults(model_dir: Path) -> dict[str, Any]:
    """Sampling defaults present (and not null) in model_dir/generation_config.json.

    HF's max_new_tokens comes back as "max_tokens", which vLLM treats as a server-wide cap (see apply_defaults).
    """
    config = _read_json(Path(model_dir) / "generation_config.json")
    defaults = {
        name: cast(config[name]) for name, cast in SAMPLING_DEFAULT_FIELDS.items() if config.get(name) is not None
    }
    if config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = int(config["max_new_tokens"])
    if defaults:
        logger.info("default sampling parameters from the model's generation_config.json: %s", defaults)
    return defaults


def _token_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    values = [value] if isinstance(value, int) else list(value)
    return list(dict.fromkeys(int(v) for v in values))


def load_eos_token_ids(model_dir: Path) -> list[int]:
    """generation_config.json's eos_token_id (int or list), else config.json's (top level, then text_config)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    text_config = config.get("text_config")
    sources = [_read_json(model_dir / "generation_config.json"), config]
    if isinstance(text_config, dict):
        sources.append(text_config)
    for source in sources:
        eos_token_ids = _token_id_list(source.get("eos_token_id"))
        if eos_token_ids:
            return eos_token_ids
    return []


def apply_defaults(user_fields: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """defaults overlaid with the user's fields; a field the user left at None counts as not given.

    The one exception is max_tokens: a generation_config max_new_tokens caps the user's value, as in vLLM.
    """
    merged = dict(defaults)
    merged.update({name: value for name, value in user_fields.items() if value is not None})
    if user_fields.get("max_tokens") is not None and defaults.get("max_tokens") is not None:
        merged["max_tokens"] = min(user_fields["max_tokens"], defaults["max_tokens"])
    return merged
