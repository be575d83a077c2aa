"""Fixtures for the benchmark-harness tests: a word-level checkpoint, its fast tokenizer, a fake server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .bench_helpers import WordTokenizer, serve_in_thread
from .fake_server import build_app, make_word_tokenizer


@pytest.fixture(scope="session")
def word_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_word_tokenizer(tmp_path_factory.mktemp("word") / "model")


@pytest.fixture(scope="session")
def word_tokenizer(word_model: Path) -> WordTokenizer:
    return WordTokenizer(word_model)


@pytest.fixture
def patch_tokenizer(monkeypatch: pytest.MonkeyPatch, word_tokenizer: WordTokenizer) -> WordTokenizer:
    """Make the client load the fast adapter instead of a transformers tokenizer."""
    from deltaserve.bench import serve_cli

    monkeypatch.setattr(serve_cli, "load_tokenizer", lambda *args, **kwargs: word_tokenizer)
    return word_tokenizer


@pytest.fixture
def fake_server(word_model: Path) -> Iterator[str]:
    yield from serve_in_thread(build_app(word_model, ttft_ms=3.0, itl_ms=1.0))
