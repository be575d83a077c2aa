"""The non-generation routes (models, health, version, load, ping, tokenize, detokenize, metrics) and the API key."""

from __future__ import annotations

import httpx
import openai
import pytest

import deltaserve

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .server_thread import metric_value


def test_models_card_has_root_and_max_model_len(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME, "alias"]
    body = http.get("/v1/models").json()
    card = body["data"][0]
    assert body["object"] == "list" and card["object"] == "model" and card["owned_by"] == "deltaserve"
    assert card["root"] == "/models/fake-qwen" and card["parent"] is None and card["max_model_len"] == 2048
    assert isinstance(card["created"], int) and card["permission"][0]["object"] == "model_permission"


def test_models_retrieve_names_a_served_model_or_404s(client: openai.OpenAI, http: httpx.Client) -> None:
    """vLLM's test_models: the openai client's models.retrieve gets the card; an unknown name a 404 'does not exist'."""
    listed = http.get("/v1/models").json()["data"]
    for index, name in enumerate([MODEL_NAME, "alias"]):
        model = client.models.retrieve(name)
        assert model.id == name and model.root == "/models/fake-qwen"
        assert http.get(f"/v1/models/{name}").json() == listed[index]
    for unknown in ("this-model-does-not-exist", "org/with-a-slash"):
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.models.retrieve(unknown)
        error = http.get(f"/v1/models/{unknown}").json()["error"]
        assert error["type"] == "NotFoundError" and error["message"] == f"The model `{unknown}` does not exist."


def test_alias_name_is_accepted(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="alias", prompt="x", max_tokens=1)
    assert completion.model == MODEL_NAME


def test_health_version_load_ping(http: httpx.Client) -> None:
    health = http.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert http.get("/version").json() == {"version": deltaserve.__version__}
    assert http.get("/load").json() == {"server_load": 0}
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_tokenize_and_detokenize_round_trip(http: httpx.Client, fake_engine: FakeEngine) -> None:
    body = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "Hello world", "add_special_tokens": False})
    result = body.json()
    assert result["tokens"] == fake_engine.tokenizer.encode("Hello world")
    assert result["count"] == len(result["tokens"]) and result["max_model_len"] == 2048
    assert result["token_strs"] is None
    with_strs = http.post("/tokenize", json={"prompt": "Hello", "return_token_strs": True}).json()
    assert with_strs["token_strs"] == fake_engine.tokenizer.convert_ids_to_tokens(with_strs["tokens"])
    assert http.post("/detokenize", json={"model": MODEL_NAME, "tokens": result["tokens"]}).json() == {
        "prompt": "Hello world"
    }


def test_tokenize_chat_form_counts_the_template(http: httpx.Client, fake_engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    result = http.post("/tokenize", json={"messages": messages}).json()
    prompt = fake_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert result["tokens"] == fake_engine.tokenizer.encode(prompt)


def test_metrics_names_and_counts(http: httpx.Client, fake_engine: FakeEngine) -> None:
    before = http.get("/metrics").text
    generated_before = metric_value(before, "vllm:generation_tokens_total")
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5})
    response = http.get("/metrics")
    text = response.text
    assert response.headers["content-type"].startswith("text/plain")
    assert metric_value(text, "vllm:generation_tokens_total") == generated_before + 5
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
        "deltaserve:num_free_kv_blocks",
        "deltaserve:num_free_state_slots",
    ):
        metric_value(text, name)
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="fake-qwen"}' in text
    assert "_created" not in text
