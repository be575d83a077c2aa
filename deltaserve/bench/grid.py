"""`deltaserve bench grid CONFIG.toml`: arms x concurrencies x (ISL, OSL), one client, one committed record (the
command line is bench/grid_cli.py, the ratios bench/grid_ratios.py).

An arm is a named server launch: a command line (or `oracle = "vllm"`, built by the oracle registry so the
peer always runs in its production configuration), an environment, a health URL and a startup timeout. The
grid starts an arm, waits for its health URL, runs `deltaserve bench serve` in-process with the same flags
for every arm, and stops it (the whole process group, then waits for the port and the GPU to be free).

Schedule: with `is_restart_cheap = true` the arms alternate A B A B at every point, so slow drift of the
machine hits both alike. Otherwise each arm runs all points in one launch, and at the end the first arm is
launched again at `drift_concurrency`; the record keeps both measurements as the drift of that session. With
`warmup_point = true` each launch first runs its first point once and then one wave (as many prompts as the
concurrency) at its largest concurrency, and records only what they cost (`launches[].warmup_run`, `warmup_wave`):
vLLM compiles kernels for batch shapes its start-up missed during its first runs (a c8 point once read at half its
rate, p99 TTFT 8.2 s), and FlashInfer's GDN prefill for several sequences at the first step that holds two
(`_FullyFusedDeltaRuleSm90`, ~8-10 s: a c1 warm-up never meets it), which a measured point must not pay. Each run
records the compiles its server logged while it ran (`runs[].compiles`, server_logs.py), and its ratios say so.

The record (JSON, rewritten after every run so a killed grid still leaves one) holds, per arm and model, the
exact command line, environment overrides, engine version, startup time; host, GPU, driver, date and git
commit; the metrics of every run; the subject/peer ratios (output throughput, TTFT median and p99, TPOT
median, peak GPU memory); the drift check; and each arm's optional `denominator_note`.

`--resume RECORD` continues a record in a later call on the same machine (one device call cannot hold three
cold server starts): points the record already measured are not run again, the drift re-run still comes last,
and the record lists every call's host facts under `resumed`.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaserve.bench.dataset import warmup_seed
from deltaserve.bench.grid_config import REPO_ROOT, Arm, GridConfig, Launch, Model, expand, resolve
from deltaserve.bench.grid_ratios import ACCEPTANCE, HIT_RATE, acceptance_text, compute_ratios, format_percent, ratio
from deltaserve.bench.peer_refusals import known_refusals, refusal_key, relaunch_count, with_max_num_seqs
from deltaserve.bench.provenance import host_facts, probe_version, server_version
from deltaserve.bench.server_logs import jit_compiles, log_size, prefill_kernels
from deltaserve.bench.server_process import Server

DEFAULT_RESULT_DIR = REPO_ROOT / "benchmarks" / "results" / "grids"  # the grid kind of benchmarks/results/
RECORD_SCHEMA = "deltaserve-grid-record/1"
DROPPED_RESULT_FIELDS = ("latencies", "input_lens", "output_lens", "start_times", "ttfts", "itls", "errors")


class GridInterrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP during a grid: unwinds through every `finally`, so the running server is stopped. A
    KeyboardInterrupt, because asyncio lets only those (and SystemExit) out of its callbacks: a signal that lands
    while the client's event loop is reading a socket is raised inside the transport's callback, where any other
    BaseException becomes the connection's error, a failed request, and the grid ran on."""


def _interrupt(signum: int, frame: object) -> None:
    raise GridInterrupted(f"signal {signum}")


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


def _arm_entry(arm: Arm) -> dict[str, Any]:
    """What a record states about an arm besides its launches (the registry's deviations join at launch)."""
    entry = {
        "role": arm.role,
        "oracle": arm.oracle,
        "denominator_note": arm.denominator_note,
        "exemption": arm.exemption,
    }
    if arm.baseline:
        entry["baseline"] = arm.baseline
    return entry


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


class Grid:
    """Runs a config and keeps the record current on disk."""

    def __init__(
        self,
        config: GridConfig,
        result_dir: Path,
        raw_dir: Path | None = None,
        record_name: str | None = None,
        deadline_s: float | None = None,
        is_drift_enabled: bool = True,
        resume_path: Path | None = None,
        adapt_from: Path | None = None,
    ) -> None:
        self.config = config
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.record_path = resume_path or result_dir / f"{record_name or config.name + '-' + stamp}.json"
        self.raw_dir = raw_dir or self.record_path.parent / "raw" / self.record_path.stem
        self.deadline_s = deadline_s
        self.is_drift_enabled = is_drift_enabled
        self.t0 = time.monotonic()
        self.previous_wall_s = 0.0
        self.record: dict[str, Any] = self._new_record() if resume_path is None else self._resumed_record(resume_path)
        # an earlier record's refusals (peer_refusals.py): the same launch on the same GPUs starts adapted
        self.adapt_from = adapt_from
        self.known_refusals: dict[tuple[str, ...], int] = {}
        self.earlier_launches: list[dict[str, Any]] = []  # the adapted record's, on the same GPUs (start-up times)
        if adapt_from is not None:
            gpus = (self.record.get("host") or {}).get("gpus") or []
            earlier = json.loads(adapt_from.read_text())
            self.known_refusals = known_refusals(earlier, gpus)
            if ((earlier.get("host") or {}).get("gpus") or []) == gpus:
                self.earlier_launches = list(earlier.get("launches") or [])

    def _new_record(self) -> dict[str, Any]:
        config = self.config
        return {
            "schema": RECORD_SCHEMA,
            "grid": config.name,
            "title": config.title,
            "description": config.description,
            "config_path": os.path.relpath(config.source_path, REPO_ROOT),
            "schedule": "alternating"
            if config.is_restart_cheap
            else ("sequential+drift" if self.is_drift_enabled else "sequential (no drift re-run: --no-drift)"),
            "is_complete": False,
            "host": host_facts(REPO_ROOT),
            "lengths": [list(pair) for pair in config.lengths],
            "dataset": {
                "name": config.dataset.name,
                **config.dataset.mm,
                **config.dataset.prefix,
                **config.dataset.multi_turn,
            },  # fmt: skip
            "concurrencies": config.concurrencies,
            "models": [{"name": m.name, "path": expand(m.path, {})} for m in config.models],
            "arms": {arm.name: _arm_entry(arm) for arm in config.arms},
            "launches": [],
            "runs": [],
            "ratios": [],
            "drift": [],
            "skipped": [],
        }

    def _resumed_record(self, path: Path) -> dict[str, Any]:
        """The record at `path`, checked to be this grid's, with this call's arms and host facts added."""
        record = json.loads(path.read_text())
        if record.get("schema") != RECORD_SCHEMA or record.get("grid") != self.config.name:
            raise ValueError(f"{path} is not a {RECORD_SCHEMA} record of grid {self.config.name!r}")
        for arm in self.config.arms:
            record["arms"].setdefault(arm.name, _arm_entry(arm))
        record["resumed"] = [*record.get("resumed", []), host_facts(REPO_ROOT)]
        record["is_complete"] = False
        # A resumed call re-runs only unmeasured points, so earlier skips are no longer current.
        record["skipped"] = []
        record["drift"] = [d for d in record["drift"] if (d.get("rerun") or {}).get("output_throughput") is not None]
        self.previous_wall_s = float(record.get("wall_s") or 0.0)
        return record

    def _measured_points(self, arm: Arm, model: Model, points: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
        """The record's successful first-pass runs of `arm` on `model` at `points` (from an earlier call)."""
        wanted = set(points)
        return [
            run
            for run in self.record["runs"]
            if run["arm"] == arm.name
            and run["model"] == model.name
            and not run["is_drift_check"]
            and run["metrics"] is not None
            and (run["isl"], run["osl"], run["concurrency"]) in wanted
        ]

    # -- bookkeeping ------------------------------------------------------------------------------------

    def save(self) -> None:
        self.record_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        tmp.replace(self.record_path)

    def expected_startup_s(self, arm: Arm, model: Model) -> float:
        """How long `arm` should take to start on `model`: the slowest healthy start-up of that launch measured in
        this record or the adapted one (same GPUs) with a fifth and 15 s to spare, else the grid file's guess. A
        measured figure replaces the guess either way: vLLM's 27B start-up took 175 s on an H100 where the grid file
        said 300, and the guess skipped a launch that had room (grids/h100_long16k-27b-20261206-s32.json)."""
        measured = [
            float(entry["startup_s"])
            for entry in (*self.earlier_launches, *self.record.get("launches", []))
            if entry.get("arm") == arm.name and entry.get("model") == model.name and entry.get("startup_s") is not None
        ]  # a launch that became healthy has its start-up time, whatever happened after
        return 1.2 * max(measured) + 15.0 if measured else arm.expected_startup_s

    def _is_past_deadline(self, expected_s: float) -> bool:
        """True when a launch expected to take `expected_s` would end after the deadline."""
        return self.deadline_s is not None and time.monotonic() - self.t0 + expected_s > self.deadline_s

    # -- one launch ---------------------------------------------------------------------------------------

    def _run_points(
        self,
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
        is_warming = self.config.warmup_point and not is_drift_check  # its first point once, unrecorded
        # then one wave at its largest concurrency (not for conversations: their length is clients x turns)
        wave = _warmup_wave(points) if is_warming and not self.config.dataset.is_multi_turn else None
        expected_s = self.expected_startup_s(arm, model) + arm.expected_run_s * (1 + is_warming + (wave is not None))
        if self._is_past_deadline(expected_s):
            self.record["skipped"].append({"arm": arm.name, "model": model.name, "reason": "deadline"})
            print(f"[grid] {arm.name} on {model.name}: skipped, it would not finish before the deadline", flush=True)
            self.save()
            return []
        adapted = self.record["arms"][arm.name].get("max_num_seqs_by_model", {}).get(model.name)
        if adapted is not None and not is_relaunch:  # an earlier call's refusal named the count (peer_refusals.py)
            arm = with_max_num_seqs(arm, adapted)
        launch = resolve(arm, model, self.config)
        known = self.known_refusals.get(refusal_key(launch.argv)) if adapted is None and not is_relaunch else None
        if known is not None:  # --adapt-from: this very launch was refused on these GPUs before
            arm = with_max_num_seqs(arm, known)
            launch = resolve(arm, model, self.config)
            self.record["arms"][arm.name].setdefault("max_num_seqs_by_model", {})[model.name] = known
            print(f"[grid] {arm.name} on {model.name}: --max-num-seqs {known}, as {self.adapt_from} recorded",
                  flush=True)  # fmt: skip
        _note_deviations(self.record["arms"][arm.name], launch)
        index = len(self.record["launches"])
        log_path = self.raw_dir / f"server-{index:02d}-{arm.name}-{model.name}.log"
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
            "log": os.path.relpath(log_path, self.record_path.parent),
            "engine_version": None,
            "startup_s": None,
            "error": None,
        }
        if known is not None:
            entry["adapted_from"] = f"--max-num-seqs {known}: {self.adapt_from} recorded this launch's refusal"
        self.record["launches"].append(entry)
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
            self.save()
            measured_from = 0
            if is_warming and points:
                entry["warmup_run"] = self._warmup_run(launch, arm, model, points[0])
                if wave is not None:
                    entry["warmup_wave"] = self._warmup_run(launch, arm, model, wave, num_prompts=wave[2])
                measured_from = log_size(log_path)
                self.save()
            for position, (isl, osl, concurrency) in enumerate(points):
                if position > 0 and self._is_past_deadline(arm.expected_run_s):
                    left = [f"{i}x{o}-c{c}" for i, o, c in points[position:]]
                    self.record["skipped"].append(
                        {"arm": arm.name, "model": model.name, "reason": "deadline", "points": left}
                    )
                    print(f"[grid] {arm.name} on {model.name}: {', '.join(left)} left for a resumed call (deadline)",
                          flush=True)  # fmt: skip
                    break
                raw_name = run_raw_name(arm.name, model.name, isl, osl, concurrency, is_drift_check)
                argv = client_argv(launch, self.config, isl, osl, concurrency, raw_name)
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
                    result = run_bench(parse_bench_args(argv), timeout_s=self.config.run_timeout_s,
                                       on_measuring=mark_measuring)  # fmt: skip
                    (self.raw_dir / f"{raw_name}.json").write_text(json.dumps(result, indent=2) + "\n")
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
                self.record["runs"].append(run)
                self.save()
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[grid] {arm.name} on {model.name}: {entry['error']}", flush=True)
        finally:
            entry["is_port_freed"] = server.stop(self.config.stop_timeout_s)
            _note_server_log(entry, log_path, measured_from)
            self.save()
        named = relaunch_count(log_path) if entry["error"] and not runs and not is_relaunch else None
        if named is not None:
            refused, asked = named
            entry["adapted_to"] = f"--max-num-seqs {asked}: vLLM refused max_num_seqs {refused} and asked for {asked}"
            self.record["arms"][arm.name].setdefault("max_num_seqs_by_model", {})[model.name] = asked
            print(f"[grid] {arm.name} on {model.name}: relaunching with --max-num-seqs {asked}, as its refusal asks",
                  flush=True)  # fmt: skip
            self.save()
            return self._run_points(with_max_num_seqs(arm, asked), model, points, is_drift_check, is_relaunch=True)
        return runs

    def _warmup_run(
        self, launch: Launch, arm: Arm, model: Model, point: tuple[int, int, int], num_prompts: int | None = None
    ) -> dict[str, Any]:
        """A point run once before any measured run (the launch's first point, then the warm-up wave's
        `num_prompts`), its result kept out of `runs` (config warmup_point): what it cost and whether it failed, so a
        reader can see what the measured points no longer pay."""
        from deltaserve.bench.serve_cli import parse_bench_args, run_bench

        isl, osl, concurrency = point
        raw_name = run_raw_name(arm.name, model.name, isl, osl, concurrency) + "-warmup"
        argv = client_argv(launch, self.config, isl, osl, concurrency, raw_name, is_warmup=True,
                           num_prompts=num_prompts)  # fmt: skip
        started = time.monotonic()
        summary: dict[str, Any] = {"point": f"{isl}x{osl}-c{concurrency}", "error": None}
        if num_prompts is not None:
            summary["num_prompts"] = num_prompts
        try:
            result = run_bench(parse_bench_args(argv), timeout_s=self.config.run_timeout_s)
            summary.update(output_throughput=result.get("output_throughput"), failed=result.get("failed"),
                           p99_ttft_ms=result.get("p99_ttft_ms"))  # fmt: skip
        except Exception as exc:  # a failed warm-up is recorded; the measured points still run
            summary["error"] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        summary["wall_s"] = round(time.monotonic() - started, 1)
        print(f"[grid] {raw_name} (not recorded): {summary}", flush=True)
        return summary

    # -- the whole grid -----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Every model, arm and point, in the configured schedule; SIGTERM/SIGHUP stop it cleanly."""
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            return self._run()
        except GridInterrupted as exc:
            self.record["interrupted"] = str(exc)
            self.save()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> dict[str, Any]:
        from deltaserve.bench.serve_cli import load_tokenizer

        config = self.config
        self.save()
        # Load every model's tokenizer before any server starts: a missing package or a bad path must not cost
        # a (minutes-long) server start, and the client then reuses the cached tokenizer for every run.
        for model in config.models:
            try:
                load_tokenizer(expand(model.path, {}))
            except Exception as exc:
                self.record["error"] = f"tokenizer of {model.name}: {type(exc).__name__}: {exc}"
                print(f"[grid] {self.record['error']}", flush=True)
                self.save()
                return self.record
        for model in config.models:
            points = [(isl, osl, c) for isl, osl in config.lengths for c in config.concurrencies]
            if config.is_restart_cheap:
                for point in points:
                    for arm in config.arms:
                        if not self._measured_points(arm, model, [point]):
                            self._run_points(arm, model, [point])
            else:
                # the drift re-run relaunches the first subject arm (deltaserve), whatever order --arms gave
                drift_arm = next((arm for arm in config.arms if arm.role == "subject"), config.arms[0])
                first_runs: list[dict[str, Any]] = []
                for arm in config.arms:
                    done = self._measured_points(arm, model, points)
                    measured = {(r["isl"], r["osl"], r["concurrency"]) for r in done}
                    todo = [point for point in points if point not in measured]
                    if not todo:
                        print(f"[grid] {arm.name} on {model.name}: measured in an earlier call", flush=True)
                    runs = done + (self._run_points(arm, model, todo) if todo else [])
                    if arm is drift_arm:
                        first_runs = runs
                is_drift_done = any(
                    d["arm"] == drift_arm.name and d["model"] == model.name for d in self.record["drift"]
                )
                if self.is_drift_enabled and len(config.arms) > 1 and config.drift_concurrency and not is_drift_done:
                    self._drift(drift_arm, model, first_runs)
        self.record["ratios"] = compute_ratios(self.record)
        self.record["is_complete"] = True
        self.record["wall_s"] = round(self.previous_wall_s + time.monotonic() - self.t0, 1)
        self.save()
        return self.record

    def _drift(self, arm: Arm, model: Model, first_runs: list[dict[str, Any]]) -> None:
        isl, osl = self.config.lengths[0]
        concurrency = self.config.drift_concurrency
        assert concurrency is not None
        reruns = self._run_points(arm, model, [(isl, osl, concurrency)], is_drift_check=True)
        first = next((r for r in first_runs if r["concurrency"] == concurrency and r["isl"] == isl), None)
        rerun = reruns[0] if reruns else None
        fields = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
        entry: dict[str, Any] = {"arm": arm.name, "model": model.name, "isl": isl, "osl": osl}
        entry["concurrency"] = concurrency
        for label, run in (("first", first), ("rerun", rerun)):
            metrics = (run or {}).get("metrics") or {}
            entry[label] = {name: metrics.get(name) for name in fields}
        change = ratio(entry["rerun"]["output_throughput"], entry["first"]["output_throughput"])
        entry["output_throughput_change"] = None if change is None else change - 1.0
        self.record["drift"].append(entry)
        self.save()


# Two arms whose shares of distinct outputs differ by more than this factor did visibly different work.
