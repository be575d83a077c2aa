"""Where and on what a benchmark ran: project commit, host, GPU and driver, engine versions.

Every probe degrades to None (or "unknown") instead of failing: a record with a missing field is still a
record, and the report prints what is missing. The device machine gets a copy of the working tree whose .git,
if any, is not the one the code came from (seen on the H200: a stale commit from an earlier session), so the
environment variable DELTASERVE_GIT_COMMIT, when set, wins over git.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from deltaserve import env
from deltaserve.bench.nvml import gpu_info

# The servers under test are local: never route their probes through a proxy from the environment.
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 60) -> str:
    """stdout of a command, stripped; empty string on any failure."""
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def git_state(repo: Path) -> dict[str, Any]:
    """{"commit": sha or None, "is_dirty": bool or None, "source": "env" | "git" | None} (read-only git calls)."""
    from_env = env.git_commit()
    if from_env:
        return {"commit": from_env, "is_dirty": None, "source": "env"}
    commit = _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
    if commit:
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=False,
        )
        return {"commit": commit, "is_dirty": bool(status.stdout.strip()), "source": "git"}
    return {"commit": None, "is_dirty": None, "source": None}


def gpu_facts() -> dict[str, Any]:
    """GPU names and driver from NVML, else from nvidia-smi, else nulls."""
    info = gpu_info()
    if info is not None:
        return info
    text = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if text:
        rows = [[cell.strip() for cell in line.split(",")] for line in text.splitlines()]
        return {"gpus": [row[0] for row in rows], "driver": rows[0][1] if len(rows[0]) > 1 else None}
    return {"gpus": [], "driver": None}


def host_facts(repo: Path) -> dict[str, Any]:
    """Everything a record states about the machine and the project at the start of a grid."""
    gpu = gpu_facts()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "gpus": gpu["gpus"],
        "driver": gpu["driver"],
        "git": git_state(repo),
    }


def server_version(base_url: str) -> str | None:
    """GET /version's "version" (vLLM's endpoint), or None."""
    try:
        with NO_PROXY.open(base_url + "/version", timeout=10) as response:
            body = json.loads(response.read().decode() or "{}")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return str(version) if version else None


def probe_version(argv: list[str], env: dict[str, str], cwd: Path) -> str | None:
    """Last stdout line of a `python -c 'print(x.__version__)'` probe, or None."""
    if not argv:
        return None
    text = _run(argv, cwd=cwd, env=env, timeout=120)
    return text.splitlines()[-1] if text else None
