"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as vLLM 0.26 serves it, driven by Anthropic's
own SDK against the FakeEngine under vLLM's Qwen3.5 recipe (reasoning parser, qwen3_coder tools): text, thinking and
tool_use blocks whole and streamed, stop reasons, usage, the conversion of every content block, token counts, and
errors in Anthropic's envelope."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from deltaserve.api.anthropic_protocol import MessagesRequest
from deltaserve.api.serving_anthropic import BlockStream, anthropic_usage, chat_request, convert_delta

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .server_thread import ServerThread
from .test_api_chat import TOOL_OUTPUT

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}]  # fmt: skip


@pytest.fixture
def sdk(fake_server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fake_server.base_url, api_key="unused", max_retries=0)


def test_a_message_with_thinking_and_text(sdk: anthropic.Anthropic, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Simple.</think>\n\nIt is sunny."])
    message = sdk.messages.create(model=MODEL_NAME, max_tokens=64, messages=USER)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("chatcmpl-")
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Simple." and len(thinking.signature) == 32
    assert text.type == "text" and text.text == "\n\nIt is sunny."
    assert message.stop_reason == "end_turn" and message.model == MODEL_NAME
    assert message.usage.input_tokens == len(fake_engine.last_prompt_ids) and message.usage.output_tokens > 0


def test_max_tokens_and_the_raw_body(fake_server: ServerThread, fake_engine: FakeEngine) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 3, "messages": USER, "thinking": {"type": "disabled"}}
    raw = httpx.post(fake_server.base_url + "/v1/messages", json=body).json()
    # vLLM's body without its null fields: no stop_sequence, no transfer parameters
    assert list(raw) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    assert raw["stop_reason"] == "max_tokens" and raw["usage"]["output_tokens"] == 3
    assert fake_engine.last_params.max_tokens == 3


def test_a_tool_use_block(sdk: anthropic.Anthropic, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append([TOOL_OUTPUT])
    message = sdk.messages.create(model=MODEL_NAME, max_tokens=128, messages=USER, tools=TOOLS)
    blocks = {block.type: block for block in message.content}
    assert set(blocks) == {"thinking", "tool_use"} and message.stop_reason == "tool_use"
    call = blocks["tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris", "days": 2} and call.id


def test_the_stream_is_anthropics_event_sequence(sdk: anthropic.Anthropic, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Simple.</think>\n\nIt is sunny."])
    with sdk.messages.stream(model=MODEL_NAME, max_tokens=64, messages=USER) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Simple." and final.content[1].text == "\n\nIt is sunny."
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    fake_engine.scripts.append([TOOL_OUTPUT])
    with sdk.messages.stream(model=MODEL_NAME, max_tokens=128, messages=USER, tools=TOOLS) as stream:
        final = stream.get_final_message()
    call = next(block for block in final.content if block.type == "tool_use")
    assert call.input == {"city": "Paris", "days": 2} and final.stop_reason == "tool_use"


def test_every_block_converts_as_vllms() -> None:
    request = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "stop_sequences": ["END"], "temperature": 0.5, "top_k": 3,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: abc"}, {"type": "text", "text": "Be brief."}],
        "tool_choice": {"type": "any"}, "tools": TOOLS, "output_config": {"effort": "low"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Look"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                              {"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "sunny"}]}]},
            {"role": "system", "content": " Inline."},
        ],
    })  # fmt: skip

    class State:  # the server's settings the conversion reads
        class settings:  # noqa: N801
            chat_template = None

    chat = chat_request(State(), request)  # type: ignore[arg-type]
    messages = [message.model_dump(exclude_none=True) for message in chat.messages]
    # the system blocks without the billing header, the inline system message merged in (the model's template)
    assert messages[0] == {"role": "system", "content": "Be brief. Inline."}
    assert messages[1]["content"][1]["image_url"]["url"] == "data:image/png;base64,AAAA"
    assert messages[2]["reasoning"] == "hmm"
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert len(messages) == 4  # the user message of tool results alone went as the tool message
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k) == (5, ["END"], 0.5, 3)
    assert chat.tool_choice == "required" and chat.reasoning_effort == "low"


def test_usage_takes_the_cache_out_of_input_tokens() -> None:
    usage = {"prompt_tokens": 100, "completion_tokens": 7,
             "prompt_tokens_details": {"cached_tokens": 64, "created_cache_tokens": 36}}  # fmt: skip
    assert anthropic_usage(usage) == {"input_tokens": 0, "output_tokens": 7, "cache_read_input_tokens": 64,
                                      "cache_creation_input_tokens": 36}  # fmt: skip
    assert anthropic_usage({"prompt_tokens": 9, "completion_tokens": None}) == {"input_tokens": 9, "output_tokens": 0}


def test_text_inside_a_tool_use_block_comes_after_it() -> None:
    blocks = BlockStream()
    events: list[str] = []
    events += convert_delta(blocks, {"reasoning": "think"})
    call = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a": '}}
    events += convert_delta(blocks, {"tool_calls": [call]})
    events += convert_delta(blocks, {"content": "stray"})
    events += convert_delta(blocks, {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})
    events += blocks.stop_and_flush()
    parsed = [json.loads(item.split("data: ", 1)[1]) for item in events]
    shape = [(p["type"], p.get("index"), (p.get("delta") or p.get("content_block") or {}).get("type")) for p in parsed]
    assert shape == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "tool_use"), ("content_block_delta", 1, "input_json_delta"),
        ("content_block_delta", 1, "input_json_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "text"), ("content_block_delta", 2, "text_delta"), ("content_block_stop", 2, None),
    ]  # fmt: skip


def test_count_tokens_is_the_rendered_prompts(sdk: anthropic.Anthropic, fake_server: ServerThread) -> None:
    counted = sdk.messages.count_tokens(model=MODEL_NAME, messages=USER, system="Be brief.")
    chat = [{"role": "system", "content": "Be brief."}, *USER]
    tokens = httpx.post(fake_server.base_url + "/tokenize", json={"messages": chat}).json()["count"]
    assert counted.input_tokens == tokens
    raw = httpx.post(fake_server.base_url + "/v1/messages/count_tokens",
                     json={"model": MODEL_NAME, "messages": USER}).json()  # fmt: skip
    assert raw["context_management"] == {"original_input_tokens": raw["input_tokens"]}


def test_errors_come_in_anthropics_envelope(sdk: anthropic.Anthropic, fake_server: ServerThread) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.create(model=MODEL_NAME, max_tokens=5000, messages=USER)  # past the 2048 context
    body: Any = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "BadRequestError"
    assert "maximum context length" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.create(model="no-such-model", max_tokens=5, messages=USER)
    # a body the request model refuses is the server's usual validation 400, as vLLM's
    reply = httpx.post(fake_server.base_url + "/v1/messages", json={"model": MODEL_NAME, "messages": USER})
    assert reply.status_code == 400 and "max_tokens" in reply.text


def test_the_api_key_is_a_bearer_token_as_in_vllm(fake_engine: FakeEngine) -> None:
    """With --api-key the key is checked as vLLM checks it, `Authorization: Bearer KEY` (Anthropic's SDK sends it so,
    from api_key= or auth_token=); Anthropic's x-api-key header alone is refused, as vLLM refuses it."""
    from .server_thread import serve

    server = serve(fake_engine, api_keys=["secret"], reasoning_parser="qwen3")
    try:
        for keyword in ("api_key", "auth_token"):
            sdk = anthropic.Anthropic(base_url=server.base_url, max_retries=0, **{keyword: "secret"})
            assert sdk.messages.create(model=MODEL_NAME, max_tokens=2, messages=USER).usage.output_tokens == 2
        body = {"model": MODEL_NAME, "max_tokens": 2, "messages": USER}
        reply = httpx.post(server.base_url + "/v1/messages", json=body, headers={"x-api-key": "secret"})
        assert reply.status_code == 401
    finally:
        server.stop()
