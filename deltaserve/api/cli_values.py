"""The value types of `deltaserve serve`'s flags: each reads one flag's text as vLLM reads it, or refuses it by name.

Byte and token counts take vLLM's human_readable_int suffixes (readable_int: 32k is x1000, 32K x1024; human_int adds
-1 / auto for the model's own); "" or "None" is no value where vLLM's optional_type says so (optional_int,
optional_value, kv_cache_bytes); ports, seconds, JSON objects and lists are checked at parse time, and so are the
structured-outputs and speculative-decoding JSON flags, so a bad launch line fails before the model loads. SWITCH is
argparse's --X / --no-X pair that vLLM's boolean flags have. cli_args.py and cli_engine_args.py use them.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

SWITCH = argparse.BooleanOptionalAction


# vLLM's human_readable_int suffixes: lowercase decimal, uppercase binary
BYTE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def readable_int(value: str, what: str) -> int:
    """vLLM's human_readable_int: plain digits; or a number and one suffix, lowercase k/m/g/t decimal (x10^3 ..
    x10^12, a fraction allowed: 1.5g) or uppercase K/M/G/T binary (x2^10 .. x2^40, whole numbers only: 4G). Other
    spellings (4GiB, 4 GB, 1.5G) are refused as vLLM refuses them; `what` names the value in the error."""
    text = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not {what}: {value!r} (digits, or a number with a suffix: k/m/g/t decimal, K/M/G/T binary)"
            ) from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * BYTE_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{value!r}: decimals are not allowed with binary suffixes like {suffix} (as in vLLM); did you mean "
            f"{number}{suffix.lower()}?"
        )
    return int(number) * BYTE_SUFFIXES[suffix]


def human_int(value: str) -> int | None:
    """vLLM's human_readable_int_or_auto (--max-model-len, --max-num-batched-tokens): 32768, 32k (x1000), 32K
    (x1024), 1m / 1M, ...; -1 or auto: the model's own."""
    if value.strip().lower() in ("-1", "auto"):
        return None
    number = readable_int(value, "an integer")
    if number < 0:
        raise argparse.ArgumentTypeError(f"not a count: {value!r} (-1 or auto: the model's own)")
    return number


def kv_cache_bytes(value: str) -> int | None:
    """--kv-cache-memory-bytes as vLLM 0.26 reads it (its human_readable_int behind optional_type): "" or "None" is
    no value, else readable_int; a negative count is refused here (vLLM refuses it only at start-up)."""
    if value in ("", "None"):
        return None
    count = readable_int(value, "a byte count")
    if count < 0:
        raise argparse.ArgumentTypeError(f"a byte count is at least 0 (0: not set), got {value!r}")
    return count


def optional_int(value: str) -> int | None:
    """vLLM's optional_type(int): "" or "None" is no value, else an integer."""
    if value in ("", "None"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None


def optional_value(value: str) -> str | None:
    """vLLM's reading of an optional flag's value: "" or "None" is no value."""
    return None if value in ("", "None") else value


def port_number(value: str) -> int:
    """A TCP port, 0-65535 (0: any free port), refused at parse time rather than by the bind after loading."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0-65535, got {port}")
    return port


def byte_count(value: str) -> int:
    number = human_int(value)
    if number is None or number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive size in bytes, got {value!r}")
    return number


def json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


def limit_mm_per_prompt(value: str) -> str:
    """vLLM's --limit-mm-per-prompt, a JSON object read at parse time (its EngineArgs field is a dict, which
    vllm/engine/arg_utils.py parses with json.loads), so `image=2,video=0` fails before the model loads; the counts
    are checked where the multimodal processor reads them. The text is kept: EngineConfig holds it as given."""
    json_object(value)
    return value


def json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError("must be a JSON list of strings")
    return parsed


def shutdown_seconds(value: str) -> int:
    """vLLM's --shutdown-timeout: whole seconds, at least 0."""
    try:
        seconds = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole seconds, got {value!r}") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value!r}")
    return seconds


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value!r}")
    return seconds


def _checked(parse: Callable[[str], object], value: str) -> str:
    """value, once parse accepts it; its ValueError becomes argparse's error (the flag's usage line and message)."""
    try:
        parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def structured_outputs_config(value: str) -> str:
    """vLLM's --structured-outputs-config JSON, checked at parse time (an unsupported backend is refused by name)."""
    from deltaserve.engine.grammar import StructuredOutputsConfig

    return _checked(StructuredOutputsConfig.parse, value)


def reasoning_config(value: str) -> str:
    """vLLM's --reasoning-config JSON, checked at parse time (a field vLLM's ReasoningConfig lacks is named)."""
    from deltaserve.reasoning_config import parse_reasoning_config

    return _checked(parse_reasoning_config, value)


def speculative_config(value: str) -> str:
    """vLLM's --speculative-config JSON, checked at parse time (a method or key deltaserve refuses is named). One
    without a method may be completed by --spec-method (merge_spec_aliases checks the merged config): only its JSON
    is checked here."""
    from deltaserve.speculative_config import SpeculativeConfigError, parse_speculative_config

    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config is not valid JSON ({exc}): {value!r}") from None
    if isinstance(parsed, dict) and "method" not in parsed:
        return value
    try:
        parse_speculative_config(value)
    except SpeculativeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


# vLLM's shorthand flags and the --speculative-config key each sets
SPEC_ALIASES = (("--spec-method", "method"), ("--spec-model", "model"), ("--spec-tokens", "num_speculative_tokens"))


def merge_spec_aliases(
    speculative: str | None, method: str | None, model: str | None, tokens: int | None
) -> str | None:
    """--speculative-config with vLLM's shorthand flags merged in, as vLLM's create_speculative_config merges them: a
    key set both ways is refused ("--spec-tokens and --speculative-config['num_speculative_tokens'] are mutually
    exclusive"); the result is checked as --speculative-config is (an unknown method or a draft model named). Errors
    are ValueErrors: serve reports them as one line and exits 2, as for its other flag checks."""
    given = {
        key: value for (_, key), value in zip(SPEC_ALIASES, (method, model, tokens), strict=True) if value is not None
    }
    if not given:
        return speculative
    config = json.loads(speculative) if speculative is not None else {}
    for flag, key in SPEC_ALIASES:
        if key in given and key in config:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
    merged = json.dumps({**config, **given})
    try:
        return speculative_config(merged)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--spec-method / --spec-model / --spec-tokens: {exc}") from None
