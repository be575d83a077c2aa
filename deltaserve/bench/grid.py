"""`deltaserve bench grid CONFIG.toml`: arms x concurrencies x (ISL, OSL), one client, one committed record.

An arm is a named server launch: a command line (or `oracle = "vllm"`, built by the oracle registry so the
peer always runs in its production configuration), an environment, a health URL and a startup timeout. The
grid starts an arm, waits for its health URL, runs `deltaserve bench serve` in-process with the same flags
for every arm, and stops it (the whole process group, then waits for the port and the GPU to be free).

Schedule: with `is_restart_cheap = true` the arms alternate A B A B at every point, so slow drift of the
machine hits both alike. Otherwise each arm runs all points in one launch, and at the end the first arm is
launched again at `drift_concurrency`; the record keeps both measurements as the drift of that session.

The record (JSON, rewritten after every run so a killed grid still leaves one) holds, per arm and model, the
exact command line, environment overrides, engine version, startup time; host, GPU, driver, date and git
commit; the metrics of every run; the subject/peer ratios (output throughput, TTFT median and p99, TPOT
median, peak GPU memory); the drift check; and each arm's optional `denominator_note`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaserve.bench import registry
from deltaserve.bench.nvml import sample_used_gib_once
from deltaserve.bench.provenance import NO_PROXY, host_facts, probe_version, server_version

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULT_DIR = REPO_ROOT / "benchmarks" / "results"
RECORD_SCHEMA = "deltaserve-grid-record/1"
RATIO_FIELDS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "peak_gpu_memory_gib")
DROPPED_RESULT_FIELDS = ("latencies", "input_lens", "output_lens", "start_times", "ttfts", "itls", "errors")
GPU_IDLE_GIB = 2.0  # below this much used device memory, the previous server has let go of the GPU
PLACEHOLDER_RE = re.compile(r"\{(model|model_name|port|python|repo|max_isl)\}")


def pidfile() -> Path:
    """Where the running server's process group id is kept, so a grid killed without cleanup (SIGKILL) leaves
    a note that the next run of the harness script uses to stop that server (DELTASERVE_GRID_PIDFILE)."""
    return Path(os.environ.get("DELTASERVE_GRID_PIDFILE", "/tmp/deltaserve-grid-server.pgid"))


class GridInterrupted(BaseException):
    """SIGTERM/SIGHUP during a grid: unwinds through every `finally`, so the running server is stopped."""


def _interrupt(signum: int, frame: object) -> None:
    raise GridInterrupted(f"signal {signum}")


@dataclass
class Arm:
    """One server launch recipe (templates are expanded per model)."""

    name: str
    role: str = "peer"  # "subject" (deltaserve) or "peer" (the denominator)
    command: list[str] = field(default_factory=list)
    oracle: str | None = None
    site: str = "h200-offline"
    python: str = "{python}"
    extra_args: list[str] = field(default_factory=list)
    drop_flags: list[str] = field(default_factory=list)
    exemption: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    health_url: str = "http://127.0.0.1:{port}/health"
    startup_timeout_s: float = 600.0
    version_probe: list[str] = field(default_factory=list)
    denominator_note: str | None = None
    # Estimates for --deadline-s: a launch starts only if startup + points x run would end before the deadline.
    expected_startup_s: float = 0.0
    expected_run_s: float = 0.0


@dataclass
class Model:
    name: str
    path: str


@dataclass
class GridConfig:
    """A parsed grid TOML file."""

    name: str
    title: str
    description: str
    models: list[Model]
    arms: list[Arm]
    concurrencies: list[int]
    lengths: list[tuple[int, int]]
    prompts_per_concurrency: int = 10
    min_prompts: int = 10
    num_warmups: int = 2
    seed: int = 0
    port: int = 8000
    is_restart_cheap: bool = False
    drift_concurrency: int | None = None
    client_args: list[str] = field(default_factory=list)
    stop_timeout_s: float = 30.0
    run_timeout_s: float | None = None  # one client run longer than this is recorded as failed
    source_path: str = ""

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_concurrency * concurrency)


def load_config(path: Path) -> GridConfig:
    """Parse and validate a grid TOML file."""
    raw = tomllib.loads(path.read_text())
    grid = raw.get("grid", {})
    arms = []
    for item in raw.get("arms", []):
        arm = Arm(**{k: v for k, v in item.items() if k in Arm.__dataclass_fields__})
        unknown = set(item) - set(Arm.__dataclass_fields__)
        if unknown:
            raise ValueError(f"arm {arm.name!r}: unknown keys {sorted(unknown)}")
        if bool(arm.command) == bool(arm.oracle):
            raise ValueError(f"arm {arm.name!r}: give exactly one of `command` or `oracle`")
        if arm.role not in ("subject", "peer"):
            raise ValueError(f"arm {arm.name!r}: role must be subject or peer")
        if arm.drop_flags and not arm.exemption:
            raise ValueError(f"arm {arm.name!r}: drop_flags needs an `exemption` reason")
        arms.append(arm)
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate arm names in {path}")
    models = [Model(str(m["name"]), str(m["path"])) for m in raw.get("models", [])]
    if not arms or not models:
        raise ValueError(f"{path}: needs at least one [[arms]] and one [[models]]")
    known = set(GridConfig.__dataclass_fields__) - {"name", "title", "description", "models", "arms", "source_path"}
    unknown = set(grid) - known - {"name", "title", "description"}
    if unknown:
        raise ValueError(f"[grid]: unknown keys {sorted(unknown)}")
    options = {k: v for k, v in grid.items() if k in known}
    options["lengths"] = [tuple(pair) for pair in grid.get("lengths", [[1024, 128]])]
    options.setdefault("concurrencies", [1])
    return GridConfig(
        name=str(grid.get("name", path.stem)),
        title=str(grid.get("title", path.stem)),
        description=str(grid.get("description", "")),
        models=models,
        arms=arms,
        source_path=str(path),
        **options,
    )


def expand(text: str, context: dict[str, str]) -> str:
    """$VARS from the environment, then the grid's own {placeholders} (unknown braces stay as they are)."""
    text = os.path.expandvars(text)
    return PLACEHOLDER_RE.sub(lambda m: context[m.group(1)], text)


@dataclass
class Launch:
    """An arm resolved for one model: what will be run."""

    arm: Arm
    model: Model
    argv: list[str]
    env_overrides: dict[str, str]
    health_url: str
    base_url: str
    version_probe: list[str]
    exemption: str | None
    reasons: list[str]


def resolve(arm: Arm, model: Model, config: GridConfig) -> Launch:
    """Expand templates; for an oracle arm, ask the registry for the production command."""
    max_isl = max(isl for isl, _ in config.lengths)
    context = {
        "model": expand(model.path, {}),
        "model_name": model.name,
        "port": str(config.port),
        "python": sys.executable,
        "repo": str(REPO_ROOT),
        "max_isl": str(max_isl),
    }
    env = {k: expand(str(v), context) for k, v in arm.env.items()}
    exemption = None
    reasons: list[str] = []
    if arm.oracle:
        oracle = registry.oracle_launch(
            arm.oracle,
            context["model"],
            max_isl,
            port=config.port,
            site=arm.site,
            python=expand(arm.python, context),
            extra_args=[expand(a, context) for a in arm.extra_args],
            drop_flags=arm.drop_flags,
            exemption=arm.exemption,
        )
        argv = oracle.argv
        env = {**oracle.env, **env}
        probe = oracle.version_probe
        exemption = oracle.exemption
        reasons = oracle.reasons
    else:
        argv = [expand(a, context) for a in arm.command]
        probe = [expand(a, context) for a in arm.version_probe] or [
            sys.executable,
            "-c",
            "import deltaserve; print(deltaserve.__version__)",
        ]
    health_url = expand(arm.health_url, context)
    match = re.match(r"(https?://[^/]+)", health_url)
    base_url = match.group(1) if match else f"http://127.0.0.1:{config.port}"
    return Launch(arm, model, argv, env, health_url, base_url, probe, exemption, reasons)


def _is_port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


class Server:
    """A server process in its own process group, so stopping it stops every child (engine cores, workers)."""

    def __init__(self, launch: Launch, log_path: Path) -> None:
        self.launch = launch
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        port = re.search(r":(\d+)$", launch.base_url)
        self.port = int(port.group(1)) if port else 80

    def start(self) -> None:
        if _is_port_open(self.port):
            raise RuntimeError(f"port {self.port} is already in use; refusing to start {self.launch.arm.name}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        env = {**os.environ, **self.launch.env_overrides}
        self.process = subprocess.Popen(
            self.launch.argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        pidfile().write_text(f"{self.process.pid}\n")

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until the health URL answered 200; raises if the process died or time ran out."""
        assert self.process is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.launch.arm.name} exited with {self.process.returncode} before healthy")
            try:
                with NO_PROXY.open(self.launch.health_url, timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.launch.arm.name} not healthy after {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> bool:
        """SIGTERM the process group, SIGKILL after `timeout_s`; wait for the port (and the GPU) to be free.

        Returns True when the port was freed.
        """
        if self.process is None:
            return True
        pgid = self.process.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=timeout_s)
                # The leader is gone; make sure no child of the group survives it.
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
        self.process = None
        pidfile().unlink(missing_ok=True)
        t0 = time.monotonic()
        while _is_port_open(self.port) and time.monotonic() - t0 < timeout_s:
            time.sleep(0.25)
        is_port_free = not _is_port_open(self.port)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            used = sample_used_gib_once()
            if used is None or used < GPU_IDLE_GIB:
                break
            time.sleep(1.0)
        return is_port_free


def client_argv(launch: Launch, config: GridConfig, isl: int, osl: int, concurrency: int, raw_name: str) -> list[str]:
    """The `deltaserve bench serve` flags for one run: identical for every arm except the server's URL."""
    return [
        "--base-url", launch.base_url,
        "--tokenizer", expand(launch.model.path, {}),
        "--dataset-name", "random",
        "--random-input-len", str(isl),
        "--random-output-len", str(osl),
        "--num-prompts", str(config.num_prompts(concurrency)),
        "--max-concurrency", str(concurrency),
        "--num-warmups", str(config.num_warmups),
        "--seed", str(config.seed),
        "--disable-tqdm",
        "--label", raw_name,
        *config.client_args,
    ]  # fmt: skip


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


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
    ) -> None:
        self.config = config
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.record_path = result_dir / f"{record_name or config.name + '-' + stamp}.json"
        self.raw_dir = raw_dir or result_dir / "raw" / self.record_path.stem
        self.deadline_s = deadline_s
        self.is_drift_enabled = is_drift_enabled
        self.t0 = time.monotonic()
        self.record: dict[str, Any] = {
            "schema": RECORD_SCHEMA,
            "grid": config.name,
            "title": config.title,
            "description": config.description,
            "config_path": os.path.relpath(config.source_path, REPO_ROOT),
            "schedule": "alternating" if config.is_restart_cheap else "sequential+drift",
            "is_complete": False,
            "host": host_facts(REPO_ROOT),
            "lengths": [list(pair) for pair in config.lengths],
            "concurrencies": config.concurrencies,
            "models": [{"name": m.name, "path": expand(m.path, {})} for m in config.models],
            "arms": {
                arm.name: {
                    "role": arm.role,
                    "oracle": arm.oracle,
                    "denominator_note": arm.denominator_note,
                    "exemption": arm.exemption,
                }
                for arm in config.arms
            },
            "launches": [],
            "runs": [],
            "ratios": [],
            "drift": [],
            "skipped": [],
        }

    # -- bookkeeping ------------------------------------------------------------------------------------

    def save(self) -> None:
        self.record_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        tmp.replace(self.record_path)

    def _is_past_deadline(self, expected_s: float) -> bool:
        """True when a launch expected to take `expected_s` would end after the deadline."""
        return self.deadline_s is not None and time.monotonic() - self.t0 + expected_s > self.deadline_s

    # -- one launch ---------------------------------------------------------------------------------------

    def _run_points(
        self, arm: Arm, model: Model, points: list[tuple[int, int, int]], is_drift_check: bool = False
    ) -> list[dict[str, Any]]:
        """Launch `arm` on `model`, run every (isl, osl, concurrency) point, stop it; returns the runs."""
        from deltaserve.bench.serve_cli import parse_bench_args, run_bench

        if self._is_past_deadline(arm.expected_startup_s + len(points) * arm.expected_run_s):
            self.record["skipped"].append({"arm": arm.name, "model": model.name, "reason": "deadline"})
            print(f"[grid] {arm.name} on {model.name}: skipped, it would not finish before the deadline", flush=True)
            self.save()
            return []
        launch = resolve(arm, model, self.config)
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
            "is_drift_check": is_drift_check,
            "log": os.path.relpath(log_path, self.record_path.parent),
            "engine_version": None,
            "startup_s": None,
            "error": None,
        }
        self.record["launches"].append(entry)
        print(f"[grid] {arm.name} on {model.name}: {entry['command_line']}", flush=True)
        server = Server(launch, log_path)
        runs: list[dict[str, Any]] = []
        try:
            server.start()
            entry["startup_s"] = round(server.wait_healthy(arm.startup_timeout_s), 1)
            print(f"[grid] {arm.name} healthy after {entry['startup_s']} s", flush=True)
            entry["engine_version"] = server_version(launch.base_url) or probe_version(
                launch.version_probe, {**os.environ, **launch.env_overrides}, REPO_ROOT
            )
            self.save()
            for isl, osl, concurrency in points:
                raw_name = f"{arm.name}-{model.name}-{isl}x{osl}-c{concurrency}" + ("-drift" if is_drift_check else "")
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
                try:
                    result = run_bench(parse_bench_args(argv), timeout_s=self.config.run_timeout_s)
                    (self.raw_dir / f"{raw_name}.json").write_text(json.dumps(result, indent=2) + "\n")
                    run["metrics"] = {k: v for k, v in result.items() if k not in DROPPED_RESULT_FIELDS}
                    print(
                        f"[grid] {raw_name}: out {result['output_throughput']:.1f} tok/s, "
                        f"TTFT med {result.get('median_ttft_ms', math.nan):.1f} ms, "
                        f"TPOT med {result.get('median_tpot_ms', math.nan):.2f} ms, "
                        f"failed {result['failed']}",
                        flush=True,
                    )
                except Exception as exc:  # one failed point must not lose the rest of the grid
                    run["error"] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    print(f"[grid] {raw_name}: FAILED {run['error']}", flush=True)
                runs.append(run)
                self.record["runs"].append(run)
                self.save()
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[grid] {arm.name} on {model.name}: {entry['error']}", flush=True)
        finally:
            entry["is_port_freed"] = server.stop(self.config.stop_timeout_s)
            self.save()
        return runs

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
                        self._run_points(arm, model, [point])
            else:
                first_runs: list[dict[str, Any]] = []
                for i, arm in enumerate(config.arms):
                    runs = self._run_points(arm, model, points)
                    if i == 0:
                        first_runs = runs
                if self.is_drift_enabled and len(config.arms) > 1 and config.drift_concurrency:
                    self._drift(config.arms[0], model, first_runs)
        self.record["ratios"] = compute_ratios(self.record)
        self.record["is_complete"] = True
        self.record["wall_s"] = round(time.monotonic() - self.t0, 1)
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


def compute_ratios(record: dict[str, Any]) -> list[dict[str, Any]]:
    """subject / peer for every peer arm and every point both measured (drift re-runs excluded)."""
    roles = {name: arm["role"] for name, arm in record["arms"].items()}
    subjects = [name for name, role in roles.items() if role == "subject"]
    peers = [name for name, role in roles.items() if role == "peer"]
    measured: dict[tuple[str, str, int, int, int], dict[str, Any]] = {}
    for run in record["runs"]:
        if run["metrics"] is None or run["is_drift_check"]:
            continue
        measured[(run["arm"], run["model"], run["isl"], run["osl"], run["concurrency"])] = run["metrics"]
    ratios = []
    for subject in subjects:
        for peer in peers:
            for (arm, model, isl, osl, concurrency), metrics in measured.items():
                if arm != subject:
                    continue
                peer_metrics = measured.get((peer, model, isl, osl, concurrency))
                if peer_metrics is None:
                    continue
                entry: dict[str, Any] = {"subject": subject, "peer": peer, "model": model, "isl": isl, "osl": osl}
                entry["concurrency"] = concurrency
                for name in RATIO_FIELDS:
                    entry[name] = ratio(metrics.get(name), peer_metrics.get(name))
                ratios.append(entry)
    return ratios


def _select(items: list[Any], names: str | None, skip: str | None, what: str) -> list[Any]:
    chosen = list(items)
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        unknown = set(wanted) - {item.name for item in items}
        if unknown:
            raise ValueError(f"unknown {what}: {sorted(unknown)}")
        chosen = [item for item in items if item.name in wanted]
    if skip:
        skipped = {n.strip() for n in skip.split(",")}
        chosen = [item for item in chosen if item.name not in skipped]
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="grid TOML file")
    parser.add_argument("--arms", default=None, help="comma-separated arms to run (default all, in config order)")
    parser.add_argument("--skip-arms", default=None, help="comma-separated arms to leave out")
    parser.add_argument("--models", default=None, help="comma-separated models to run (default all)")
    parser.add_argument("--concurrencies", default=None, help="override, e.g. 1,8,32")
    parser.add_argument("--no-drift", action="store_true", help="skip the drift re-run of the first arm")
    parser.add_argument("--result-dir", type=Path, default=None, help=f"default {DEFAULT_RESULT_DIR}")
    parser.add_argument("--raw-dir", type=Path, default=None, help="per-run JSON and server logs")
    parser.add_argument("--record-name", default=None, help="record file stem (default GRID-DATE)")
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="start no launch that would end (arm expected_s) after this"
    )
    parser.add_argument("--run-timeout-s", type=float, default=None, help="fail a client run that takes longer")
    parser.add_argument("--dry-run", action="store_true", help="print every launch and client command, run nothing")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        config.arms = _select(config.arms, args.arms, args.skip_arms, "arms")
        config.models = _select(config.models, args.models, None, "models")
        if args.concurrencies:
            config.concurrencies = [int(c) for c in args.concurrencies.split(",")]
        if args.run_timeout_s:
            config.run_timeout_s = args.run_timeout_s
    except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"bench grid: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(config)
    result_dir = args.result_dir or DEFAULT_RESULT_DIR
    grid = Grid(config, result_dir, args.raw_dir, args.record_name, args.deadline_s, not args.no_drift)
    try:
        record = grid.run()
    except GridInterrupted as exc:
        print(f"[grid] interrupted ({exc}); partial record: {grid.record_path}", file=sys.stderr)
        return 1
    print(f"[grid] record: {grid.record_path}")
    for entry in record["ratios"]:
        print(
            f"[grid] {entry['subject']}/{entry['peer']} {entry['model']} c{entry['concurrency']}: "
            f"output tok/s x{_fmt(entry['output_throughput'])}, TTFT med x{_fmt(entry['median_ttft_ms'])}, "
            f"TPOT med x{_fmt(entry['median_tpot_ms'])}"
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


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
