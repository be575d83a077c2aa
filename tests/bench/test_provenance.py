"""Where a record says it ran: the commit comes from DELTASERVE_GIT_COMMIT when set, else from git."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from deltaserve.bench.provenance import git_state


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_the_environment_wins_over_a_stale_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The H200's copy of the tree once carried a .git from an earlier session: git's answer there was wrong.
    _git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("x")
    _git(tmp_path, "add", "f")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "stale")
    stale = _git(tmp_path, "rev-parse", "HEAD")
    monkeypatch.delenv("DELTASERVE_GIT_COMMIT", raising=False)
    assert git_state(tmp_path) == {"commit": stale, "is_dirty": False, "source": "git"}
    (tmp_path / "f").write_text("y")
    assert git_state(tmp_path)["is_dirty"] is True
    monkeypatch.setenv("DELTASERVE_GIT_COMMIT", "c0ffee")
    assert git_state(tmp_path) == {"commit": "c0ffee", "is_dirty": None, "source": "env"}
    monkeypatch.delenv("DELTASERVE_GIT_COMMIT")
    assert git_state(tmp_path / "nowhere") == {"commit": None, "is_dirty": None, "source": None}
