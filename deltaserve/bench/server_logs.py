"""What a grid reads from a server's log after the run: the Triton kernels it compiled while serving, and which
prefill kernels a deltaserve server picked.

Both engines log a kernel compiled after their start-up in vLLM 0.26's words ("Triton kernel JIT compilation during
inference: NAME. This causes a latency spike; ...", deltaserve's runner/jit_monitor.py and vLLM's own monitor in
`--jit-monitor-mode warn`, the default of both), so one pattern reads either. The grid splits them at the end of the
launch's warm-up point (the log's size then): compiles before it are what the warm-up point absorbed, compiles after
it stalled a measured run (docs/kernels.md#compiles-while-serving).
"""

from __future__ import annotations

import re
from pathlib import Path

JIT_LINE = re.compile(r"Triton kernel JIT compilation during inference: ([A-Za-z_]\w*)")
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
    return JIT_LINE.findall(data.decode(errors="replace"))


def prefill_kernels(path: Path) -> dict[str, str] | None:
    """{"attention": ..., "gdn": ...} from the first start-up line that names them (None: the log has none, e.g.
    vLLM's)."""
    if not path.is_file():
        return None
    match = PREFILL_KERNELS_LINE.search(path.read_bytes().decode(errors="replace"))
    return {"attention": match.group(1), "gdn": match.group(2)} if match else None
