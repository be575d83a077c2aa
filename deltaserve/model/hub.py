"""Model location: a local checkpoint folder as given, or a Hugging Face repo id resolved through the hub cache
(downloaded when the hub is reachable, as `vllm serve Qwen/...` does; HF_HUB_OFFLINE=1 uses the cache only)."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


class ModelNotFoundError(ValueError):
    """Neither a folder nor a Hugging Face repo that could be resolved."""


def resolve_model_dir(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.count("/") != 1 or model.startswith(("/", ".", "~")):
        raise ModelNotFoundError(f"model {model!r}: no such checkpoint folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=model, allow_patterns=CHECKPOINT_PATTERNS))
    except Exception as exc:  # offline, unknown repo, no permission: one clear message
        raise ModelNotFoundError(
            f"model {model!r} is not a local folder and could not be resolved as a Hugging Face repo: {exc}"
        ) from exc
