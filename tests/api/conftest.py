"""Fixtures of the API tests: the tiny tokenizer, a FakeEngine-backed server in a thread, and clients for it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from deltaserve.api.server import build_app
from deltaserve.api.settings import ServerSettings

from .fake_engine import FakeEngine, build_tokenizer
from .server_thread import MODEL_NAME, ServerThread

API_KEY = "sk-test"


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def fake_engine(tokenizer: PreTrainedTokenizerFast) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture(scope="module")
def fake_server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    """Serves the FakeEngine with vLLM's Qwen3.5 recipe flags: reasoning parser and auto tool choice."""
    settings = ServerSettings(
        model_root="/models/fake-qwen",
        served_model_names=[MODEL_NAME, "alias"],
        reasoning_parser="qwen3",
        tool_call_parser="qwen3_coder",
        enable_auto_tool_choice=True,
    )
    server = ServerThread(build_app(fake_engine, settings)).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _reset_fake(request: pytest.FixtureRequest) -> None:
    """Scripts and failure switches never leak from one test into the next."""
    if "fake_engine" in request.fixturenames:
        engine: FakeEngine = request.getfixturevalue("fake_engine")
        engine.scripts.clear()
        engine.fail_after_tokens = None
        engine.is_dead = False
        engine.default_sampling = {}
        engine.step_delay = 0.0005
        engine.num_cached_tokens = 0
        engine.is_reporting_metrics = False
        engine.num_preemptions = 0


@pytest.fixture(scope="module")
def http(fake_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_server.base_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def client(fake_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
