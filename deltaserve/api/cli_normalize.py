"""vLLM's rules for reading a `deltaserve serve` command line, applied before argparse sees it.

normalize_argv reads argv as vLLM's FlexibleArgumentParser does: `--max_model_len` is `--max-model-len` (underscores
before any '.'), `-O3` is `-O 3`, `--compilation-config.cudagraph_mode=X` sets one key of that JSON flag, and
`--config file.yaml` inserts the YAML's keys as flags (the command line wins). deltaserve/cli.py calls it through
api/cli.py before parsing the flags of cli_args.py.
"""

from __future__ import annotations

import json
from typing import Any


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


def _dotted_to_json(argv: list[str]) -> list[str]:
    """vLLM's dotted flags: `--compilation-config.cudagraph_mode=PIECEWISE` sets one key of a JSON flag."""
    merged: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    at = 0
    while at < len(argv):
        arg = argv[at]
        name, sep, value = arg.partition("=")
        if arg.startswith("--") and "." in name:
            flag, _, key = name.partition(".")
            if not sep and at + 1 < len(argv):
                at += 1
                value = argv[at]
            try:
                parsed: Any = json.loads(value)
            except ValueError:
                parsed = value
            if flag not in merged:
                order.append(flag)
            merged.setdefault(flag, {})[key] = parsed
        else:
            order.append(arg)
        at += 1
    return [item for arg in order for item in ((arg, json.dumps(merged[arg])) if arg in merged else (arg,))]


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
