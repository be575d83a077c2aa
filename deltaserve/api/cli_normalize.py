"""vLLM's rules for reading a `deltaserve serve` command line, applied before argparse sees it.

normalize_argv reads argv as vLLM's FlexibleArgumentParser does (vllm/utils/argparse_utils.py): `--max_model_len` is
`--max-model-len` (underscores before any '.'), `-O3` is `-O 3`, `--compilation-config.cudagraph_mode=X` (or
`-cc.cudagraph_mode=X`, `--hf-overrides.text_config.rope_parameters.rope_type yarn`) sets one nested key of that JSON
flag, and `--config file.yaml` inserts the YAML's keys as flags (the command line wins). deltaserve/cli.py calls it
through api/cli.py before parsing the flags of cli_args.py.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from deltaserve.api.cli_values import readable_int


def config_file_args(path: str) -> list[str]:
    """vLLM's --config: a YAML mapping of flag names to values, as command-line arguments."""
    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config {path}: the config file must be YAML (.yaml or .yml)")
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: cannot read it: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: must hold a mapping of flag names to values")
    argv: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, list):
            argv += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


# a short alias before a dotted key, as vLLM reads `-cc.cudagraph_mode=PIECEWISE` (only letters: a negative number
# such as -0.5 stays a value, where vLLM's reading would take it for a dotted flag)
SHORT_DOTTED = re.compile(r"-[A-Za-z]+\.")


def _is_dotted(name: str) -> bool:
    return (name.startswith("--") and "." in name) or SHORT_DOTTED.match(name) is not None


def _dotted_value(text: str) -> Any:
    """A dotted key's value as vLLM's FlexibleArgumentParser reads it: JSON, else a human-readable int (1k, 80g),
    else the text (vllm/utils/argparse_utils.py)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return readable_int(text, "an integer")
    except argparse.ArgumentTypeError:
        return text


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """vLLM's recursive merge of two dotted keys of one flag: nested dicts merge, lists extend, else the later wins."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = into[key] + value
        else:
            into[key] = value


def _dotted_to_json(argv: list[str]) -> list[str]:
    """vLLM's dotted flags (vllm/utils/argparse_utils.py, FlexibleArgumentParser.parse_args): `--flag.a.b VALUE` or
    `--flag.a.b=VALUE` sets the nested key a.b of a JSON flag (a short alias too: `-cc.cudagraph_mode=PIECEWISE`),
    `--flag.key+ x,y` sets a list; every key of one flag merges into one JSON object, passed after the other
    arguments as vLLM passes it."""
    merged: dict[str, dict[str, Any]] = {}
    rest: list[str] = []
    at = 0
    while at < len(argv):
        arg = argv[at]
        name, sep, text = arg.partition("=")
        if not _is_dotted(name):
            rest.append(arg)
            at += 1
            continue
        if not sep and at + 1 < len(argv):
            at += 1
            text = argv[at]
        flag, *keys = name.split(".")
        value: Any
        if keys[-1].endswith("+"):
            keys[-1] = keys[-1][:-1]
            value = text.split(",")
        else:
            value = _dotted_value(text)
        for key in reversed(keys):
            value = {key: value}
        _merge(merged.setdefault(flag, {}), value)
        at += 1
    return rest + [item for flag, value in merged.items() for item in (flag, json.dumps(value))]


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser rules: underscores in flag names (before any '.'), -O<level>, dotted keys of
    JSON flags, and --config FILE."""
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 >= len(argv):
            raise ValueError("--config needs a YAML file")
        head, tail = argv[:at], argv[at + 2 :]
        # The config's flags come first, so the command line overrides them (the positional model stays first).
        lead = head[:1] if head and not head[0].startswith("-") else []
        argv = lead + config_file_args(argv[at + 1]) + head[len(lead) :] + tail
    normalized = []
    for arg in argv:
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            flag, dot, key = name.partition(".")
            normalized.append(flag.replace("_", "-") + dot + key + sep + value)
        elif arg.startswith("-O") and len(arg) > 2:
            normalized += ["-O", arg[3:] if arg[2] == "=" else arg[2:]]
        else:
            normalized.append(arg)
    return _dotted_to_json(normalized)
