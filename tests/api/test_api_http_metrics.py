"""/metrics carries vLLM 0.26's HTTP request families (prometheus-fastapi-instrumentator, as vLLM configures it).

The label values are the library's under vLLM's options: status grouped to "2xx" / "4xx", handler the route template
(or "none" for a path no route matches), and no series for vLLM's excluded handlers (/metrics, /health, /load,
/ping, /version, /server_info). The first tests drive the real AsyncEngine on the tiny dense checkpoint with the
openai client; the middleware-order tests use the FakeEngine behind an API key and a small body limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.api.http_metrics import EXCLUDED_HANDLERS
from deltaserve.api.server import build_app
from deltaserve.api.settings import ServerSettings
from deltaserve.engine_config import EngineConfig

from .fake_engine import FakeEngine
from .server_thread import MODEL_NAME, ServerThread, serve

NAME = "tiny"
# the library's default families and their types (prometheus_client names a counter's family without _total)
HTTP_FAMILIES = {
    "http_requests": "counter",
    "http_request_size_bytes": "summary",
    "http_response_size_bytes": "summary",
    "http_request_duration_highr_seconds": "histogram",
    "http_request_duration_seconds": "histogram",
}
# vLLM's low-resolution buckets (the library's default): only these, with +Inf, per handler and method
LOWR_BUCKETS = ["0.1", "0.5", "1.0", "+Inf"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(http: httpx.Client) -> tuple[dict[str, str], Samples]:
    """family name -> type, and (sample name, sorted labels) -> value, of the http_* families."""
    types, samples = {}, {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name.startswith("http_"):
            types[family.name] = family.type
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return types, samples


def requests_total(samples: Samples, handler: str, method: str, status: str) -> float:
    labels = tuple(sorted({"handler": handler, "method": method, "status": status}.items()))
    return samples.get(("http_requests_total", labels), 0.0)


def counted(
    after: Samples, before: Samples, status: str, handler: str = "/v1/completions", method: str = "POST"
) -> float:
    """How many requests http_requests_total gained between two scrapes for these labels."""
    return requests_total(after, handler, method, status) - requests_total(before, handler, method, status)


def handlers(samples: Samples) -> set[str]:
    return {value for (_, labels), _v in samples.items() for key, value in labels if key == "handler"}


@pytest.fixture(scope="module")
def real_server(tiny_dense: Path) -> Iterator[ServerThread]:
    from deltaserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=256))
    server = ServerThread(build_app(engine, ServerSettings(model_root=str(tiny_dense), served_model_names=[NAME])))
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def real_http(real_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real_server.base_url, timeout=60) as client:
        yield client


def test_a_completion_is_counted_as_vllm_counts_it(real_server: ServerThread, real_http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    _, before = scrape(real_http)
    client.completions.create(model=NAME, prompt="Hello", max_tokens=3)
    types, after = scrape(real_http)
    assert types == HTTP_FAMILIES
    assert counted(after, before, "2xx") == 1
    # a streamed completion is one request too, its duration taken to the end of the stream
    stream = client.completions.create(model=NAME, prompt="Hello", max_tokens=3, stream=True)
    assert list(stream)
    _, streamed = scrape(real_http)
    assert counted(streamed, after, "2xx") == 1
    route = (("handler", "/v1/completions"), ("method", "POST"))
    assert streamed[("http_request_duration_seconds_count", route)] >= 2
    buckets = sorted(dict(labels)["le"] for (name, labels) in streamed if name == "http_request_duration_seconds_bucket"
                     and dict(labels)["handler"] == "/v1/completions")  # fmt: skip
    assert buckets == sorted(LOWR_BUCKETS)
    assert streamed[("http_request_duration_highr_seconds_count", ())] >= 2
    assert streamed[("http_request_size_bytes_count", (("handler", "/v1/completions"),))] >= 2
    assert streamed[("http_response_size_bytes_sum", (("handler", "/v1/completions"),))] > 0


def test_excluded_handlers_are_not_counted(real_http: httpx.Client) -> None:
    for path in ("/metrics", "/health", "/load", "/ping", "/version"):
        assert real_http.get(path).status_code == 200, path
    assert real_http.post("/ping").status_code == 200
    real_http.get("/v1/models")
    _, samples = scrape(real_http)
    seen = handlers(samples)
    assert "/v1/models" in seen
    assert not {handler for handler in seen if any(excluded in handler for excluded in EXCLUDED_HANDLERS)}, seen


def test_a_path_no_route_matches_is_handler_none(real_http: httpx.Client) -> None:
    _, before = scrape(real_http)
    assert real_http.get("/v1/no-such-route").status_code == 404
    assert real_http.get("/health/deep").status_code == 404  # untemplated, but its path matches "/health": excluded
    _, after = scrape(real_http)
    assert counted(after, before, "4xx", handler="none", method="GET") == 1
    assert "/v1/no-such-route" not in handlers(after)


@pytest.fixture(scope="module")
def guarded_http(fake_engine: FakeEngine) -> Iterator[httpx.Client]:
    server = serve(fake_engine, api_keys=["sk-http"], max_request_body_bytes=4096)
    with httpx.Client(base_url=server.base_url, timeout=30, headers={"Authorization": "Bearer sk-http"}) as client:
        yield client
    server.stop()


def test_the_key_check_runs_outside_the_metrics_and_the_body_limit_inside(guarded_http: httpx.Client) -> None:
    """vLLM adds its auth middleware after the instrumentator, so a 401 is never counted; deltaserve's body limit
    (vLLM has none) sits inside, so a body vLLM would take to its route is counted under that route."""
    _, before = scrape(guarded_http)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    assert guarded_http.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    _, after = scrape(guarded_http)
    assert after == before
    assert guarded_http.post("/v1/completions", json=body).status_code == 200
    assert guarded_http.post("/v1/completions", json={**body, "prompt": "x" * 8192}).status_code == 413
    _, after = scrape(guarded_http)
    assert counted(after, before, "2xx") == 1 and counted(after, before, "4xx") == 1


def test_every_route_has_a_path(fake_engine: FakeEngine) -> None:
    """vLLM 0.26 replaces the library's route walk with one that skips routes without a path (FastAPI's lazily
    included routers); with every route on the app itself, the library's walk names the handlers as vLLM's does."""
    app = build_app(fake_engine, ServerSettings(model_root="m", served_model_names=[MODEL_NAME]))
    assert all(isinstance(getattr(route, "path", None), str) for route in app.routes)
