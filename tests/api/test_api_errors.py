"""Malformed requests each get a 4xx in vLLM's error envelope, and the server keeps answering after every one."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .test_api_completions import sse_events

USER = [{"role": "user", "content": "hi"}]
# a request of each endpoint, %s: the raw JSON of the fields under test
LONE_SURROGATE = {
    "/v1/completions": b'{"prompt": "x", "max_tokens": 2%s}',
    "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2%s}',
    "/v1/responses": b'{"input": "x", "max_output_tokens": 2%s}',
}
LONG_TEXT = "word " * 5000  # far beyond max_model_len (2048 tokens for the fake, 1024 for the real tiny engine)

# (name, path, body: dict -> JSON, bytes -> raw, expected status, expected param or None to skip the check)
NO_PARAM = "<none>"  # the expected error names no field (param null), as vLLM's plain ValueErrors

CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("broken json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("body is an array", "/v1/completions", b"[1, 2]", 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("NaN literal", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("deeply nested", "/v1/completions", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, 400, "body.prompt"),
    ("prompt mixed list", "/v1/completions", {"prompt": [1, "a"]}, 400, None),
    ("prompt missing", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("prompt empty string", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("prompt empty list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("prompt empty token list", "/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("oversize prompt", "/v1/completions", {"prompt": LONG_TEXT}, 400, "prompt"),
    ("max_tokens negative", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens huge", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "abc"}, 400, "body.max_tokens"),
    ("max_tokens float", "/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400, "body.max_tokens"),
    ("n zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("n huge", "/v1/completions", {"prompt": "x", "n": 10**6}, 400, "n"),
    ("temperature negative", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "body.temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_k below -1", "/v1/completions", {"prompt": "x", "top_k": -5}, 400, NO_PARAM),
    ("temperature above 2", "/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("greedy n 2", "/v1/completions", {"prompt": "x", "temperature": 0, "n": 2}, 400, NO_PARAM),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 100}, 400, "logprobs"),
    ("seed beyond int64", "/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "body.seed"),
    ("stop wrong type", "/v1/completions", {"prompt": "x", "stop": 5}, 400, None),
    ("stop empty string", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, NO_PARAM),
    ("min_tokens above max", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, NO_PARAM),
    ("stop_token_ids out of vocab", "/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, 400, None),
    ("truncate_prompt_tokens zero", "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400, None),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (
        "prompt_logprobs streamed",
        "/v1/completions",
        {"prompt": "x", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
    ),  # fmt: skip
    ("logit_bias out of vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"9999999": 10}}, 400, "logit_bias"),
    ("beam search in chat", "/v1/chat/completions", {"messages": USER, "use_beam_search": True}, 400, None),
    ("cache_salt empty", "/v1/chat/completions", {"messages": USER, "cache_salt": ""}, 400, "cache_salt"),
    (
        "logprob_token_ids without logprobs",
        "/v1/completions",
        {"prompt": "x", "logprob_token_ids": [1]},
        400,
        "logprob_token_ids",
    ),
    ("cache_salt not a string", "/v1/completions", {"prompt": "x", "cache_salt": 5}, 400, "cache_salt"),
    ("prompt_logprobs too many", "/v1/completions", {"prompt": "x", "prompt_logprobs": 100}, 400, "prompt_logprobs"),
    ("guided_json not JSON", "/v1/completions", {"prompt": "x", "guided_json": "{not json"}, 400, "guided_json"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("chat messages empty", "/v1/chat/completions", {"messages": []}, 400, "body.messages"),
    ("chat messages missing", "/v1/chat/completions", {"model": MODEL_NAME}, 400, "body.messages"),
    ("chat messages a string", "/v1/chat/completions", {"messages": "hi"}, 400, "body.messages"),
    ("chat message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, None),
    ("chat content wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, None),
    (
        "chat image part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        400,
        "messages.0.content",
    ),
    ("chat oversize prompt", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, None),
    (
        "chat max_completion_tokens negative",
        "/v1/chat/completions",
        {"messages": USER, "max_completion_tokens": -3},
        400,
        "max_tokens",
    ),  # fmt: skip
    ("chat max_tokens huge", "/v1/chat/completions", {"messages": USER, "max_tokens": 10**9}, 400, "max_tokens"),
    (
        "chat top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": USER, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),  # fmt: skip
    (
        "chat top_logprobs too many",
        "/v1/chat/completions",
        {"messages": USER, "logprobs": True, "top_logprobs": 50},
        400,
        "logprobs",  # vLLM's engine-side cap names the SamplingParams field
    ),  # fmt: skip
    (
        "chat tool_choice without tools",
        "/v1/chat/completions",
        {"messages": USER, "tool_choice": "auto"},
        400,
        "tool_choice",
    ),  # fmt: skip
    (
        "chat response_format json_schema without a schema",
        "/v1/chat/completions",
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format",
    ),  # fmt: skip
    (
        "chat template kwargs not a dict",
        "/v1/chat/completions",
        {"messages": USER, "chat_template_kwargs": [1]},
        400,
        None,
    ),  # fmt: skip
    (
        "chat template raises",
        "/v1/chat/completions",
        {"messages": USER, "chat_template": "{{ raise_exception('no') }}"},
        400,
        None,
    ),  # fmt: skip
    (
        "chat continue and generation prompt",
        "/v1/chat/completions",
        {"messages": [*USER, {"role": "assistant", "content": "a"}], "continue_final_message": True},
        400,
        "continue_final_message",
    ),  # fmt: skip
    (
        "chat tool arguments not JSON",
        "/v1/chat/completions",
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        400,
        "messages.1.tool_calls",
    ),  # fmt: skip
    ("chat unknown model", "/v1/chat/completions", {"model": "nope", "messages": USER}, 404, "model"),
    ("tokenize without prompt", "/tokenize", {"model": MODEL_NAME}, 400, "body.prompt"),
    ("tokenize unknown model", "/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("detokenize wrong type", "/detokenize", {"tokens": "abc"}, 400, "body.tokens"),
    # JSON's escapes spell a lone surrogate, which no UTF-8 encoder takes: as a cache_salt it reached the engine core's
    # prefix-cache hash and the core died (every request after it a 503); as a request_id a stream broke off mid-way
    *(
        (f"{path} cache_salt lone surrogate", path, base % b', "cache_salt": "\\ud800"', 400, "cache_salt")
        for path, base in LONE_SURROGATE.items()
    ),
    *(
        (
            f"{path} request_id lone surrogate{' streamed' * stream}",
            path,
            base % (b', "request_id": "\\ud800", "stream": ' + (b"true" if stream else b"false")),
            400,
            "request_id",
        )
        for path, base in LONE_SURROGATE.items()
        for stream in (False, True)
    ),  # fmt: skip
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES, ids=[case[0] for case in CASES])
def test_malformed_request_gets_envelope(
    http: httpx.Client, name: str, path: str, body: Any, status: int, param: str | None
) -> None:
    check_malformed(http, path, body, status, param)


def check_malformed(http: httpx.Client, path: str, body: Any, status: int, param: str | None) -> None:
    """One malformed request: the expected 4xx in vLLM's envelope, and /health still 200 afterwards."""
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    if param == NO_PARAM:  # a plain ValueError in vLLM: its 400 names no field
        assert error["param"] is None, error
    elif param is not None:
        assert error["param"] == param
    assert http.get("/health").status_code == 200


def test_unknown_model_message(http: httpx.Client) -> None:
    error = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}).json()["error"]
    assert error["message"] == "The model `gpt-4` does not exist."


def test_out_of_vocab_stop_token_ids_are_named_with_the_vocabulary_size(
    http: httpx.Client, fake_engine: FakeEngine
) -> None:
    """vLLM's test_chat_stop_token_ids_validation: the 400 names the bad ids and the vocabulary size."""
    vocab_size = len(fake_engine.tokenizer)  # the FakeEngine has no config vocab_size: the server bounds by this
    body = {"messages": USER, "max_tokens": 1, "stop_token_ids": [2, vocab_size + 1, -1]}
    error = http.post("/v1/chat/completions", json=body).json()["error"]
    expected = f"stop_token_ids contains out-of-vocab token id(s) [{vocab_size + 1}, -1]. Vocabulary size: {vocab_size}"
    assert error["message"] == expected and error["param"] == "stop_token_ids"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_zero_prompt_logprobs_may_stream(http: httpx.Client, path: str) -> None:
    """vLLM refuses prompt_logprobs with stream only above 0: 0 streams (nothing of it is sent), 1 is a 400."""
    body: dict[str, Any] = {"max_tokens": 2, "stream": True, "prompt_logprobs": 0}
    body.update({"prompt": "x"} if "chat" not in path else {"messages": USER})
    events = sse_events(http.post(path, json=body))
    assert events[-1] == "[DONE]" and all("error" not in json.loads(event) for event in events[:-1])
    response = http.post(path, json={**body, "prompt_logprobs": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_validation_errors_name_pydantics_error_type(http: httpx.Client, seed: int) -> None:
    """vLLM's test_long_seed: a seed past int64 is a validation error whose message names greater_than_equal or
    less_than_equal (vLLM renders each pydantic error whole: type, loc, msg, input)."""
    error = http.post("/v1/chat/completions", json={"messages": USER, "seed": seed}).json()["error"]
    kind = "greater_than_equal" if seed < 0 else "less_than_equal"
    assert error["param"] == "body.seed" and error["message"].startswith("1 validation error:\n  {")
    assert f"'type': '{kind}'" in error["message"] and f"'input': '{seed}'" in error["message"]


def test_validation_error_is_400_not_422(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "x", "n": "many"})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("1 validation error")


def test_mid_stream_error_is_an_event_then_done(http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.fail_after_tokens = 2
    body = {"prompt": "x", "max_tokens": 10, "stream": True}
    events = sse_events(http.post("/v1/completions", json=body))
    assert events[-1] == "[DONE]" and len(events) == 4
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    response = http.post("/v1/chat/completions", json={"messages": USER})
    assert response.status_code == 500 and response.json()["error"]["code"] == 500
    fake_engine.fail_after_tokens = None
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_dead_engine(http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.is_dead = True
    assert http.get("/health").status_code == 503 and http.get("/ping").status_code == 503
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    fake_engine.is_dead = False
    assert http.get("/health").status_code == 200


def test_hung_engine_fails_the_probes_only(http: httpx.Client, fake_engine: FakeEngine) -> None:
    """No heartbeat from the core: the probes fail (a balancer takes the server out); requests are still taken."""
    fake_engine.is_hung = True
    try:
        assert http.get("/health").status_code == 503 and http.get("/ping").status_code == 503
        assert http.post("/ping").status_code == 503
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        fake_engine.is_hung = False
    assert http.get("/health").status_code == 200


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    body = {"prompt": "x", "max_tokens": 1, "frobnicate": {"a": 1}, "priority": 0, "user": "u"}
    assert http.post("/v1/completions", json=body).status_code == 200
