"""A peer's start-up refusals that name their own remedy, read from its server log, so a grid can relaunch it once
as its message says instead of losing the arm (or a device call to a manual edit).

One is handled: vLLM 0.26 (config/compilation.py, with full decode CUDA graphs on a hybrid model) refuses to start
when `max_num_seqs` exceeds its pool's block count, "max_num_seqs (M) exceeds available Mamba cache blocks (N) ...
Please lower max_num_seqs to at most N or increase gpu_memory_utilization." On an 80 GB card the 27B shape gives
N = 256 without MTP (the h100-* sites' `max-num-seqs-256` deviation) and fewer with the MTP layer's weights. The
relaunch adds `--max-num-seqs N` after the site's flags (vLLM's parser keeps the last), and the record names it in
the failed launch (`adapted_to`) and in the arm's entry (`max_num_seqs_by_model`), where a resumed call finds it
and starts with it. At the grids' concurrencies (at most 64 running) the count binds nothing; its only other effect
is vLLM's profile run sampling fewer rows, which leaves vLLM more cache (benchmarks/README.md, the deviations).

A refused start costs a device call minutes (vLLM loads the weights and profiles before it refuses: ~200 s for the
27B with MTP on an H100). `bench grid --adapt-from RECORD` spares a new record that: a launch whose argv equals one
that RECORD's refusal adapted, on the same GPUs, starts with the count that refusal named (`known_refusals`); the
launch names the record it took the count from (`adapted_from`). Launches are compared without their
`--gdn-prefill-backend` choice (`refusal_key`): the GDN prefill kernel does not size the state pool, so a record made
with FlashInfer's prefill serves a launch that runs vLLM's Triton one (`bench grid --no-flashinfer`), and a count
that is still too many is refused and relaunched as without the record.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from deltaserve.bench.grid_config import Arm

MAX_NUM_SEQS_REFUSAL = re.compile(
    r"max_num_seqs \((\d+)\) exceeds available Mamba cache blocks \((\d+)\).*?lower max_num_seqs to at most (\d+)"
)


def max_num_seqs_named(log_text: str) -> tuple[int, int] | None:
    """(the refused max_num_seqs, the count vLLM's message asks for) from a server log, or None."""
    match = MAX_NUM_SEQS_REFUSAL.search(log_text)
    if match is None:
        return None
    refused, asked = int(match.group(1)), int(match.group(3))
    return (refused, asked) if 0 < asked < refused else None


def with_max_num_seqs(arm: Arm, count: int) -> Arm:
    """The arm launched with `--max-num-seqs count` last: after a registry peer's site flags and extra args, or at
    the end of a hand-written command."""
    flag = ["--max-num-seqs", str(count)]
    if arm.oracle:
        return dataclasses.replace(arm, extra_args=[*arm.extra_args, *flag])
    return dataclasses.replace(arm, command=[*arm.command, *flag])


def relaunch_count(log_path: Path) -> tuple[int, int] | None:
    """(refused, asked) where a launch's server log ends in the refusal above; None otherwise (or no log)."""
    if not log_path.is_file():
        return None
    return max_num_seqs_named(log_path.read_text(errors="replace"))


def refusal_key(argv: list[str]) -> tuple[str, ...]:
    """A launch's argv as refusals are matched: without `--gdn-prefill-backend VALUE` (or `=VALUE`)."""
    key: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--gdn-prefill-backend":
            skip = True
        elif not word.startswith("--gdn-prefill-backend="):
            key.append(word)
    return tuple(key)


def known_refusals(record: dict[str, Any], gpus: list[str]) -> dict[tuple[str, ...], int]:
    """{a refused launch's refusal_key: the count its refusal named} from a grid record's launches (`adapted_to`),
    when one of the record's hosts (its first call's or a resumed call's) had exactly these GPUs; {} otherwise."""
    hosts = [record.get("host") or {}, *record.get("resumed", [])]
    if not any(host.get("gpus") == gpus for host in hosts):
        return {}
    counts: dict[tuple[str, ...], int] = {}
    for launch in record.get("launches", []):
        match = re.match(r"--max-num-seqs (\d+):", launch.get("adapted_to") or "")
        if match and launch.get("argv"):
            counts[refusal_key(launch["argv"])] = int(match.group(1))
    return counts
