"""Security defaults as vLLM's newest: the API key (--api-key or VLLM_API_KEY) guards every route but /health,
/ping, /version and /metrics; no CORS unless --allowed-origins names the origins."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator

import httpx
import openai
import pytest

from deltaserve.api import cli

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .server_thread import ServerThread, serve

KEYS = ["sk-one", "sk-two"]
OPEN_ROUTES = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"), ("GET", "/metrics")]
GUARDED_ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/tokenizer_info"),
    ("POST", "/invocations"),
    ("GET", "/load"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/no/such/route"),
]


@pytest.fixture(scope="module")
def keyed_server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    server = serve(fake_engine, api_keys=KEYS, enable_tokenizer_info_endpoint=True)
    yield server
    server.stop()


@pytest.mark.parametrize(("method", "path"), GUARDED_ROUTES)
def test_key_guards_every_other_route(keyed_server: ServerThread, method: str, path: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEYS[0]}"},
        {"Authorization": KEYS[0]},
    ):
        response = httpx.request(method, keyed_server.base_url + path, json=body, headers=headers)
        assert response.status_code == 401, (path, headers, response.text)
        error = response.json()["error"]
        assert error["code"] == 401 and error["message"] == "Unauthorized"


@pytest.mark.parametrize(("method", "path"), OPEN_ROUTES)
def test_probes_stay_open(keyed_server: ServerThread, method: str, path: str) -> None:
    assert httpx.request(method, keyed_server.base_url + path).status_code == 200


def test_any_listed_key_is_accepted(keyed_server: ServerThread) -> None:
    for key in KEYS:
        client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=key, max_retries=0)
        assert client.models.list().data[0].id == MODEL_NAME
        assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1).choices
    headers = {"Authorization": f"bearer {KEYS[1]}"}  # the scheme is case-insensitive
    response = httpx.post(keyed_server.base_url + "/tokenize", json={"prompt": "x"}, headers=headers)
    assert response.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_preflight_needs_no_key(keyed_server: ServerThread) -> None:
    headers = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
    assert httpx.options(keyed_server.base_url + "/v1/completions", headers=headers).status_code != 401


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_vllm_api_key_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert cli.build_settings(parse("m"), "m").api_keys == ["from-env"]
    # --api-key takes precedence over the variable, as in vLLM.
    assert cli.build_settings(parse("m", "--api-key", "a", "b"), "m").api_keys == ["a", "b"]
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert cli.build_settings(parse("m"), "m").api_keys == []
    monkeypatch.delenv("VLLM_API_KEY")
    assert cli.build_settings(parse("m"), "m").api_keys == []


def test_no_cors_by_default(http: httpx.Client) -> None:
    response = http.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    response = http.options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in response.headers
    assert parse("m").allowed_origins == []


def test_cors_for_listed_origins(fake_engine: FakeEngine) -> None:
    server = serve(fake_engine, allowed_origins=["http://app.example"])
    try:
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        allowed = httpx.options(
            server.base_url + "/v1/completions", headers={**preflight, "Origin": "http://app.example"}
        )
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://app.example"
        refused = httpx.options(
            server.base_url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"}
        )
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        simple = httpx.get(server.base_url + "/v1/models", headers={"Origin": "http://app.example"})
        assert simple.headers["access-control-allow-origin"] == "http://app.example"
    finally:
        server.stop()


def test_wildcard_cors_is_a_logged_choice(fake_engine: FakeEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    server = serve(fake_engine, allowed_origins=["*"])
    try:
        response = httpx.get(server.base_url + "/v1/models", headers={"Origin": "http://any.example"})
        assert response.headers["access-control-allow-origin"] == "*"
        assert any("CORS allows every origin" in record.getMessage() for record in caplog.records)
    finally:
        server.stop()
