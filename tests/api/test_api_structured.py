"""Issue 16 over the API, with the openai client, against the real engine on the tiny checkpoints (CPU):
structured outputs (json_object, json_schema, regex, choice, grammar), forced tool calls in the model's own format
(qwen3_coder XML on Qwen3.5, hermes JSON on Qwen3-Next), logit_bias / allowed_token_ids steering tokens,
prompt_logprobs and echo with logprobs, return_token_ids, streamed and not.

The random tiny weights write noise, so every assertion is about what the constraint guarantees."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from deltaserve.api.server import build_app
from deltaserve.api.settings import ServerSettings
from deltaserve.engine_config import EngineConfig

from .server_thread import ServerThread

NAME = "tiny"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "Answer in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]  # fmt: skip


def validate(value: Any, schema: dict[str, Any]) -> None:
    """The JSON-schema subset these tests use (type, enum, properties, required, additionalProperties)."""
    types = {"object": dict, "string": str, "boolean": bool, "integer": int, "array": list}
    if "type" in schema:
        assert isinstance(value, types[schema["type"]]), (value, schema)
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
    if schema.get("type") == "object":
        properties = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value), (value, schema)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(properties), (value, schema)
        for key, item in value.items():
            if key in properties:
                validate(item, properties[key])


def start_server(model: Path, parser: str) -> ServerThread:
    from deltaserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig(model=str(model), device="cpu", max_model_len=2048))
    settings = ServerSettings(model_root=str(model), served_model_names=[NAME], reasoning_parser="qwen3",
                              tool_call_parser=parser, enable_auto_tool_choice=True)  # fmt: skip
    return ServerThread(build_app(engine, settings)).start()


@pytest.fixture(scope="module")
def server(tiny_dense: Path) -> Iterator[ServerThread]:
    thread = start_server(tiny_dense, "qwen3_coder")
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as session:
        yield session


def test_json_schema_and_json_object(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    chat = client.chat.completions.create(model=NAME, messages=USER, max_tokens=80, temperature=0,
                                          response_format=response_format, extra_body=NO_THINK)  # fmt: skip
    assert chat.choices[0].finish_reason == "stop"
    validate(json.loads(chat.choices[0].message.content), SCHEMA)
    text = client.completions.create(model=NAME, prompt="{", max_tokens=80, temperature=0.7, seed=1,
                                     extra_body={"response_format": response_format,
                                                 "structured_outputs": {"disable_any_whitespace": True}},
                                     ).choices[0].text  # fmt: skip
    validate(json.loads(text), SCHEMA)
    streamed = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=80, temperature=0.9, seed=5, stream=True,
        extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}, **NO_THINK},
    )  # fmt: skip
    content = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    if content.endswith("}"):  # a random object can outgrow max_tokens; a finished one must parse
        assert isinstance(json.loads(content), dict)
    assert content.startswith("{")


def test_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    def complete(**structured: Any) -> str:
        reply = client.completions.create(model=NAME, prompt="Code:", max_tokens=20, temperature=1.0, seed=2,
                                          extra_body={"structured_outputs": structured})  # fmt: skip
        return reply.choices[0].text

    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", complete(regex=r"[A-Z]{2}-[0-9]{3}"))
    assert complete(choice=["alpha", "beta", "gamma"]) in ("alpha", "beta", "gamma")
    assert complete(grammar='root ::= ("yes" | "no") "!"').rstrip("!") in ("yes", "no")
    legacy = client.completions.create(model=NAME, prompt="x", max_tokens=10, temperature=0,
                                       extra_body={"guided_choice": ["up", "down"]})  # fmt: skip
    assert legacy.choices[0].text in ("up", "down")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_qwen_xml(client: openai.OpenAI, tool_choice: Any, stream: bool) -> None:
    reply = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=120, temperature=0.8, seed=3, stream=stream,
                                           parallel_tool_calls=False, extra_body=NO_THINK)  # fmt: skip
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in reply:
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for call in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        found = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        finish = reply.choices[0].finish_reason
        found = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
    # vLLM: "required" ends with "tool_calls", a named function's forced call with "stop"
    assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls") and len(found) == 1
    name, arguments = found[0]
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    validate(json.loads(arguments), schemas[name])


def test_forced_tool_call_hermes_on_qwen3_next(tiny_next: Path) -> None:
    thread = start_server(tiny_next, "hermes")
    try:
        hermes = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        reply = hermes.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice="required",
                                               max_tokens=120, temperature=0.8, seed=4, parallel_tool_calls=False,
                                               extra_body=NO_THINK)  # fmt: skip
        (call,) = reply.choices[0].message.tool_calls[:1]
        assert reply.choices[0].finish_reason == "tool_calls"
        schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
        validate(json.loads(call.function.arguments), schemas[call.function.name])
    finally:
        thread.stop()


def test_logit_bias_and_allowed_token_ids_steer(client: openai.OpenAI) -> None:
    def token_ids(**extra: Any) -> list[int]:
        reply = client.completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=1.0, seed=9,
                                          logit_bias=extra.pop("logit_bias", None),
                                          extra_body={"return_token_ids": True, **extra})  # fmt: skip
        return reply.choices[0].model_extra["token_ids"]

    free = token_ids()
    assert set(token_ids(logit_bias={"300": 100})) == {300} != set(free)
    # 1300 is past the tokenizer's length but inside config vocab_size: valid, as in vLLM
    assert set(token_ids(allowed_token_ids=[400, 401, 1300])) <= {400, 401, 1300}


def test_a_constraint_no_allowed_token_satisfies_fails_the_request(client: openai.OpenAI, http: httpx.Client) -> None:
    """choice ["yes"] with allowed_token_ids holding none of its tokens: the grammar cannot be followed, so the
    request fails with vLLM's error envelope (never a 200 whose text ignores the constraint), streamed and not,
    and the next request is served."""
    tokenizer_ids = http.post("/tokenize", json={"prompt": "no", "add_special_tokens": False}).json()["tokens"]
    body = {"structured_outputs": {"choice": ["yes"]}, "allowed_token_ids": tokenizer_ids}
    with pytest.raises(openai.BadRequestError, match="grammar rejected sampled token"):
        client.completions.create(model=NAME, prompt="Say it", max_tokens=4, temperature=0, extra_body=body)
    stream = client.completions.create(model=NAME, prompt="Say it", max_tokens=4, temperature=0, stream=True,
                                       extra_body=body)  # fmt: skip
    with pytest.raises(openai.APIError, match="grammar rejected sampled token"):
        list(stream)
    after = client.completions.create(model=NAME, prompt="Say it", max_tokens=4, temperature=0,
                                      extra_body={"structured_outputs": {"choice": ["yes"]}})  # fmt: skip
    assert after.choices[0].text == "yes"


def test_prompt_logprobs_echo_and_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    body = {"prompt": "The cat sat on the mat", "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2,
            "return_token_ids": True}  # fmt: skip
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    prompt_ids, reported = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert reported[0] is None and len(reported) == len(prompt_ids) and len(choice["token_ids"]) == 3
    for token_id, entry in zip(prompt_ids[1:], reported[1:], strict=True):
        assert str(token_id) in entry and 2 <= len(entry) <= 3 and entry[str(token_id)]["logprob"] <= 0
    echo = client.completions.create(model=NAME, prompt="The cat sat on the mat", max_tokens=3, temperature=0,
                                     echo=True, logprobs=1)  # fmt: skip
    logprobs = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith("The cat sat on the mat")
    assert len(logprobs.tokens) == len(prompt_ids) + 3 and logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[1:len(prompt_ids)] == [entry[str(t)]["logprob"] for t, entry in
                                                          zip(prompt_ids[1:], reported[1:], strict=True)]  # fmt: skip
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "prompt_logprobs": 0,
                                                   "return_token_ids": True, **NO_THINK}).json()  # fmt: skip
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    streamed = client.chat.completions.create(model=NAME, messages=USER, max_tokens=4, temperature=0, stream=True,
                                              extra_body={"return_token_ids": True, **NO_THINK})  # fmt: skip
    chunks = [chunk.model_dump() for chunk in streamed]
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    ids = [t for chunk in chunks for choice in chunk["choices"] for t in choice.get("token_ids") or []]
    assert len(ids) == 4


def test_echo_with_max_tokens_zero_scores_the_prompt(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The cat sat on the mat"
    scored = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice = scored.choices[0]
    num_prompt = scored.usage.prompt_tokens
    assert choice.text == prompt and len(choice.logprobs.tokens) == num_prompt
    assert choice.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    reference = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}).json()
    expected = [next(iter(entry.values()))["logprob"] for entry in reference["choices"][0]["prompt_logprobs"][1:]]
    assert choice.logprobs.token_logprobs[1:] == expected
    refused = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
