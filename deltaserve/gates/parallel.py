"""Runs `deltaserve check all`'s gates in worker subprocesses, a few at a time, and replays their output in order.

The gates are independent and CPU-bound, and transformers' CPU forwards gain almost nothing from a second thread
(moe conditioning: 65 s at one thread, 68 s at two), so on a 2-core machine two one-thread workers finish the list
in about half the time of one process. Each worker (`python -m deltaserve.gates.parallel`) imports torch once and
runs the jobs it is handed, one at a time, through `deltaserve.gates.all.run_job` (the same function the
in-process path calls); the file descriptors 1 and 2 of the worker go to capture files during a job, so everything
a gate prints (C-level warnings included) comes back with its result. The parent prints each job's output as soon
as every job before it has finished: the text is the same, in the same order, whatever order the jobs end in. A
worker that dies fails the job it was running (with its exit code and last stderr lines) and is replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the last lines of a dead worker's stderr that its failure detail quotes
NUM_DEATH_LINES = 3


@dataclass(frozen=True)
class JobOutcome:
    """One finished job: its result fields and what it printed."""

    name: str
    code: int
    detail: str
    stdout: str
    stderr: str


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def worker_command(num_threads: int) -> list[str]:
    """The command line of one worker; tests replace this to run workers with fake gates installed."""
    return [sys.executable, "-m", "deltaserve.gates.parallel", "--threads", str(num_threads)]


class _Worker:
    """One worker subprocess: a job (a JSON line) goes to its stdin, its result (a JSON line) comes back; what
    the job prints goes to the two capture files named with it."""

    def __init__(self, num_threads: int, stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        with open(stderr_path, "w", encoding="utf-8") as stderr:
            self.process = subprocess.Popen(
                worker_command(num_threads), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                text=True, encoding="utf-8",
            )  # fmt: skip

    def run(self, name: str, job: dict[str, Any], capture: tuple[Path, Path]) -> JobOutcome:
        """The job's outcome; a worker that dies before answering fails the job (see `death`)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        request = {"job": job, "stdout": str(capture[0]), "stderr": str(capture[1])}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except OSError:
            line = ""
        stdout, stderr = (_read(path) for path in capture)
        if not line:
            return self.death(name, stdout, stderr)
        answer = json.loads(line)
        return JobOutcome(name, int(answer["code"]), str(answer["detail"]), stdout, stderr)

    def death(self, name: str, stdout: str, stderr: str) -> JobOutcome:
        """The failed outcome of the job a dead worker was running, with what it printed before dying."""
        code = self.process.wait()
        stderr += _read(self.stderr_path)
        lines = [line.rstrip() for line in stderr.splitlines() if line.strip()]
        last = "; ".join(lines[-NUM_DEATH_LINES:]) or "nothing on stderr"
        return JobOutcome(name, 1, f"the gate's worker process died (exit {code}): {last}", stdout, stderr)

    def close(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def run_jobs(
    jobs: list[tuple[str, dict[str, Any]]],
    num_workers: int,
    on_outcome: Callable[[JobOutcome], None],
    num_threads: int = 1,
) -> list[JobOutcome]:
    """Run (name, job) pairs on `num_workers` workers; on_outcome is called in job order, each as soon as it and
    every job before it are done. Returns the outcomes in job order."""
    outcomes: list[JobOutcome | None] = [None] * len(jobs)
    lock = threading.Condition()
    next_job = [0]

    def serve(folder: Path, number: int) -> None:
        worker: _Worker | None = None
        try:
            while True:
                with lock:
                    index = next_job[0]
                    if index >= len(jobs):
                        return
                    next_job[0] += 1
                name, job = jobs[index]
                capture = (folder / f"job{index}.out", folder / f"job{index}.err")
                try:
                    if worker is None:
                        worker = _Worker(num_threads, folder / f"worker{number}-{index}.err")
                    outcome = worker.run(name, job, capture)
                    if worker.process.poll() is not None:
                        worker.close()
                        worker = None
                except Exception as exc:
                    # whatever went wrong, the job is answered (failed), so the caller never waits forever
                    outcome = JobOutcome(name, 1, f"cannot run the gate's worker: {type(exc).__name__}: {exc}", "", "")
                    if worker is not None:
                        worker.process.kill()
                        worker.close()
                        worker = None
                with lock:
                    outcomes[index] = outcome
                    lock.notify_all()
        finally:
            if worker is not None:
                worker.close()

    with tempfile.TemporaryDirectory(prefix="deltaserve-check-all-") as tmp:
        folder = Path(tmp)
        count = max(1, min(num_workers, len(jobs)))
        threads = [threading.Thread(target=serve, args=(folder, n), daemon=True) for n in range(count)]
        for thread in threads:
            thread.start()
        for index in range(len(jobs)):
            with lock:
                lock.wait_for(lambda i=index: outcomes[i] is not None)
                outcome = outcomes[index]
            assert outcome is not None
            on_outcome(outcome)
        for thread in threads:
            thread.join()
    return [outcome for outcome in outcomes if outcome is not None]


def _redirect(stdout_path: str, stderr_path: str) -> None:
    """Points the file descriptors 1 and 2 at the job's capture files (C-level output included)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for path, fd in ((stdout_path, 1), (stderr_path, 2)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)


def worker_main(argv: list[str] | None = None) -> int:
    """The worker loop: one JSON job a line on stdin, one JSON result a line on the original stdout."""
    parser = argparse.ArgumentParser(prog="python -m deltaserve.gates.parallel", description=__doc__)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of this worker")
    args = parser.parse_args(argv)
    # torch sizes its CPU thread pool from OMP_NUM_THREADS when a gate first imports it; the loop itself never
    # imports torch, so a worker starts in a fraction of a second
    os.environ["OMP_NUM_THREADS"] = str(max(1, args.threads))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(max(1, args.threads))
    from deltaserve.gates import all as check_all

    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    saved_stderr = os.dup(2)
    null_fd = os.open(os.devnull, os.O_WRONLY)
    # between jobs nothing should print; whatever does must not corrupt the answers
    os.dup2(null_fd, 1)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        _redirect(request["stdout"], request["stderr"])
        try:
            result = check_all.run_job(request["job"])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(null_fd, 1)
            os.dup2(saved_stderr, 2)
        answers.write(json.dumps({"code": result.code, "detail": result.detail}) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
