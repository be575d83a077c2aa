"""End to end: the real AsyncEngine serving the tiny dense checkpoint on the CPU behind uvicorn, driven by openai.

Random weights produce no meaningful text, so these tests check the protocol (greedy determinism, streaming equal
to non-streaming, usage, n, logprobs, stop strings, errors, freed resources after a disconnect); reasoning and tool
calls are covered on crafted outputs with the FakeEngine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from deltaserve.api.server import build_app
from deltaserve.api.settings import ServerSettings
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams

from .server_thread import ServerThread, metric_value
from .test_api_disconnect import wait_until_freed
from .test_api_errors import CASES, check_malformed

NAME = "tiny"
MAX_MODEL_LEN = 1024
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def real_server(tiny_dense: Path) -> Iterator[ServerThread]:
    from deltaserve.engine.async_engine import AsyncEngine

    # --reasoning-parser qwen3 reaches the engine too (thinking-token budgets' markers)
    config = EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=MAX_MODEL_LEN, reasoning_parser="qwen3")
    engine = AsyncEngine.from_config(config)
    settings = ServerSettings(
        model_root=str(tiny_dense),
        served_model_names=[NAME],
        reasoning_parser="qwen3",
        tool_call_parser="qwen3_coder",
        enable_auto_tool_choice=True,
    )
    server = ServerThread(build_app(engine, settings)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def real_client(real_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def real_http(real_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real_server.base_url, timeout=60) as client:
        yield client


def test_models_and_tokenize(real_client: openai.OpenAI, real_http: httpx.Client, tiny_dense: Path) -> None:
    (card,) = real_client.models.list().data
    assert card.id == NAME and card.model_extra["root"] == str(tiny_dense)
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    tokens = real_http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert real_http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "Hello world"}


def test_greedy_completion_stream_equals_non_stream(real_client: openai.OpenAI) -> None:
    whole = real_client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    stream = real_client.completions.create(
        model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert "".join(chunk.choices[0].text for chunk in chunks[:-1]) == whole.choices[0].text


def test_stop_string_ends_generation(real_client: openai.OpenAI) -> None:
    text = real_client.completions.create(model=NAME, prompt="abc", max_tokens=16, temperature=0).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    choice = real_client.completions.create(model=NAME, prompt="abc", max_tokens=16, temperature=0, stop=[stop])
    assert choice.choices[0].finish_reason == "stop" and choice.choices[0].model_extra["stop_reason"] == stop
    assert stop not in choice.choices[0].text and text.startswith(choice.choices[0].text)


def test_n_and_logprobs(real_client: openai.OpenAI) -> None:
    completion = real_client.completions.create(model=NAME, prompt="xyz", max_tokens=4, n=2, logprobs=2, seed=1)
    assert sorted(choice.index for choice in completion.choices) == [0, 1]
    for choice in completion.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
        assert all(lp <= 0 for lp in logprobs.token_logprobs)
        # Keys are token texts, so byte fragments that decode alike ("") collide, as they do in vLLM.
        assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert completion.usage.completion_tokens == 8


def test_seed_at_the_int64_maximum_with_n(real_client: openai.OpenAI) -> None:
    # choice i is seeded seed + i (vLLM's ParentRequest); at the int64 maximum that is valid too, wrapped into int64
    def texts(seed: int, n: int) -> list[str]:
        reply = real_client.completions.create(model=NAME, prompt="xyz", max_tokens=4, n=n, temperature=1.0, seed=seed)
        return [choice.text for choice in sorted(reply.choices, key=lambda choice: choice.index)]

    top = 2**63 - 1
    first = texts(top, 2)
    assert texts(top, 2) == first  # reproducible
    assert first == [texts(top, 1)[0], texts(-(2**63), 1)[0]]


def test_n_children_are_not_validated_again(real_client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    """The n sequences of a prompt are shallow copies of its validated SamplingParams, as vLLM's ParentRequest
    makes them. Each was built with dataclasses.replace, which validated it again (its logit_bias clamped again) on
    the event loop: 256 prompts x n=128 with a full-vocabulary logit_bias, a 40 kB body, held /health for ~30 s."""
    num_validations = [0]
    validate = SamplingParams.validate

    def counted(params: SamplingParams) -> None:
        num_validations[0] += 1
        validate(params)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    bias = {str(token): 1 for token in range(100)}
    reply = real_client.completions.create(model=NAME, prompt="xyz", max_tokens=1, n=32, logit_bias=bias, seed=3)
    assert sorted(choice.index for choice in reply.choices) == list(range(32))
    assert num_validations[0] <= 2  # the API's SamplingParams and the engine front end's check, once each


def test_chat_stream_and_usage(real_client: openai.OpenAI, real_http: httpx.Client) -> None:
    num_prompt = real_http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    completion = real_client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_completion_tokens=6, logprobs=True, top_logprobs=1, n=2
    )
    assert completion.usage.prompt_tokens == num_prompt and completion.usage.completion_tokens == 12
    assert len(completion.choices) == 2 and len(completion.choices[0].logprobs.content) == 6
    assert all(len(item.top_logprobs) == 1 for item in completion.choices[0].logprobs.content)
    stream = real_client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == num_prompt and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES, ids=[case[0] for case in CASES])
def test_malformed_requests_against_the_real_engine(
    real_http: httpx.Client, name: str, path: str, body: Any, status: int, param: str | None
) -> None:
    """The same malformed requests as test_api_errors, now with the real engine behind the server."""
    check_malformed(real_http, path, body, status, param)


def test_thinking_token_budget(real_client: openai.OpenAI, real_http: httpx.Client) -> None:
    """vLLM's field on chat and completions: the reasoning holds the prompt's newline and budget - 1 tokens, then
    </think> is forced and the answer follows (streamed the same); -1 is no budget; a float is vLLM's 400."""
    extra = {"thinking_token_budget": 4, "chat_template_kwargs": {"enable_thinking": True}}
    reply = real_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                                logprobs=True, extra_body=extra)  # fmt: skip
    tokens = [item.token for item in reply.choices[0].logprobs.content]
    assert tokens.index("</think>") == 3, tokens
    reasoning = reply.choices[0].message.reasoning
    assert reply.usage.completion_tokens == 12 and reply.choices[0].message.content
    stream = real_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 extra_body=extra, stream=True)  # fmt: skip
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == reply.choices[0].message.content
    free = real_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                               extra_body={"thinking_token_budget": -1})  # fmt: skip
    assert free.choices[0].message.reasoning != reasoning
    prompt = real_http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": True}).json()["tokens"]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "thinking_token_budget": 2}
    completion = real_http.post("/v1/completions", json=body).json()
    assert "</think>" in completion["choices"][0]["text"]
    bad = real_http.post("/v1/chat/completions", json={"model": NAME, "messages": MESSAGES,
                                                         "thinking_token_budget": 1.5})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"
    assert "(parameter=thinking_token_budget, value=1.5)" in bad.json()["error"]["message"]


def test_repetition_detection(real_client: openai.OpenAI, real_http: httpx.Client) -> None:
    """vLLM's field: a token repeated (min_count 2, patterns of one token) ends the output there with finish_reason
    "repetition" (streamed too); bad parameters are vLLM's validation 400."""
    body = {"model": NAME, "prompt": "Hello there", "max_tokens": 40, "temperature": 0, "return_token_ids": True,
            "repetition_detection": {"max_pattern_size": 1, "min_count": 2}}  # fmt: skip
    choice = real_http.post("/v1/completions", json=body).json()["choices"][0]
    tokens = choice["token_ids"]
    assert choice["finish_reason"] == "repetition" and choice["stop_reason"] == "repetition_detected"
    assert tokens[-1] == tokens[-2] and all(a != b for a, b in itertools.pairwise(tokens[:-1])), tokens
    stream = real_client.completions.create(model=NAME, prompt="Hello there", max_tokens=40, temperature=0,
                                            extra_body={"repetition_detection": body["repetition_detection"]},
                                            stream=True)  # fmt: skip
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "repetition"
    assert "".join(c.choices[0].text for c in chunks) == choice["text"]
    bad = real_http.post(
        "/v1/completions",
        json={"model": NAME, "prompt": "x", "repetition_detection": {"max_pattern_size": 2, "min_count": 1}},
    )
    assert bad.status_code == 400 and "min_count must be >= 2" in bad.json()["error"]["message"]


def test_the_engine_still_serves_after_bad_requests(real_client: openai.OpenAI) -> None:
    assert real_client.completions.create(model=NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_disconnect_frees_kv_blocks_and_state_slot(real_http: httpx.Client) -> None:
    body = {"prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with real_http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # next(), not for/break: an abandoned iterator drops the connection
        num_chunks = 0
        while num_chunks < 3:
            num_chunks += next(lines).startswith("data: ")
        deadline = time.monotonic() + 5
        while metric_value(real_http.get("/metrics").text, "vllm:num_requests_running") != 1:
            assert time.monotonic() < deadline, "the stream is not running"
            time.sleep(0.01)
        text = real_http.get("/metrics").text
        assert metric_value(text, "deltaserve:num_free_state_slots") < metric_value(
            text, "deltaserve:num_total_state_slots"
        )
        assert metric_value(text, "deltaserve:num_free_kv_blocks") < metric_value(
            text, "deltaserve:num_total_kv_blocks"
        )
    text = wait_until_freed(real_http)
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0
