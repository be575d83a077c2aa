"""Fixtures for the benchmark-harness tests: a word-level checkpoint, its fast tokenizer, a fake server.

The helpers (aiohttp servers) are imported inside the fixtures, so a host without aiohttp can still run this
folder's tests that use none of them, such as test_bench_kernels.py's GPU case.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .bench_helpers import WordTokenizer


@pytest.fixture(autouse=True)
def own_grid_pidfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own DELTASERVE_GRID_PIDFILE: a grid notes its running server's process group there, and the
    device runner stops whatever group that file names, so a shared one let one test (or a worker of a parallel
    run) stop another's server."""
    path = tmp_path / "grid-server.pgid"
    monkeypatch.setenv("DELTASERVE_GRID_PIDFILE", str(path))
    return path


@pytest.fixture(scope="session")
def word_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from .fake_server import make_word_tokenizer

    return make_word_tokenizer(tmp_path_factory.mktemp("word") / "model")


@pytest.fixture(scope="session")
def word_tokenizer(word_model: Path) -> WordTokenizer:
    from .bench_helpers import WordTokenizer

    return WordTokenizer(word_model)


@pytest.fixture
def patch_tokenizer(monkeypatch: pytest.MonkeyPatch, word_tokenizer: WordTokenizer) -> WordTokenizer:
    """Make the client load the fast adapter instead of a transformers tokenizer."""
    from deltaserve.bench import serve_cli

    monkeypatch.setattr(serve_cli, "load_tokenizer", lambda *args, **kwargs: word_tokenizer)
    return word_tokenizer


@pytest.fixture
def fake_server(word_model: Path) -> Iterator[str]:
    from .bench_helpers import serve_in_thread
    from .fake_server import build_app

    yield from serve_in_thread(build_app(word_model, ttft_ms=3.0, itl_ms=1.0))
