"""`deltaserve bench grid CONFIG.toml`: arms x concurrencies x (ISL, OSL), one client, one committed record (the
command line is bench/grid_cli.py, one launch of an arm bench/grid_launch.py, the ratios bench/grid_ratios.py).

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
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaserve.bench.grid_config import REPO_ROOT, Arm, GridConfig, Model, expand
from deltaserve.bench.grid_launch import run_points
from deltaserve.bench.grid_ratios import compute_ratios, ratio
from deltaserve.bench.peer_refusals import known_refusals
from deltaserve.bench.provenance import host_facts

DEFAULT_RESULT_DIR = REPO_ROOT / "benchmarks" / "results" / "grids"  # the grid kind of benchmarks/results/
RECORD_SCHEMA = "deltaserve-grid-record/1"


class GridInterrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP during a grid: unwinds through every `finally`, so the running server is stopped. A
    KeyboardInterrupt, because asyncio lets only those (and SystemExit) out of its callbacks: a signal that lands
    while the client's event loop is reading a socket is raised inside the transport's callback, where any other
    BaseException becomes the connection's error, a failed request, and the grid ran on."""


def _interrupt(signum: int, frame: object) -> None:
    raise GridInterrupted(f"signal {signum}")


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
                            run_points(self, arm, model, [point])
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
                    runs = done + (run_points(self, arm, model, todo) if todo else [])
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
        reruns = run_points(self, arm, model, [(isl, osl, concurrency)], is_drift_check=True)
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
