"""--tool-call-parser hermes (Qwen3-Next's JSON calls in <tool_call> tags), streamed and not, on the parser and on a
server driven by the openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from deltaserve.api.server import build_app
from deltaserve.api.settings import ServerSettings
from deltaserve.api.tool_parser_hermes import HermesToolParser

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .server_thread import ServerThread

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                     "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]  # fmt: skip
USER = [{"role": "user", "content": "Weather in Paris?"}]


def parse(text: str, step: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) from feeding text whole (step None) or `step` characters at a time, then finish()."""
    parser = HermesToolParser()
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    content, deltas = [], []
    for piece in pieces:
        text_part, calls = parser.feed(piece)
        content.append(text_part)
        deltas += calls
    text_part, calls = parser.finish()
    content.append(text_part)
    deltas += calls
    return "".join(content), [{"name": d["function"]["name"], "arguments": d["function"]["arguments"]} for d in deltas]


EXAMPLES = {
    "one call": (CALL, "", [("get_weather", {"city": "Paris", "days": 2})]),
    "text first": ("Let me check.\n\n" + CALL, "Let me check.\n\n", [("get_weather", {"city": "Paris", "days": 2})]),
    "two calls": (CALL + "\n" + CALL.replace("Paris", "Rome"), "",
                  [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome", "days": 2})]),
    "text after is dropped": (CALL + "\nDone!", "", [("get_weather", {"city": "Paris", "days": 2})]),
    "no call": ("Just text with a < sign and <tool", "Just text with a < sign and <tool", []),
    "bad JSON stays content": ('<tool_call>{"name": oops}</tool_call>', '<tool_call>{"name": oops}</tool_call>', []),
    "unclosed but whole": ('<tool_call>\n{"name": "f", "arguments": {}}', "", [("f", {})]),
    "unclosed and cut": ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    "parameters key": ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', "", [("f", {"a": 1})]),
    "unicode": ('<tool_call>{"name": "f", "arguments": {"q": "東京"}}</tool_call>', "", [("f", {"q": "東京"})]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(EXAMPLES))
@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_parser_streamed_equals_whole(name: str, step: int | None) -> None:
    text, content, calls = EXAMPLES[name]
    got_content, got_calls = parse(text, step)
    assert got_content == content
    assert [(call["name"], json.loads(call["arguments"])) for call in got_calls] == calls


def test_arguments_keep_unicode() -> None:
    _, calls = parse(EXAMPLES["unicode"][0])
    assert calls[0]["arguments"] == '{"q": "東京"}'


@pytest.fixture(scope="module")
def hermes_client(fake_engine: FakeEngine) -> Iterator[openai.OpenAI]:
    settings = ServerSettings(model_root="m", served_model_names=[MODEL_NAME], reasoning_parser="qwen3",
                              tool_call_parser="hermes", enable_auto_tool_choice=True)  # fmt: skip
    server = ServerThread(build_app(fake_engine, settings)).start()
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    server.stop()


def test_hermes_non_streaming(hermes_client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["I should look it up.</think>\n\n" + CALL])
    reply = hermes_client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS)
    choice = reply.choices[0]
    # As vLLM's hermes parser: the text before the call is content, as generated.
    assert choice.finish_reason == "tool_calls" and choice.message.content == "\n\n"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert choice.message.model_extra["reasoning"] == "I should look it up."


def test_hermes_streaming(hermes_client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Hmm.</think>\n\nChecking." + CALL])
    stream = hermes_client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "\n\nChecking." and finish == "tool_calls"
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}


def test_parallel_tool_calls_false_keeps_the_first_call(hermes_client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    two = "Two.</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Rome")
    fake_engine.scripts.append([two])
    reply = hermes_client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS)
    assert len(reply.choices[0].message.tool_calls) == 2
    fake_engine.scripts.append([two])
    reply = hermes_client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS,
                                                  parallel_tool_calls=False)  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["city"] == "Paris"
    fake_engine.scripts.append([two])
    stream = hermes_client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, stream=True,
                                                   parallel_tool_calls=False)  # fmt: skip
    indexes = {call.index for chunk in stream for call in chunk.choices[0].delta.tool_calls or []}
    assert indexes == {0}


def test_hermes_plain_answer(hermes_client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Fine.</think>\n\nIt is sunny."])
    reply = hermes_client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == "\n\nIt is sunny."
