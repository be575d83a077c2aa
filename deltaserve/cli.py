"""The `deltaserve` command line: a thin router from sub-commands to the modules that own them.

Each sub-command's module exposes `add_arguments(parser) -> None` and `run(args) -> int`; only the chosen
module is imported, so `deltaserve --help` and every command start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name (or group, name) -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("serve",): ("deltaserve.api.cli", "serve a model over an OpenAI-compatible HTTP API (vLLM's flags)"),
    ("generate",): ("deltaserve.engine.cli", "generate offline from prompts given on the command line"),
    ("make-tiny",): ("deltaserve.tiny.cli", "write a tiny Hugging Face checkpoint (dense, moe or next)"),
    ("gate", "tokens"): ("deltaserve.gates.tokens", "greedy token-exactness gate against transformers"),
    ("gate", "prefix-cache"): ("deltaserve.gates.prefix_cache", "greedy tokens with the prefix cache on vs off"),
    ("gate", "mtp"): ("deltaserve.gates.mtp", "MTP speculative decoding: exact against itself off, and vLLM's"),
    ("gate", "fp8"): ("deltaserve.gates.fp8", "greedy tokens of a block-FP8 checkpoint against vLLM's on it"),
    ("bench", "serve"): ("deltaserve.bench.serve_cli", "online load generator with vLLM's metric definitions"),
    ("bench", "grid"): ("deltaserve.bench.grid_cli", "arms x concurrencies x lengths, with a committed record"),
    ("bench", "report"): ("deltaserve.bench.report", "regenerate docs/BENCHMARKS.md and the records index"),
    ("bench", "late-compiles"): (
        "deltaserve.bench.late_compiles",
        "read a grid record's server logs again for the kernels compiled while measured",
    ),
    ("bench", "oracle-cmd"): (
        "deltaserve.bench.registry",
        "print a peer's production launch command from the registry",
    ),
    ("bench", "kernels"): ("deltaserve.bench.kernels", "time every kernel at the 27B and 35B-A3B shapes"),
    ("check", "oracle-flags"): ("deltaserve.gates.oracle_flags", "static gate: every oracle launch is honest"),
    ("check", "all"): ("deltaserve.gates.all", "run every gate"),
}


def _usage() -> str:
    lines = ["usage: deltaserve COMMAND [ARGS]", "", "commands:"]
    for key, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(key):<20} {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    for length in (2, 1):
        key = tuple(argv[:length])
        if key in COMMANDS:
            module_name, help_text = COMMANDS[key]
            parser = argparse.ArgumentParser(prog="deltaserve " + " ".join(key), description=help_text)
            module = importlib.import_module(module_name)
            module.add_arguments(parser)
            rest = argv[length:]
            # A command may rewrite its command line first (serve reads flags as vLLM's parser does).
            normalize = getattr(module, "normalize_argv", None)
            if normalize is not None:
                try:
                    rest = normalize(rest)
                except ValueError as exc:
                    parser.error(str(exc))
            args = parser.parse_args(rest)
            return int(module.run(args) or 0)
    print(f"deltaserve: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
