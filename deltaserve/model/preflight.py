"""Start-up checks of a checkpoint folder, run before anything heavy is imported or loaded, and the one-line form
of a start-up error.

preflight() resolves the model folder and checks, in order: config.json (ModelConfig, every field honoured or
refused by name), the tokenizer files, generation_config.json, --max-model-len against the model's limit (vLLM's
rule and message), and the safetensors index, shard headers and tensor dtypes (CheckpointFiles, torch-free). Each
failure raises an error whose message is one line naming the file and the field or tensor. The engine calls the
same pieces (resolve_max_model_len, load_tokenizer, check_generation_config) when it is built from Python.
"""

from __future__ import annotations

import json
import logging
import traceback
from pathlib import Path
from typing import Any

from deltaserve import env
from deltaserve.config import ModelConfig
from deltaserve.model.checkpoint_files import CheckpointFiles
from deltaserve.model.hub import resolve_model_dir

logger = logging.getLogger(__name__)

# Any one of these sets is a tokenizer transformers' AutoTokenizer can build (fast JSON, byte-level BPE,
# sentencepiece, WordPiece).
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",), ("vocab.txt",))
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json")
# generation_config.json fields the engine reads, with the JSON types each may hold
GENERATION_FIELDS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "repetition_penalty": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "max_new_tokens": (int,),
    "eos_token_id": (int, list),
}
LONG_MAX_MODEL_LEN_WARNING = (
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position encoding "
    "(RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute position encoding, "
    "positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds error."
)


class StartupError(ValueError):
    """A model folder or start-up setting deltaserve refuses; the message names the file or the flag."""


def check_tokenizer_files(model_dir: Path, tokenizer: str | None) -> None:
    """The tokenizer's folder (--tokenizer, else the model folder) holds one of TOKENIZER_FILE_SETS, and its JSON
    files parse. A --tokenizer that is not a folder is left to the Hugging Face hub (a repo id)."""
    if tokenizer is not None:
        folder = Path(tokenizer).expanduser()
        if not folder.is_dir():
            if folder.exists() or tokenizer.startswith(("/", ".", "~")):
                raise StartupError(f"--tokenizer {tokenizer!r}: no such tokenizer folder")
            return
        hint = ""
    else:
        folder = Path(model_dir)
        hint = "; pass --tokenizer to load the tokenizer from another folder or repo"
    if not any(all((folder / name).is_file() for name in files) for files in TOKENIZER_FILE_SETS):
        looked_for = ", ".join(" + ".join(files) for files in TOKENIZER_FILE_SETS)
        raise StartupError(f"{folder}: no tokenizer files (looked for {looked_for}){hint}")
    for name in TOKENIZER_JSON_FILES:
        _read_json_object(folder / name, missing_ok=True)


def load_tokenizer(model_dir: Path, tokenizer: str | None) -> Any:
    """check_tokenizer_files, then transformers' AutoTokenizer; a tokenizer that fails to build is one StartupError
    naming its folder (the engine calls this instead of AutoTokenizer.from_pretrained)."""
    from transformers import AutoTokenizer

    check_tokenizer_files(model_dir, tokenizer)
    source = tokenizer or str(model_dir)
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        # every failure of a third-party loader becomes one line naming the folder
        raise StartupError(
            f"{source}: the tokenizer cannot be loaded ({type(exc).__name__}: {_one_line(exc)})"
        ) from exc


def check_generation_config(model_dir: Path, generation_config: str) -> None:
    """generation_config.json (of the model folder for `auto`, of the given folder otherwise; not read for `vllm`)
    is absent, or a JSON object whose sampling fields have the right types.

    vLLM ignores a generation_config.json it cannot parse (transformers raises OSError and vLLM drops it); deltaserve
    refuses it instead, since ignoring it would silently serve without the checkpoint's sampling defaults, and
    names `--generation-config vllm` as the way to start without the file."""
    if generation_config == "vllm":
        return
    folder = Path(model_dir) if generation_config == "auto" else Path(generation_config).expanduser()
    if generation_config != "auto" and not folder.is_dir():
        raise StartupError(f"--generation-config {generation_config!r}: no such folder")
    path = folder / "generation_config.json"
    data = _read_json_object(path, missing_ok=True, hint="; pass --generation-config vllm to start without it")
    for key, kinds in GENERATION_FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        is_bad = isinstance(value, bool) or not isinstance(value, kinds)
        if key == "eos_token_id" and isinstance(value, list):
            is_bad = not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if is_bad:
            expected = " or ".join("a list of ints" if k is list else k.__name__ for k in kinds)
            raise StartupError(
                f"{path}: field `{key}` must be {expected}, got {value!r}; pass --generation-config vllm to start "
                "without it"
            )


def tokenizer_model_max_length(tokenizer_dir: Path | None) -> int | None:
    """tokenizer_config.json's model_max_length, which vLLM also caps the derived max_model_len with."""
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer_config.json").is_file():
        return None
    value = _read_json_object(Path(tokenizer_dir) / "tokenizer_config.json", missing_ok=True).get("model_max_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def resolve_max_model_len(model_config: ModelConfig, requested: int | None, tokenizer_dir: Path | None = None) -> int:
    """vLLM 0.26's _get_and_verify_max_len for these models: the derived limit is max_position_embeddings, capped by
    the tokenizer's model_max_length; None (or -1) takes it; a larger request is refused with vLLM's message unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (or DELTASERVE_ALLOW_LONG_MAX_MODEL_LEN=1), which allows it with vLLM's warning.
    The caller then sizes the RoPE table with ModelConfig.with_max_model_len."""
    derived = model_config.max_position_embeddings
    tokenizer_max = tokenizer_model_max_length(tokenizer_dir)
    if tokenizer_max is not None:
        derived = min(derived, tokenizer_max)
    if requested is None or requested == -1:
        return derived
    if requested <= 0:
        raise StartupError(f"--max-model-len must be positive (or -1 / auto for the model's own), got {requested}")
    # vLLM lets a config.json model_max_length above the derived limit admit longer requests
    if requested <= derived or (model_config.model_max_length or 0) >= requested:
        return requested
    msg = (
        f"User-specified max_model_len ({requested}) is greater than the derived max_model_len "
        f"(max_position_embeddings={derived} or model_max_length={model_config.model_max_length} in model's "
        "config.json)."
    )
    if env.allow_long_max_model_len():
        logger.warning("%s %s", msg, LONG_MAX_MODEL_LEN_WARNING)
        return requested
    raise StartupError(
        f"{model_config.config_file}: {msg} To allow overriding this maximum, set the env var "
        f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {LONG_MAX_MODEL_LEN_WARNING}"
    )


def preflight(
    model: str,
    tokenizer: str | None = None,
    generation_config: str = "auto",
    max_model_len: int | None = None,
    load_format: str = "auto",
) -> ModelConfig:
    """Every start-up check that needs no torch, in the order a user would fix them; returns the parsed config."""
    model_dir = resolve_model_dir(model)
    model_config = ModelConfig.from_pretrained(model_dir)
    check_tokenizer_files(model_dir, tokenizer)
    check_generation_config(model_dir, generation_config)
    tokenizer_dir = Path(tokenizer).expanduser() if tokenizer else model_dir
    resolve_max_model_len(model_config, max_model_len, tokenizer_dir if tokenizer_dir.is_dir() else None)
    if load_format != "dummy":
        CheckpointFiles(model_dir).check_dtypes(fp8=model_config.fp8 is not None)
    return model_config


def startup_error_line(exc: BaseException) -> str:
    """One line for a start-up failure: the message of deltaserve's own errors (which name the file), or the
    exception type and message of anything else."""
    if isinstance(exc, ValueError | OSError):
        return _one_line(exc)
    return f"{type(exc).__name__}: {_one_line(exc)}"


def report_startup_error(exc: BaseException, is_debug: bool, log: logging.Logger) -> int:
    """Logs the error as one line (with the traceback only when debugging) and returns the exit code 1."""
    if is_debug:
        log.error("%s\n%s", startup_error_line(exc), "".join(traceback.format_exception(exc)).rstrip())
    else:
        log.error("%s (the traceback is shown with DELTASERVE_LOG_LEVEL=DEBUG)", startup_error_line(exc))
    return 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _read_json_object(path: Path, missing_ok: bool, hint: str = "") -> dict[str, Any]:
    if not path.is_file():
        if missing_ok:
            return {}
        raise StartupError(f"{path}: missing{hint}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StartupError(f"{path}: not valid JSON ({exc}){hint}") from exc
    except OSError as exc:
        raise StartupError(f"{path}: cannot be read ({exc.strerror or exc}){hint}") from exc
    if not isinstance(data, dict):
        raise StartupError(f"{path}: must hold a JSON object, got {type(data).__name__}{hint}")
    return data
