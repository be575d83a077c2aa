"""The `bench` extra: aiohttp and matplotlib load on use, a missing one is an error naming the extra, and importing
the bench modules (as the gates and grids do) needs neither."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from deltaserve.bench._extra import MissingExtraError, require

ROOT = Path(__file__).resolve().parents[2]


def test_the_extra_holds_what_only_bench_uses() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(project["optional-dependencies"]["bench"]) == ["aiohttp", "matplotlib"]
    assert not {"aiohttp", "matplotlib"} & {name.split(";")[0].strip() for name in project["dependencies"]}


def test_require_returns_the_module() -> None:
    import aiohttp

    assert require("aiohttp") is aiohttp


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # import of matplotlib halts as if it were not installed, also where an earlier test imported pyplot already
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"matplotlib is not installed.*deltaserve\[bench\]"):
        require("matplotlib.pyplot")


def test_a_broken_install_is_not_called_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "ds_extra_probe"
    package.mkdir()
    (package / "__init__.py").write_text("import ds_extra_probe_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as caught:
        require("ds_extra_probe")
    assert not isinstance(caught.value, MissingExtraError)
    assert caught.value.name == "ds_extra_probe_missing_dependency"


def test_bench_modules_import_without_the_extra_and_bench_serve_says_what_is_missing() -> None:
    probe = textwrap.dedent(
        """
        import sys
        sys.modules["aiohttp"] = None
        sys.modules["matplotlib"] = None
        import deltaserve.bench.client, deltaserve.bench.dataset, deltaserve.bench.grid, deltaserve.bench.report
        import deltaserve.gates.tokens
        from deltaserve.bench import serve_cli
        sys.exit(serve_cli.run(serve_cli.parse_bench_args(["--model", "m"])))
        """
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "deltaserve bench serve: aiohttp is not installed" in result.stderr
    assert "pip install -e '.[bench]'" in result.stderr
