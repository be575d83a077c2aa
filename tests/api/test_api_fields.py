"""Request and response fields as vLLM handles them: usage only when asked for (and its details), stream_options,
truncation_side, chat echo, reasoning_effort, no empty tool_calls, ignored fields logged, /invocations."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .server_thread import ServerThread, serve
from .test_api_completions import sse_events

USER = [{"role": "user", "content": "Hi"}]


def chunks(response: httpx.Response) -> list[dict[str, Any]]:
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("stream_options", "is_final_usage", "is_every_chunk"),
    [
        (None, False, False),
        ({"include_usage": False}, False, False),
        ({"include_usage": True}, True, False),
        ({}, False, False),  # include_usage defaults to false (vLLM PR #36379): an empty object asks for nothing
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
        ({"include_usage": False, "continuous_usage_stats": True}, False, False),
    ],
)
def test_streamed_usage_only_when_asked(
    http: httpx.Client, path: str, stream_options: Any, is_final_usage: bool, is_every_chunk: bool
) -> None:
    body: dict[str, Any] = {"max_tokens": 3, "stream": True}
    body.update({"prompt": "Hi"} if "chat" not in path else {"messages": USER})
    if stream_options is not None:
        body["stream_options"] = stream_options
    events = chunks(http.post(path, json=body))
    with_choices = [event for event in events if event["choices"]]
    assert all(("usage" in event) == is_every_chunk for event in with_choices)
    final = events[-1]
    assert (not final["choices"] and "usage" in final) == is_final_usage
    if is_final_usage:
        assert final["usage"]["completion_tokens"] == 3 and "prompt_tokens_details" not in final["usage"]


def test_empty_stream_options_without_stream_is_allowed(http: httpx.Client) -> None:
    # vLLM's check is on truthiness: an empty object passes without `stream`.
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "stream_options": {}}).status_code == 200


def test_stream_options_without_stream_is_refused_by_the_client_library_path(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Stream options can only be defined"):
        client.chat.completions.create(model=MODEL_NAME, messages=USER, stream_options={"include_usage": True})


@pytest.fixture(scope="module")
def details_server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    server = serve(fake_engine, enable_prompt_tokens_details=True, enable_force_include_usage=True,
                   reasoning_parser="qwen3")  # fmt: skip
    yield server
    server.stop()


def test_prompt_tokens_details_only_with_the_flag(
    http: httpx.Client, details_server: ServerThread, fake_engine: FakeEngine
) -> None:
    fake_engine.num_cached_tokens = 5
    plain = http.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 2}).json()["usage"]
    assert plain["prompt_tokens_details"] is None
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()["usage"]
    assert chat["prompt_tokens_details"] is None
    url = details_server.base_url
    fake_engine.num_cache_creation_tokens = 7
    usage = httpx.post(url + "/v1/completions", json={"prompt": "Hi there", "max_tokens": 2}).json()["usage"]
    # vLLM's PromptTokenUsageInfo whole; its completions set only the hits
    assert usage["prompt_tokens_details"] == {"cached_tokens": 5, "created_cache_tokens": None,
                                              "multimodal_tokens": None}  # fmt: skip
    raw = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()["usage"]
    assert raw["prompt_tokens_details"] == {"cached_tokens": 5, "created_cache_tokens": 7, "multimodal_tokens": None}
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens == 5
    fake_engine.num_cache_creation_tokens = 0


def test_force_include_usage_streams_usage_everywhere(details_server: ServerThread) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
    events = chunks(httpx.post(details_server.base_url + "/v1/completions", json=body))
    # one chunk per token (the fake engine emits one a step), then the usage-only final chunk: all four carry usage
    assert len(events) == 4 and all("usage" in event for event in events)
    assert [event["usage"]["completion_tokens"] for event in events] == [1, 2, 3, 3]
    # nothing cached: reported as 0, not left out (vLLM's test_single_completion; its check is `is not None`)
    assert not events[-1]["choices"] and events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    reply = httpx.post(details_server.base_url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    details = {"cached_tokens": 0, "created_cache_tokens": 0, "multimodal_tokens": None}
    assert reply.json()["usage"]["prompt_tokens_details"] == details


def test_reasoning_tokens_are_counted_by_token(details_server: ServerThread, fake_engine: FakeEngine) -> None:
    tokenizer = fake_engine.tokenizer
    num_reasoning = len(tokenizer.encode("Let me think about it", add_special_tokens=False))
    client = openai.OpenAI(base_url=details_server.base_url + "/v1", api_key="x", max_retries=0)
    fake_engine.scripts.append(["Let me think about it</think>\n\nIt is 4."])
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER)
    assert reply.usage.completion_tokens_details.reasoning_tokens == num_reasoning
    assert reply.choices[0].message.content == "\n\nIt is 4."
    fake_engine.scripts.append(["Let me think about it</think>\n\nIt is 4."])
    stream = client.chat.completions.create(model=MODEL_NAME, messages=USER, stream=True)
    final = list(stream)[-1]
    assert final.usage.completion_tokens_details.reasoning_tokens == num_reasoning
    fake_engine.scripts.append(["No thinking here."])
    off = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_no_reasoning_parser_no_completion_details(client: openai.OpenAI, http: httpx.Client) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    assert "completion_tokens_details" not in http.post("/v1/completions", json=body).json()["usage"]


def test_no_empty_tool_calls(http: httpx.Client, fake_engine: FakeEngine) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    fake_engine.scripts.append(["No call.</think>Plain answer."])
    message = http.post("/v1/chat/completions", json={"messages": USER, "tools": tools}).json()["choices"][0]
    assert "tool_calls" not in message["message"] and message["finish_reason"] == "stop"
    fake_engine.scripts.append(["No call.</think>Plain answer."])
    events = chunks(http.post("/v1/chat/completions", json={"messages": USER, "tools": tools, "stream": True}))
    num_tokens = len(fake_engine.tokenizer.encode("No call.</think>Plain answer.", add_special_tokens=False))
    # the role chunk, one per token but </think> (the reasoning parser shows nothing for it), the finish chunk (eos)
    assert len(events) == 1 + (num_tokens - 1) + 1 and all(len(event["choices"]) == 1 for event in events)
    deltas = [event["choices"][0]["delta"] for event in events]
    assert deltas[0] == {"role": "assistant", "content": ""} and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(delta.get("reasoning", "") for delta in deltas) == "No call."
    assert "".join(delta.get("content", "") for delta in deltas) == "Plain answer."
    assert all("tool_calls" not in delta for delta in deltas)


def test_truncation_side(http: httpx.Client, fake_engine: FakeEngine) -> None:
    ids = fake_engine.tokenizer.encode("one two three four five six", add_special_tokens=False)
    assert len(ids) > 3
    body = {"prompt": "one two three four five six", "max_tokens": 1, "truncate_prompt_tokens": 3}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert fake_engine.last_prompt_ids == ids[-3:]  # default: keep the last tokens, as vLLM generators do
    assert http.post("/v1/completions", json={**body, "truncation_side": "right"}).status_code == 200
    assert fake_engine.last_prompt_ids == ids[:3]
    assert http.post("/v1/completions", json={**body, "prompt": ids, "truncation_side": "right"}).status_code == 200
    assert fake_engine.last_prompt_ids == ids[:3]
    assert http.post("/v1/completions", json={**body, "prompt": ids}).status_code == 200
    assert fake_engine.last_prompt_ids == ids[-3:]
    chat = {"messages": USER, "max_tokens": 1, "truncate_prompt_tokens": 2, "truncation_side": "right"}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    full = fake_engine.tokenizer.encode(
        fake_engine.tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    )
    assert fake_engine.last_prompt_ids == full[:2]


def test_chat_echo_continues_the_final_assistant_message(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False,
             "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    fake_engine.scripts.append([" 42."])
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, extra_body=extra)
    assert reply.choices[0].message.content == "The answer is 42." and reply.choices[0].message.role == "assistant"
    prompt = fake_engine.tokenizer.decode(fake_engine.last_prompt_ids)
    assert prompt.endswith("The answer is") and not prompt.endswith("<|im_end|>\n")
    fake_engine.scripts.append([" 42."])
    stream = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, extra_body=extra, stream=True))
    assert stream[0].choices[0].delta.role == "assistant" and stream[1].choices[0].delta.content == "The answer is"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == "The answer is 42."
    # The final message is the user's and the response role is the assistant's: nothing to echo.
    fake_engine.scripts.append(["Hello."])
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body={"echo": True, **no_thinking})
    assert reply.choices[0].message.content == "Hello."


def test_reasoning_effort_maps_to_enable_thinking(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    def prompt_after(**extra: Any) -> str:
        fake_engine.scripts.append(["ok"])
        client.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body=extra)
        return fake_engine.tokenizer.decode(fake_engine.last_prompt_ids)

    assert prompt_after(reasoning_effort="none").endswith("<think>\n\n</think>\n\n")
    assert prompt_after(reasoning_effort="high").endswith("<think>\n")
    # An explicit enable_thinking in chat_template_kwargs wins over the effort.
    assert prompt_after(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}).endswith("<think>\n")
    fake_engine.scripts.append(["ok"])
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, reasoning_effort="none")
    assert reply.choices[0].message.content == "ok" and not reply.choices[0].message.model_extra.get("reasoning")


def test_ignored_fields_are_logged_as_vllm_logs_them(
    http: httpx.Client, caplog: pytest.LogCaptureFixture, fake_engine: FakeEngine
) -> None:
    caplog.set_level(logging.INFO)
    body = {"prompt": "x", "max_tokens": 1, "frobnicate_once": 1, "cache_salt": "s", "bad_words": []}
    assert http.post("/v1/completions", json=body).status_code == 200
    expected = "The following fields were present in the request but ignored: {'frobnicate_once'}"
    assert [r.getMessage() for r in caplog.records].count(expected) == 1
    assert fake_engine.last_cache_salt == "s"  # not ignored: it reaches the engine (the prefix cache's salt)
    caplog.clear()
    assert http.post("/v1/completions", json=body).status_code == 200  # the same set again is not logged again
    assert expected not in [r.getMessage() for r in caplog.records]


def test_json_content_type_with_charset(http: httpx.Client) -> None:
    response = http.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
                         headers={"content-type": "application/json; charset=utf-8"})  # fmt: skip
    assert response.status_code == 200
    refused = http.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["message"].endswith("Only 'application/json' is allowed")


def test_invocations_routes_by_body(http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["chat answer"])
    chat = http.post("/invocations", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"][0]["message"]["content"] == "chat answer"
    completion = http.post("/invocations", json={"prompt": "Hi", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    streamed = http.post("/invocations", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert sse_events(streamed)[-1] == "[DONE]"


def test_fastapi_404_and_405_use_the_envelope(http: httpx.Client) -> None:
    missing = http.get("/v2/nothing").json()["error"]
    assert missing == {"message": "Not Found", "type": "Not Found", "param": None, "code": 404}
    wrong = http.get("/v1/chat/completions").json()["error"]
    assert wrong == {"message": "Method Not Allowed", "type": "Method Not Allowed", "param": None, "code": 405}


def test_return_token_ids_style_fields_do_not_break_requests(http: httpx.Client) -> None:
    body = {"prompt": "x", "max_tokens": 1, "priority": 0, "kv_transfer_params": {"a": 1}, "vllm_xargs": {"k": 1}}
    assert http.post("/v1/completions", json=body).status_code == 200
