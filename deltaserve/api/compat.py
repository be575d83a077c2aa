"""The server's side of the vLLM flags deltaserve does not implement itself: the table and its policies are
deltaserve/vllm_flags.py's (shared with the offline LLM's keywords); here they become argparse flags and are checked
after parsing.
"""

from __future__ import annotations

import argparse
import logging

from deltaserve.vllm_flags import COMPAT_FLAGS, TABLE, CompatFlag, apply_policy

logger = logging.getLogger(__name__)

__all__ = ["COMPAT_FLAGS", "TABLE", "CompatFlag", "add_compat_arguments", "check_compat"]


def add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "vLLM flags deltaserve accepts without implementing (logged at startup) or refuses by name"
    )
    for entry in COMPAT_FLAGS:
        help_text = f"{entry.policy}: {entry.reason}"
        if entry.kind == "switch":
            group.add_argument(
                *entry.flags, dest=entry.dest, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            nargs = "+" if entry.kind == "list" else None
            group.add_argument(*entry.flags, dest=entry.dest, nargs=nargs, default=None, metavar="VALUE",
                               help=help_text)  # fmt: skip


def _shown(entry: CompatFlag, value: object) -> str:
    if value is True:
        return entry.flags[0]
    if value is False:
        return "--no-" + entry.flags[0][2:]
    shown = " ".join(map(str, value)) if isinstance(value, list) else str(value)
    return f"{entry.flags[0]} {shown}"


def check_compat(args: argparse.Namespace) -> None:
    """Refuses (ValueError naming the flag) what deltaserve cannot honour; logs every accepted flag that was given."""
    for entry in COMPAT_FLAGS:
        value = getattr(args, entry.dest, None)
        if value is not None:
            apply_policy(entry, value, _shown(entry, value), logger)
