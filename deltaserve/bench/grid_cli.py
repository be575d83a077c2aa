"""`deltaserve bench grid CONFIG.toml`'s command line: which arms, models, lengths and concurrencies of the file run,
on which card's site, with what deadline; `--dry-run` prints every resolved launch. The grid itself is bench/grid.py.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

from deltaserve.bench.deviations import CARD_SITE_PREFIX, SITES
from deltaserve.bench.grid import DEFAULT_RESULT_DIR, Grid, GridInterrupted
from deltaserve.bench.grid_config import Arm, GridConfig, load_config, resolve
from deltaserve.bench.grid_launch import client_argv
from deltaserve.bench.grid_ratios import acceptance_pair, format_percent, format_ratio


def site_for_card(site: str, card: str) -> str:
    """`site` moved to `card`'s twin (h200-offline -> h100-offline); a site of no card (online) stays."""
    for prefix in CARD_SITE_PREFIX.values():
        if site.startswith(prefix) and site.replace(prefix, CARD_SITE_PREFIX[card], 1) in SITES:
            return site.replace(prefix, CARD_SITE_PREFIX[card], 1)
    return site


def site_without_flashinfer(site: str) -> str:
    """`site` moved to its Triton/FLA GDN prefill twin (h200-offline -> h200-offline-triton-gdn), for a host where
    the vLLM bundle is unpacked and the FlashInfer bundle is not: vLLM's own choice there would be FlashInfer's GDN
    prefill, which fails at the first prefill without it. The twin records the gdn-prefill-triton deviation."""
    twin = f"{site}-triton-gdn"
    return twin if twin in SITES else site


def set_utilization(arm: Arm, value: str) -> None:
    """Sets the arm's --gpu-memory-utilization to value: in its command where it spells one, else in its extra args
    (a registry-built peer) or at the end of its command."""
    if not 0 < float(value) <= 1:
        raise ValueError(f"--gpu-memory-utilization {value}: must be in (0, 1]")
    for argv in (arm.command, arm.extra_args):
        if "--gpu-memory-utilization" in argv:
            argv[argv.index("--gpu-memory-utilization") + 1] = value
            return
    (arm.extra_args if arm.oracle else arm.command).extend(["--gpu-memory-utilization", value])


def _select(items: list[Any], names: str | None, skip: str | None, what: str) -> list[Any]:
    """The items `names` lists, in the order it lists them (the run order: a call that names the peer first runs it
    first, before a deadline can skip it), else all in config order; less those `skip` lists."""
    chosen = list(items)
    if names:
        wanted = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
        by_name = {item.name: item for item in items}
        unknown = set(wanted) - set(by_name)
        if unknown:
            raise ValueError(f"unknown {what}: {sorted(unknown)}")
        chosen = [by_name[name] for name in wanted]
    if skip:
        skipped = {n.strip() for n in skip.split(",")}
        chosen = [item for item in chosen if item.name not in skipped]
    return chosen


def select_lengths(lengths: list[tuple[int, int]], spec: str) -> list[tuple[int, int]]:
    """The grid's (ISL, OSL) pairs that `spec` ("16384x128,65536x128") names, in the grid's order; a pair the grid
    does not have is refused (a grid's points are its own, not a command line's)."""
    try:
        asked = {tuple(int(n) for n in item.split("x")) for item in spec.split(",")}
    except ValueError:
        raise ValueError(f"--lengths {spec!r}: expected ISLxOSL pairs, e.g. 16384x128") from None
    if not asked <= set(lengths):  # a malformed pair (not two numbers) is not one of the grid's either
        have = ", ".join(f"{i}x{o}" for i, o in lengths)
        raise ValueError(f"--lengths {spec!r}: the grid has {have}")
    return [pair for pair in lengths if pair in asked]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="grid TOML file")
    parser.add_argument(
        "--arms", default=None, help="comma-separated arms to run, in that order (default all, in config order)"
    )
    parser.add_argument("--skip-arms", default=None, help="comma-separated arms to leave out")
    parser.add_argument("--models", default=None, help="comma-separated models to run (default all)")
    parser.add_argument("--concurrencies", default=None, help="override, e.g. 1,8,32")
    parser.add_argument(
        "--lengths",
        default=None,
        help="run only these of the grid's (ISL, OSL) pairs, e.g. 16384x128: the peer's batch budget follows the "
        "longest prompt run (the registry's 2 x ISL), so a card that cannot hold the longest still runs the others",
    )
    parser.add_argument("--no-drift", action="store_true", help="skip the drift re-run of the first subject arm")
    parser.add_argument("--result-dir", type=Path, default=None, help=f"default {DEFAULT_RESULT_DIR}")
    parser.add_argument("--raw-dir", type=Path, default=None, help="per-run JSON and server logs")
    parser.add_argument("--record-name", default=None, help="record file stem (default GRID-DATE)")
    parser.add_argument(
        "--resume", type=Path, default=None, help="continue this record: run only the points it lacks, then the drift"
    )
    parser.add_argument(
        "--adapt-from",
        type=Path,
        default=None,
        help="an earlier record: a launch it saw refused on these GPUs starts with the count the refusal named "
        "(deltaserve/bench/peer_refusals.py)",
    )
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="start no launch that would end (arm expected_s) after this"
    )
    parser.add_argument("--run-timeout-s", type=float, default=None, help="fail a client run that takes longer")
    parser.add_argument(
        "--card",
        choices=sorted(CARD_SITE_PREFIX),
        default="h200",
        help="the card the peers run on: h100 moves every arm of an h200-* site to its h100-* twin "
        "(deltaserve/bench/deviations.py: vLLM's --max-num-seqs 256 on an 80 GB card)",
    )
    parser.add_argument(
        "--no-flashinfer",
        action="store_true",
        help="the FlashInfer bundle is not on this host: every arm of a production site runs at its Triton/FLA GDN "
        "prefill twin (h200-offline -> h200-offline-triton-gdn), and the record carries the gdn-prefill-triton "
        "deviation (deltaserve/bench/deviations.py)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        default=None,
        help="every arm's --gpu-memory-utilization (its command or its registry extra args), the same for all: an "
        "80 GB card holds the 35B-A3B dummy at 0.92, not at the grids' 0.85",
    )
    parser.add_argument("--dry-run", action="store_true", help="print every launch and client command, run nothing")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        config.arms = _select(config.arms, args.arms, args.skip_arms, "arms")
        config.models = _select(config.models, args.models, None, "models")
        if args.concurrencies:
            config.concurrencies = [int(c) for c in args.concurrencies.split(",")]
        if args.lengths:
            kept = select_lengths(config.lengths, args.lengths)
            per_pair = config.dataset.prefix.get("prefix_repetition_prefix_len")
            if isinstance(per_pair, list):  # one prefix length a pair: keep the kept pairs' own
                config.dataset.prefix["prefix_repetition_prefix_len"] = [config.dataset.prefix_len(config.lengths, i)
                                                                         for i, _ in kept]  # fmt: skip
            config.lengths = kept
        if args.run_timeout_s:
            config.run_timeout_s = args.run_timeout_s
        for arm in config.arms:
            arm.site = site_for_card(arm.site, args.card)
            if args.no_flashinfer:
                arm.site = site_without_flashinfer(arm.site)
            if args.gpu_memory_utilization is not None:
                set_utilization(arm, args.gpu_memory_utilization)
    except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"bench grid: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(config)
    result_dir = args.result_dir or DEFAULT_RESULT_DIR
    try:
        grid = Grid(config, result_dir, args.raw_dir, args.record_name, args.deadline_s, not args.no_drift, args.resume,
                    args.adapt_from)  # fmt: skip
    except (OSError, ValueError) as exc:
        print(f"bench grid: cannot resume: {exc}", file=sys.stderr)
        return 2
    try:
        record = grid.run()
    except GridInterrupted as exc:
        print(f"[grid] interrupted ({exc}); partial record: {grid.record_path}", file=sys.stderr)
        return 1
    print(f"[grid] record: {grid.record_path}")
    for entry in record["ratios"]:
        if entry.get("excluded"):
            print(f"[grid] {entry['subject']}/{entry['peer']} {entry['model']} c{entry['concurrency']}: no ratio "
                  f"({entry['excluded']})")  # fmt: skip
            continue
        hit_rates = ""
        if "subject_prefix_cache_hit_rate" in entry:
            hit_rates = (f", prefix cache hit rate {format_percent(entry['subject_prefix_cache_hit_rate'])} / "
                         f"{format_percent(entry['peer_prefix_cache_hit_rate'])}")  # fmt: skip
        print(
            f"[grid] {entry['subject']}/{entry['peer']} {entry['model']} c{entry['concurrency']}: "
            f"output tok/s x{format_ratio(entry['output_throughput'])}, "
            f"TTFT med x{format_ratio(entry['median_ttft_ms'])}, "
            f"TPOT med x{format_ratio(entry['median_tpot_ms'])}{hit_rates}{acceptance_pair(entry)}"
        )
    num_failed = sum(1 for r in record["runs"] if r["error"]) + sum(1 for e in record["launches"] if e["error"])
    if not record["runs"]:
        return 2
    return 1 if num_failed else 0


def _dry_run(config: GridConfig) -> int:
    """Print every resolved launch and one client command line; 1 if some arm cannot be resolved."""
    code = 0
    for model in config.models:
        launch = None
        for arm in config.arms:
            try:
                launch = resolve(arm, model, config)
            except (OSError, ValueError) as exc:
                print(f"{arm.name} on {model.name}: cannot resolve: {exc}")
                code = 1
                continue
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env_overrides.items())
            print(f"{arm.name} on {model.name}: {env + ' ' if env else ''}{shlex.join(launch.argv)}")
            if launch.exemption:
                print(f"  exemption: {launch.exemption}")
        if launch is not None:
            isl, osl = config.lengths[0]
            argv = client_argv(launch, config, isl, osl, config.concurrencies[0], "LABEL")
            print(f"client ({model.name}): deltaserve bench serve {shlex.join(argv)}")
    return code
