"""What a grid reads from a server's log after the run: the kernels it compiled while serving, and which prefill
kernels a deltaserve server picked.

Both engines log a kernel compiled after their start-up in vLLM 0.26's words (deltaserve's runner/jit_monitor.py and
vLLM's own monitor in `--jit-monitor-mode warn`, the default of both), one line per kernel and JIT backend: "Triton
kernel JIT compilation during inference: NAME. This causes a latency spike; ...", and for vLLM's other two backends
"CuTeDSL JIT compilation during inference: NAME" (FlashInfer's GDN prefill is one) and "TileLang JIT compilation
...". One pattern reads all three; a name is the kernel's for Triton, "NAME (CuTeDSL)" for the others. The grid
reads each measured run's compiles between the log's sizes at the start of its measured requests and at its end,
and the warm-up's before the first measured run (docs/kernels.md#compiles-while-serving). A record made before that
reads them back by time (`placed_compiles`): each line's time stamp against each run's end and duration, to the
second.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from pathlib import Path

# vLLM 0.26's jit_monitor.py logs "%s %s during inference: %s" with (backend, event): ("Triton", "kernel JIT
# compilation"), ("CuTeDSL", "JIT compilation"), ("TileLang", "JIT compilation")
JIT_LINE = re.compile(r"(Triton kernel|CuTeDSL|TileLang) JIT compilation during inference: ([A-Za-z_]\w*)")
# a line's time stamp: deltaserve's logging ("2026-12-06 19:05:13,123 WARNING ...") or vLLM's ("(EngineCore pid=1)
# WARNING 12-06 19:05:13 [jit_monitor.py:135] ...", no year)
DELTASERVE_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[,.]\d+ ")
VLLM_TIME = re.compile(r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d-\d\d \d\d:\d\d:\d\d) ")
# log stamps have whole seconds (truncated), and so has a client result's end date, from which its start is reckoned
STAMP = timedelta(seconds=1)
# deltaserve's runner logs its resolved --attention-backend and --gdn-prefill-backend once per rank at start-up (the
# defaults depend on the libraries installed, so a record must say what served)
PREFILL_KERNELS_LINE = re.compile(r"prefill kernels: attention=(\S+) gdn=(\S+)")


def log_size(path: Path) -> int:
    """The log's size in bytes now (0 when there is none yet): an offset to read later lines from."""
    return path.stat().st_size if path.is_file() else 0


def jit_compiles(path: Path, start: int = 0, end: int | None = None) -> list[str]:
    """The kernel names the log's JIT lines name between byte offsets start and end (end: the log's end), in order,
    a name once per line as logged (a warn-mode monitor logs each kernel once; a verbose one every compile)."""
    if not path.is_file():
        return []
    with path.open("rb") as log:
        log.seek(start)
        data = log.read() if end is None else log.read(max(0, end - start))
    return [_compile_name(backend, name) for backend, name in JIT_LINE.findall(data.decode(errors="replace"))]


def _compile_name(backend: str, name: str) -> str:
    """A compile as records name it: the kernel's name for Triton (what every record before the other backends
    held), "NAME (CuTeDSL)" / "NAME (TileLang)" for the others."""
    return name if backend.startswith("Triton") else f"{name} ({backend})"


def timed_compiles(path: Path, year: int) -> list[tuple[datetime, str]]:
    """(time stamp, compile) of every JIT line of the log, in order; `year` completes vLLM's stamps, which have none.
    A JIT line without a stamp it can read is left out."""
    if not path.is_file():
        return []
    found = []
    for line in path.read_bytes().decode(errors="replace").splitlines():
        match = JIT_LINE.search(line)
        if match is None:
            continue
        if own := DELTASERVE_TIME.match(line):
            stamp = datetime.strptime(own.group(1), "%Y-%m-%d %H:%M:%S")
        elif theirs := VLLM_TIME.search(line):
            stamp = datetime.strptime(f"{year}-{theirs.group(1)}", "%Y-%m-%d %H:%M:%S")
        else:
            continue
        found.append((stamp, _compile_name(*match.groups())))
    return found


def run_window(result: dict) -> tuple[datetime, datetime] | None:
    """When a `bench serve` result's measured requests ran: its "date" is taken at the end ("%Y%m%d-%H%M%S", local
    time as the servers log it), its "duration" is the measured span; None when either is missing."""
    if "date" not in result or "duration" not in result:
        return None
    end = datetime.strptime(result["date"], "%Y%m%d-%H%M%S")
    return end - timedelta(seconds=float(result["duration"])), end


def placed_compiles(
    compiles: list[tuple[datetime, str]], window: tuple[datetime, datetime]
) -> tuple[list[str], list[str]]:
    """(inside, at the edge): the compiles logged inside the run's measured window for certain, and those whose
    second overlaps its uncertain start or end. A stamp S means a time in [S, S + 1 s); the window's end E (a
    truncated stamp too) a time in [E, E + 1 s), its start E - duration up to 1 s later. A Triton line is logged when
    its compile is done, a CuTeDSL line when it begins, so an edge compile may or may not have stalled the run."""
    start, end = window
    inside, edge = [], []
    for stamp, name in compiles:
        if stamp + STAMP <= start or stamp >= end + STAMP:
            continue
        (inside if stamp >= start + STAMP and stamp + STAMP <= end else edge).append(name)
    return inside, edge


def prefill_kernels(path: Path) -> dict[str, str] | None:
    """{"attention": ..., "gdn": ...} from the first start-up line that names them (None: the log has none, e.g.
    vLLM's)."""
    if not path.is_file():
        return None
    match = PREFILL_KERNELS_LINE.search(path.read_bytes().decode(errors="replace"))
    return {"attention": match.group(1), "gdn": match.group(2)} if match else None
