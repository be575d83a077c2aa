"""One launch of a grid arm (bench/grid.py runs the grid): start the server, run its points, stop it.

`run_points` launches an arm on a model (resolved through the oracle registry, adapted to a peer's start-up refusal
that names its remedy: bench/peer_refusals.py), waits for its health URL, runs each (isl, osl, concurrency) point
with `deltaserve bench serve` in-process and stops the whole process group, writing every run into the grid's record
as it goes. With `warmup_point` the launch first runs its first point once and one wave at its largest concurrency,
unrecorded (`_warmup_run`: what they cost goes under `launches[].warmup_run` and `warmup_wave`), and each run keeps
the kernels its server compiled while it was measured (`runs[].compiles`, server_logs.py). `client_argv` builds a
run's client flags, the same for every arm but the server's URL, `run_seed` its dataset seed and `run_raw_name` its
label.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltaserve.bench.dataset import warmup_seed
from deltaserve.bench.grid_config import REPO_ROOT, Arm, GridConfig, Launch, Model, expand, resolve
from deltaserve.bench.grid_ratios import ACCEPTANCE, HIT_RATE, acceptance_text, format_percent
from deltaserve.bench.peer_refusals import refusal_key, relaunch_count, with_max_num_seqs
from deltaserve.bench.provenance import probe_version, server_version
from deltaserve.bench.server_logs import jit_compiles, log_size, prefill_kernels
from deltaserve.bench.server_process import Server

if TYPE_CHECKING:  # bench/grid.py imports this module
    from deltaserve.bench.grid import Grid

DROPPED_RESULT_FIELDS = ("latencies", "input_lens", "output_lens", "start_times", "ttfts", "itls", "errors")


def run_seed(config: GridConfig, isl: int, osl: int, concurrency: int, is_warmup: bool = False) -> int:
    """The dataset seed of one point: the grid's seed moved by the point, so that no two runs of an arm send the same
    prompts. With one seed for all, each run's prompts began with the previous run's (the random dataset draws in
    order), and a server with prefix caching on (deltaserve's default, vLLM's from 0.34) hit them: ~25 % of the
    prompt tokens at c8 and c32 on the 27B, worth x1.05 / x1.13 output throughput against the same server with it off
    (grids/h200_prefix_random-27b-20261206-s27.json), a lead a peer with caching off could not have. The same for
    every arm of the point, and for its drift run. A launch's warm-up point (`is_warmup`) draws apart from the point
    it warms: with the point's own seed its prompts were the measured run's, and the 27B's first long point hit 99.6 %
    of its prompt tokens (grids/h100_long-27b-20261206-s31.json)."""
    seed = config.seed + 1009 * concurrency + 10007 * isl + osl
    return warmup_seed(seed) if is_warmup else seed


def client_argv(
    launch: Launch,
    config: GridConfig,
    isl: int,
    osl: int,
    concurrency: int,
    raw_name: str,
    is_warmup: bool = False,
    num_prompts: int | None = None,
) -> list[str]:
    """The `deltaserve bench serve` flags for one run: identical for every arm except the server's URL. The client's
    warm-up requests send prompts of their own (--warmup-distinct): vLLM's client re-sends the first measured prompt,
    which a caching server then answers from its cache (one prompt of each long point's four at c1). `num_prompts`
    replaces the grid's count for the point (the warm-up wave's one prompt per concurrency slot)."""
    return [
        "--base-url", launch.base_url,
        "--tokenizer", expand(launch.model.path, {}),
        *config.dataset.client_flags(config.lengths, isl, osl, concurrency),
        "--random-input-len", str(isl),
        "--random-output-len", str(osl),
        "--num-prompts", str(config.num_prompts(concurrency) if num_prompts is None else num_prompts),
        "--max-concurrency", str(concurrency),
        "--num-warmups", str(config.num_warmups),
        "--seed", str(run_seed(config, isl, osl, concurrency, is_warmup)),
        "--warmup-distinct",
        "--disable-tqdm",
        "--label", raw_name,
        *config.client_args,
    ]  # fmt: skip


def run_raw_name(arm: str, model: str, isl: int, osl: int, concurrency: int, is_drift_check: bool = False) -> str:
    """A run's label and the stem of its client result under raw/ (bench/late_compiles.py finds it by this)."""
    return f"{arm}-{model}-{isl}x{osl}-c{concurrency}" + ("-drift" if is_drift_check else "")


def _warmup_wave(points: list[tuple[int, int, int]]) -> tuple[int, int, int] | None:
    """The warm-up wave of a launch that runs `points`: the first point's lengths at the largest concurrency, when
    that is larger than the first point's (a launch of one concurrency needs none)."""
    if not points:
        return None
    isl, osl, first = points[0]
    largest = max(concurrency for _, _, concurrency in points)
    return (isl, osl, largest) if largest > first else None


def _note_deviations(entry: dict[str, Any], launch: Launch) -> None:
    """Add the registry's deviations of `launch` and its denominator note (the deviations' and the traffic's) to
    the record's arm entry."""
    if launch.deviations:
        entry["deviations"] = sorted({*entry.get("deviations", []), *launch.deviations})
    note = launch.denominator_note
    if note and note not in (entry.get("denominator_note") or ""):
        entry["denominator_note"] = f"{entry['denominator_note']} {note}" if entry.get("denominator_note") else note


def _note_server_log(entry: dict[str, Any], log_path: Path, measured_from: int | None) -> None:
    """What the launch's log says (server_logs.py): a deltaserve server's `prefill_kernels`, and the kernels compiled
    while serving, `late_compiles` during the measured runs and `warmup_compiles` during the warm-up point; nothing
    when the server never became healthy."""
    if measured_from is None:
        return
    kernels = prefill_kernels(log_path)
    if kernels is not None:  # a deltaserve server: the attention and GDN prefill kernels it picked at start-up
        entry["prefill_kernels"] = kernels
    late = jit_compiles(log_path, measured_from)
    entry["late_compiles"] = late
    if measured_from:
        entry["warmup_compiles"] = jit_compiles(log_path, 0, measured_from)
    if late:
        print(f"[grid] {entry['arm']} on {entry['model']}: compiled while measured: {', '.join(late)}", flush=True)


def run_points(
    grid: Grid,
    arm: Arm,
    model: Model,
    points: list[tuple[int, int, int]],
    is_drift_check: bool = False,
    is_relaunch: bool = False,
) -> list[dict[str, Any]]:
    """Launch `arm` on `model`, run every (isl, osl, concurrency) point, stop it; returns the runs. A peer whose
    start-up refusal names its remedy (deltaserve/bench/peer_refusals.py) is launched once more with it."""
    from deltaserve.bench.serve_cli import parse_bench_args, run_bench

    # a launch that can finish its first point goes ahead; the points after it that would not finish are left
    # for a resumed call (the record names them), so a short call still measures what fits
    is_warming = grid.config.warmup_point and not is_drift_check  # its first point once, unrecorded
    # then one wave at its largest concurrency (not for conversations: their length is clients x turns)
    wave = _warmup_wave(points) if is_warming and not grid.config.dataset.is_multi_turn else None
    expected_s = grid.expected_startup_s(arm, model) + arm.expected_run_s * (1 + is_warming + (wave is not None))
    if grid._is_past_deadline(expected_s):
        grid.record["skipped"].append({"arm": arm.name, "model": model.name, "reason": "deadline"})
        print(f"[grid] {arm.name} on {model.name}: skipped, it would not finish before the deadline", flush=True)
        grid.save()
        return []
    adapted = grid.record["arms"][arm.name].get("max_num_seqs_by_model", {}).get(model.name)
    if adapted is not None and not is_relaunch:  # an earlier call's refusal named the count (peer_refusals.py)
        arm = with_max_num_seqs(arm, adapted)
    launch = resolve(arm, model, grid.config)
    known = grid.known_refusals.get(refusal_key(launch.argv)) if adapted is None and not is_relaunch else None
    if known is not None:  # --adapt-from: this very launch was refused on these GPUs before
        arm = with_max_num_seqs(arm, known)
        launch = resolve(arm, model, grid.config)
        grid.record["arms"][arm.name].setdefault("max_num_seqs_by_model", {})[model.name] = known
        print(f"[grid] {arm.name} on {model.name}: --max-num-seqs {known}, as {grid.adapt_from} recorded",
              flush=True)  # fmt: skip
    _note_deviations(grid.record["arms"][arm.name], launch)
    index = len(grid.record["launches"])
    log_path = grid.raw_dir / f"server-{index:02d}-{arm.name}-{model.name}.log"
    entry: dict[str, Any] = {
        "arm": arm.name,
        "model": model.name,
        "argv": launch.argv,
        "command_line": shlex.join(launch.argv),
        "env": launch.env_overrides,
        "exemption": launch.exemption,
        "registry_reasons": launch.reasons,
        "deviations": launch.deviations,
        "is_drift_check": is_drift_check,
        "log": os.path.relpath(log_path, grid.record_path.parent),
        "engine_version": None,
        "startup_s": None,
        "error": None,
    }
    if known is not None:
        entry["adapted_from"] = f"--max-num-seqs {known}: {grid.adapt_from} recorded this launch's refusal"
    grid.record["launches"].append(entry)
    print(f"[grid] {arm.name} on {model.name}: {entry['command_line']}", flush=True)
    server = Server(launch, log_path)
    runs: list[dict[str, Any]] = []
    measured_from: int | None = None  # the log's offset where measured runs begin; None: never healthy
    try:
        server.start()
        entry["startup_s"] = round(server.wait_healthy(arm.startup_timeout_s), 1)
        print(f"[grid] {arm.name} healthy after {entry['startup_s']} s", flush=True)
        entry["engine_version"] = server_version(launch.base_url) or probe_version(
            launch.version_probe, {**os.environ, **launch.env_overrides}, REPO_ROOT
        )
        grid.save()
        measured_from = 0
        if is_warming and points:
            entry["warmup_run"] = _warmup_run(grid, launch, arm, model, points[0])
            if wave is not None:
                entry["warmup_wave"] = _warmup_run(grid, launch, arm, model, wave, num_prompts=wave[2])
            measured_from = log_size(log_path)
            grid.save()
        for position, (isl, osl, concurrency) in enumerate(points):
            if position > 0 and grid._is_past_deadline(arm.expected_run_s):
                left = [f"{i}x{o}-c{c}" for i, o, c in points[position:]]
                grid.record["skipped"].append(
                    {"arm": arm.name, "model": model.name, "reason": "deadline", "points": left}
                )
                print(f"[grid] {arm.name} on {model.name}: {', '.join(left)} left for a resumed call (deadline)",
                      flush=True)  # fmt: skip
                break
            raw_name = run_raw_name(arm.name, model.name, isl, osl, concurrency, is_drift_check)
            argv = client_argv(launch, grid.config, isl, osl, concurrency, raw_name)
            run: dict[str, Any] = {
                "arm": arm.name,
                "model": model.name,
                "isl": isl,
                "osl": osl,
                "concurrency": concurrency,
                "is_drift_check": is_drift_check,
                "launch_index": index,
                "client_command_line": "deltaserve bench serve " + shlex.join(argv),
                "metrics": None,
                "error": None,
            }
            marks = {"measuring": log_size(log_path)}  # moved to the end of the client's warm-up requests

            def mark_measuring(marks: dict[str, int] = marks) -> None:
                marks["measuring"] = log_size(log_path)

            try:
                result = run_bench(parse_bench_args(argv), timeout_s=grid.config.run_timeout_s,
                                   on_measuring=mark_measuring)  # fmt: skip
                (grid.raw_dir / f"{raw_name}.json").write_text(json.dumps(result, indent=2) + "\n")
                run["metrics"] = {k: v for k, v in result.items() if k not in DROPPED_RESULT_FIELDS}
                print(
                    f"[grid] {raw_name}: out {result['output_throughput']:.1f} tok/s, "
                    f"TTFT med {result.get('median_ttft_ms', math.nan):.1f} ms, "
                    f"TPOT med {result.get('median_tpot_ms', math.nan):.2f} ms, "
                    f"prefix cache hit rate {format_percent(result.get(HIT_RATE))}, failed {result['failed']}"
                    + acceptance_text(result.get(ACCEPTANCE)),
                    flush=True,
                )
            except Exception as exc:  # one failed point must not lose the rest of the grid
                run["error"] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                print(f"[grid] {raw_name}: FAILED {run['error']}", flush=True)
            # what the server compiled while this run's measured requests ran: a step stalled (not steady state)
            run["compiles"] = jit_compiles(log_path, marks["measuring"])
            if run["compiles"]:
                print(f"[grid] {raw_name}: compiled while measured: {', '.join(run['compiles'])}", flush=True)
            runs.append(run)
            grid.record["runs"].append(run)
            grid.save()
    except Exception as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[grid] {arm.name} on {model.name}: {entry['error']}", flush=True)
    finally:
        entry["is_port_freed"] = server.stop(grid.config.stop_timeout_s)
        _note_server_log(entry, log_path, measured_from)
        grid.save()
    named = relaunch_count(log_path) if entry["error"] and not runs and not is_relaunch else None
    if named is not None:
        refused, asked = named
        entry["adapted_to"] = f"--max-num-seqs {asked}: vLLM refused max_num_seqs {refused} and asked for {asked}"
        grid.record["arms"][arm.name].setdefault("max_num_seqs_by_model", {})[model.name] = asked
        print(f"[grid] {arm.name} on {model.name}: relaunching with --max-num-seqs {asked}, as its refusal asks",
              flush=True)  # fmt: skip
        grid.save()
        return run_points(grid, with_max_num_seqs(arm, asked), model, points, is_drift_check, is_relaunch=True)
    return runs


def _warmup_run(
    grid: Grid, launch: Launch, arm: Arm, model: Model, point: tuple[int, int, int], num_prompts: int | None = None
) -> dict[str, Any]:
    """A point run once before any measured run (the launch's first point, then the warm-up wave's
    `num_prompts`), its result kept out of `runs` (config warmup_point): what it cost and whether it failed, so a
    reader can see what the measured points no longer pay."""
    from deltaserve.bench.serve_cli import parse_bench_args, run_bench

    isl, osl, concurrency = point
    raw_name = run_raw_name(arm.name, model.name, isl, osl, concurrency) + "-warmup"
    argv = client_argv(launch, grid.config, isl, osl, concurrency, raw_name, is_warmup=True,
                       num_prompts=num_prompts)  # fmt: skip
    started = time.monotonic()
    summary: dict[str, Any] = {"point": f"{isl}x{osl}-c{concurrency}", "error": None}
    if num_prompts is not None:
        summary["num_prompts"] = num_prompts
    try:
        result = run_bench(parse_bench_args(argv), timeout_s=grid.config.run_timeout_s)
        summary.update(output_throughput=result.get("output_throughput"), failed=result.get("failed"),
                       p99_ttft_ms=result.get("p99_ttft_ms"))  # fmt: skip
    except Exception as exc:  # a failed warm-up is recorded; the measured points still run
        summary["error"] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    summary["wall_s"] = round(time.monotonic() - started, 1)
    print(f"[grid] {raw_name} (not recorded): {summary}", flush=True)
    return summary
