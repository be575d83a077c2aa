"""The response envelope as vLLM 0.26 sends it: its response models serialised whole (every field, null when unset,
in its order), the `system_fingerprint` of --fingerprint-mode, and the per-request `metrics` of
--enable-per-request-metrics, non-streamed and on a stream's final usage chunk.

vLLM's field lists below are read off vllm/entrypoints/openai/{chat_completion,completion}/protocol.py (0.26):
ChatCompletionResponse, ChatCompletionResponseChoice, CompletionResponse, CompletionResponseChoice and
PerRequestTimingMetrics; its non-streamed handlers return `model_dump()`, so each key is there even when null.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from deltaserve.api import cli
from deltaserve.api.fingerprint import config_hash, system_fingerprint
from deltaserve.api.serving_common import multimodal_tokens, request_timing
from deltaserve.engine.stats import RequestMetrics
from deltaserve.engine_config import EngineConfig

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .server_thread import ServerThread, serve
from .test_api_completions import sse_events
from .test_api_flags import parse

USER = [{"role": "user", "content": "Hi"}]
CHAT_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
             "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
             "metrics"]  # fmt: skip
CHAT_CHOICE_KEYS = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"]
COMPLETION_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                   "kv_transfer_params", "ec_transfer_params", "metrics"]  # fmt: skip
COMPLETION_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                          "prompt_token_ids", "routed_experts"]  # fmt: skip
TIMING_KEYS = ["time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"]
FINGERPRINT = "deltaserve-0.1.0-0123abcd"


def events(response: httpx.Response) -> list[dict[str, Any]]:
    found = sse_events(response)
    assert found[-1] == "[DONE]"
    return [json.loads(event) for event in found[:-1]]


@pytest.fixture(scope="module")
def stamped_server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    server = serve(fake_engine, system_fingerprint=FINGERPRINT, enable_per_request_metrics=True)
    yield server
    server.stop()


# -- the fingerprint's modes ----------------------------------------------------------------------------------


def test_the_fingerprint_modes_are_vllms() -> None:
    config = EngineConfig(model="some/model")
    digest = config_hash(config)
    assert len(digest) == 8 and int(digest, 16) >= 0
    assert system_fingerprint(config) == f"deltaserve-0.1.0-{digest}"
    assert system_fingerprint(config, "hash") == f"deltaserve-0.1.0-{digest}"
    assert system_fingerprint(config, "custom", "fp_abc") == "fp_abc"
    assert system_fingerprint(config, "custom") is None  # vLLM's: custom without a value is null
    assert system_fingerprint(config, "none") is None
    with pytest.raises(ValueError, match="--fingerprint-mode"):
        system_fingerprint(config, "short")
    # full names the parallelism, hash leaves it out; any other setting changes the hash
    split = EngineConfig(model="some/model", tensor_parallel_size=2, enable_expert_parallel=True)
    assert system_fingerprint(split) == f"deltaserve-0.1.0-tp2-ep-{config_hash(split)}"
    assert system_fingerprint(split, "hash") == f"deltaserve-0.1.0-{config_hash(split)}"
    assert config_hash(EngineConfig(model="some/model", max_model_len=4096)) != digest
    assert config_hash(EngineConfig(model="some/model")) == digest  # stable across builds of the same config


def test_the_flags_reach_the_settings() -> None:
    config = cli.build_engine_config(parse("m"), "m", "cpu")
    settings = cli.build_settings(parse("m"), "m", config)
    assert settings.system_fingerprint == system_fingerprint(config) and not settings.enable_per_request_metrics
    assert cli.build_settings(parse("m", "--fingerprint-mode", "none"), "m", config).system_fingerprint is None
    custom = parse("m", "--fingerprint-mode", "custom", "--fingerprint-value", "fp_1")
    assert cli.build_settings(custom, "m", config).system_fingerprint == "fp_1"
    assert cli.build_settings(parse("m", "--enable-per-request-metrics"), "m", config).enable_per_request_metrics
    with pytest.raises(ValueError, match="requires engine statistics logging; remove --disable-log-stats"):
        cli.build_settings(parse("m", "--enable-per-request-metrics", "--disable-log-stats"), "m", config)


# -- the bodies -------------------------------------------------------------------------------------------------


def test_bodies_are_vllms_models_serialised_whole(http: httpx.Client) -> None:
    """The plain server (no fingerprint, no metrics): every key of vLLM's models, in its order, the unset ones null."""
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()
    assert list(chat) == CHAT_KEYS and list(chat["choices"][0]) == CHAT_CHOICE_KEYS
    assert all(chat[key] is None for key in CHAT_KEYS[5:] if key != "usage")
    assert chat["choices"][0]["routed_experts"] is None
    completion = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2}).json()
    assert list(completion) == COMPLETION_KEYS
    assert [list(choice) for choice in completion["choices"]] == [COMPLETION_CHOICE_KEYS] * 2
    assert all(completion[key] is None for key in COMPLETION_KEYS[5:] if key != "usage")
    batch = http.post("/v1/chat/completions/batch", json={"messages": [USER, USER], "max_tokens": 2}).json()
    assert list(batch) == CHAT_KEYS and [choice["index"] for choice in batch["choices"]] == [0, 1]


def test_the_openai_client_reads_every_key_the_raw_body_has(stamped_server: ServerThread) -> None:
    """vLLM's test_invocations: the client's dump of a chat reply and the raw /invocations body have the same keys
    and choices (the client fills in service_tier and system_fingerprint when a server leaves them out)."""
    client = openai.OpenAI(base_url=stamped_server.base_url + "/v1", api_key="x", max_retries=0)
    request = {"model": MODEL_NAME, "messages": USER, "max_completion_tokens": 5, "temperature": 0.0, "logprobs": False}
    reply = client.chat.completions.create(**request)
    raw = httpx.post(stamped_server.base_url + "/invocations", json=request).json()
    dumped = reply.model_dump()
    # the keys the client adds are fields vLLM 0.26's model lacks too (newer clients model fields no server sends)
    assert raw.keys() <= dumped.keys() and dumped.keys() - raw.keys() == dumped.keys() - set(CHAT_KEYS)
    # and the same choices, but for the client's null tool_calls: vLLM's ChatMessage drops an empty list
    for choice in dumped["choices"]:
        assert choice["message"].pop("tool_calls") is None and "tool_calls" not in raw["choices"][0]["message"]
    assert dumped["choices"] == raw["choices"]
    assert reply.system_fingerprint == raw["system_fingerprint"] == FINGERPRINT


def test_the_fingerprint_is_on_every_body_and_the_last_chunk_of_a_stream(stamped_server: ServerThread) -> None:
    url = stamped_server.base_url
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Hi"})):
        assert httpx.post(url + path, json={**body, "max_tokens": 3}).json()["system_fingerprint"] == FINGERPRINT
        # no usage chunk: vLLM stamps each choice's finishing chunk, and no other
        chunks = events(httpx.post(url + path, json={**body, "max_tokens": 3, "n": 2, "stream": True}))
        stamped = [chunk for chunk in chunks if "system_fingerprint" in chunk]
        assert len(stamped) == 2 and all(chunk["system_fingerprint"] == FINGERPRINT for chunk in stamped)
        assert all(chunk["choices"][0]["finish_reason"] is not None for chunk in stamped)
        # a usage chunk follows: it alone carries the fingerprint, as the final message
        usage = {"stream_options": {"include_usage": True}}
        chunks = events(httpx.post(url + path, json={**body, "max_tokens": 3, "stream": True, **usage}))
        assert [("system_fingerprint" in chunk) for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
        assert not chunks[-1]["choices"] and chunks[-1]["system_fingerprint"] == FINGERPRINT
    batch = httpx.post(url + "/v1/chat/completions/batch", json={"messages": [USER, USER], "max_tokens": 2}).json()
    assert batch["system_fingerprint"] == FINGERPRINT


# -- per-request metrics ------------------------------------------------------------------------------------------


def test_request_timing_is_vllms_arithmetic() -> None:
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                             last_token_time=103.0)  # fmt: skip
    assert request_timing(metrics, 5) == {
        "time_to_first_token_ms": 500.0,  # first token - first scheduled
        "generation_time_ms": 2000.0,  # last token - first token
        "queue_time_ms": 500.0,  # first scheduled - arrival
        "mean_itl_ms": 500.0,  # the decode over the 4 gaps of 5 tokens
        "tokens_per_second": 5 / 2.5,  # every token over the inference (prefill included)
    }
    assert request_timing(metrics, 1)["mean_itl_ms"] is None  # one token: no gap
    unscheduled = RequestMetrics(arrival_time=100.0)
    assert request_timing(unscheduled, 0) == dict.fromkeys(TIMING_KEYS)
    assert request_timing(None, 3) == dict.fromkeys(TIMING_KEYS)


def test_metrics_only_when_one_stream_made_the_response(stamped_server: ServerThread, fake_engine: FakeEngine) -> None:
    url = stamped_server.base_url
    fake_engine.is_reporting_metrics = True
    try:
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 3}).json()
        completion = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).json()
        for body in (chat, completion):
            timing = body["metrics"]
            assert list(timing) == TIMING_KEYS and all(isinstance(timing[key], float) for key in TIMING_KEYS)
            assert timing["time_to_first_token_ms"] >= 0 and timing["tokens_per_second"] > 0
        # n > 1, or a batch of prompts: vLLM suppresses them (they would be one stream's)
        assert httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "n": 2}).json()[
            "metrics"
        ] is None  # fmt: skip
        assert httpx.post(url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3}).json()[
            "metrics"
        ] is None  # fmt: skip
        # streamed: on the final usage chunk only, its null fields left out
        body = {"prompt": "Hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        chunks = events(httpx.post(url + "/v1/completions", json=body))
        assert "metrics" in chunks[-1] and not any("metrics" in chunk for chunk in chunks[:-1])
        assert set(chunks[-1]["metrics"]) <= set(TIMING_KEYS) and "time_to_first_token_ms" in chunks[-1]["metrics"]
    finally:
        fake_engine.is_reporting_metrics = False


def test_multimodal_tokens_count_each_modalitys_placeholder_spans() -> None:
    class Item:
        def __init__(self, modality: str, length: int) -> None:
            self.modality, self.length = modality, length

    class Input:
        items = (Item("image", 64), Item("video", 300), Item("image", 16))

    assert multimodal_tokens(Input()) == {"image": 80, "video": 300}
    assert multimodal_tokens(None) is None


# -- request logging ------------------------------------------------------------------------------------------


def test_enable_log_requests_logs_ids_and_params(fake_engine: FakeEngine, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's --enable-log-requests: the request id and its SamplingParams at INFO, the prompt's token ids (cut at
    --max-log-len) at DEBUG; nothing without the flag; --enable-log-outputs needs it, in vLLM's words."""
    caplog.set_level(logging.DEBUG, logger="deltaserve.requests")
    server = serve(fake_engine, enable_log_requests=True, max_log_len=3)
    try:
        httpx.post(server.base_url + "/v1/completions", json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 2},
                   headers={"x-request-id": "logged"})  # fmt: skip
    finally:
        server.stop()
    lines = [record.getMessage() for record in caplog.records if record.name == "deltaserve.requests"]
    received = [line for line in lines if line.startswith("Received request cmpl-logged-0-")]
    assert len(received) == 1 and "params: SamplingParams(" in received[0] and "max_tokens=2" in received[0]
    assert any("details: prompt_token_ids: [5, 6, 7]," in line for line in lines)
    caplog.clear()
    plain = serve(fake_engine)
    try:
        httpx.post(plain.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    finally:
        plain.stop()
    assert not [record for record in caplog.records if record.name == "deltaserve.requests"]
    assert cli.build_settings(parse("m", "--enable-log-requests", "--max-log-len", "9"), "m").max_log_len == 9
    with pytest.raises(ValueError, match="--enable-log-outputs requires --enable-log-requests"):
        cli.build_settings(parse("m", "--enable-log-outputs"), "m")
