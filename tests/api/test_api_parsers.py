"""The qwen3 reasoning parser and the Qwen3.5 XML tool-call parser on crafted outputs, whole and split anywhere."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from deltaserve.api.chat_output import ChoiceProcessor, MessageBuilder
from deltaserve.api.reasoning import Qwen3ReasoningParser, prompt_opens_thinking
from deltaserve.api.tool_parser import Qwen3XMLToolParser, convert_value

from .fake_engine import build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array"},
                    "extra": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    }
]

CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    '<parameter=metric>\ntrue\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n</function>\n</tool_call>'
)
CALL_ARGS = {"city": "New York", "days": 3, "metric": True, "tags": ["a", "b"]}


def run(
    text: str, pieces: list[int] | None, *, thinking: bool = True, disabled: bool = False, streamed: bool = False
) -> dict[str, Any]:
    """Feeds text in pieces (split at the given offsets) through a full choice processor; returns the message (the
    non-streamed one, or with streamed=True the stream's deltas folded)."""
    processor = ChoiceProcessor(
        Qwen3ReasoningParser(is_prompt_thinking=thinking, is_thinking_disabled=disabled),
        Qwen3XMLToolParser(TOOLS, is_streamed=streamed),
    )
    builder = MessageBuilder(processor)
    bounds = [0, *(pieces or []), len(text)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        builder.add(processor.feed(text[start:end]))
    builder.add(processor.finish())
    return builder.message()


def every_split(text: str) -> list[list[int]]:
    return [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]


def test_prompt_opens_thinking() -> None:
    assert prompt_opens_thinking("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>user\n<think>\n<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("text", "thinking", "disabled", "reasoning", "content"),
    [
        ("I think.</think>\n\nAnswer.", True, False, "I think.", "\n\nAnswer."),
        ("<think>I think.</think>Answer.", False, False, "I think.", "Answer."),
        ("  <think>I think.</think>Answer.", False, False, "I think.", "Answer."),
        ("never closed", True, False, "never closed", None),  # vLLM: no </think> while thinking -> all reasoning
        ("plain answer", False, False, None, "plain answer"),
        ("a</think>b", True, True, None, "a</think>b"),  # enable_thinking false: no reasoning at all
        ("<think>a<think>b</think>c", True, False, "ab", "c"),
    ],
)
def test_reasoning_split_agrees_whole_and_streamed(
    text: str, thinking: bool, disabled: bool, reasoning: str | None, content: str | None
) -> None:
    for pieces in [None, *every_split(text)]:
        message = run(text, pieces, thinking=thinking, disabled=disabled)
        assert (message["reasoning"], message["content"]) == (reasoning, content), pieces


def test_tool_call_whole_and_streamed() -> None:
    text = "Thinking about it.</think>\n\nLet me check.\n\n" + CALL
    for pieces in [None, *every_split(text)[:: max(1, len(text) // 60)]]:
        # vLLM 0.26: the content before a call is stripped when not streamed, streamed as generated
        assert run(text, pieces, streamed=True)["content"] == "\n\nLet me check.\n\n", pieces
        message = run(text, pieces)
        assert message["reasoning"] == "Thinking about it."
        assert message["content"] == "Let me check."
        (call,) = message["tool_calls"]
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call["id"]) and call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == CALL_ARGS
        assert call["function"]["arguments"] == json.dumps(CALL_ARGS)


def test_tool_call_without_think_end_ends_reasoning() -> None:
    # vLLM 0.26's qwen3 parser: <tool_call> inside an open <think> ends reasoning and the call is parsed
    text = "Need the weather.\n" + CALL
    for pieces in [None, *every_split(text)[:: max(1, len(text) // 60)]]:
        message = run(text, pieces)
        assert (message["reasoning"], message["content"]) == ("Need the weather.\n", None), pieces
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == CALL_ARGS


def test_tool_call_deltas_come_incrementally() -> None:
    """vLLM 0.26's boundaries (ParserEngine._handle_arg_chunk, _compute_arg_delta): the name with the first text after
    `<function=NAME>`, then `{"city": "` and the string value as it comes, the closing `"}` at </function>."""
    parser = Qwen3XMLToolParser(TOOLS)
    assert parser.feed("<tool_call>\n<function=get_wea") == ("", [])
    assert parser.feed("ther>") == ("", [])  # no body text yet: vLLM sends the name with the first
    _, calls = parser.feed("\n<parameter=city>\nPar")
    assert calls[0]["function"] == {"name": "get_weather"} and calls[0]["index"] == 0 and calls[0]["type"] == "function"
    assert calls[1:] == [{"index": 0, "function": {"arguments": '{"city": "Par'}}]
    assert parser.feed("is\n</par") == ("", [{"index": 0, "function": {"arguments": "is"}}])
    assert parser.feed("ameter>\n") == ("", [])
    assert parser.feed("</function>\n</tool_call>") == ("", [{"index": 0, "function": {"arguments": '"}'}}])


def argument_steps(text: str) -> tuple[list[str | None], str]:
    """The text fed one token at a time (the tiny tokenizer's, as the FakeEngine emits it): each tool-call delta's
    arguments as the stream sends them (None for the name's delta), and the non-streamed arguments."""
    tokenizer = build_tokenizer()
    pieces = [tokenizer.decode([token]) for token in tokenizer.encode(text, add_special_tokens=False)]
    parser = Qwen3XMLToolParser(TOOLS)
    deltas = [call for piece in pieces for call in parser.feed(piece)[1]] + parser.finish()[1]
    whole = Qwen3XMLToolParser(TOOLS, is_streamed=False)
    _, calls = whole.feed(text)
    calls += whole.finish()[1]
    return [delta["function"].get("arguments") for delta in deltas], "".join(
        call["function"].get("arguments", "") for call in calls
    )


def _call(params: list[tuple[str, str]], name: str = "get_weather") -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "streamed", "whole"),
    [
        # vLLM 0.26's qwen3_coder chain (parse_delta token by token, and parse) run on these outputs
        (_call([("days", "3"), ("city", "New York"), ("metric", "true")]),
         [None, '{"days": ', '3, "city": "', "N", "ew", " ", "Y", "or", "k", '", "metric": ', "true}"],
         '{"days": 3, "city": "New York", "metric": true}'),
        # a key the schema lacks, or one not given as a plain string, goes out whole
        (_call([("zzz", "hello world"), ("note", "a b"), ("city", "X")]),
         [None, '{"zzz": ', '"hello world", "note": ', '"a b", "city": "', "X", '"}'],
         '{"zzz": "hello world", "note": "a b", "city": "X"}'),
        # a possible tag waits for the next text, as vLLM's lexer holds it
        (_call([("city", "a < b <c> d")]), [None, '{"city": "', "a", " ", "< b", " ", "<c", ">", " d", '"}'],
         '{"city": "a < b <c> d"}'),
        # a repeated key: the JSON no longer continues what went out, and vLLM sends nothing more for the call
        (_call([("city", "A"), ("city", "B")]), [None, '{"city": "', "A"], '{"city": "B"}'),
        # a function the tools do not describe: every value is a string and streams
        (_call([("a", "hello"), ("b", "12")], "other"),
         [None, '{"a": "', "he", "l", "lo", '", "b": "', "1", "2", '"}'], '{"a": "hello", "b": "12"}'),
        # cut off by the length limit: the open parameter is left out of the finished JSON, and no closing brace
        # follows what was streamed
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [None, '{"city": "', "P", "ar"], "{}"),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3",
         [None, '{"city": "', "P", "ar", "is", '", "days": '], '{"city": "Paris"}'),
        ("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", [None, "{}"], "{}"),
    ],
)  # fmt: skip
def test_streamed_argument_deltas_are_vllms(text: str, streamed: list[str | None], whole: str) -> None:
    assert argument_steps(text) == (streamed, whole)


def test_two_calls_and_no_arguments() -> None:
    text = "<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"  # noqa: E501
    message = run(text, None, thinking=False)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a", "b"]
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ["{}", '{"x": "1"}']
    assert message["content"] is None


def test_function_without_tool_call_wrapper_and_non_call_text() -> None:
    message = run("<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>", None, thinking=False)
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"days": 2}
    message = run('<tool_call>{"name": "x"}</tool_call>', None, thinking=False)
    assert "tool_calls" not in message and message["content"] == '<tool_call>{"name": "x"}</tool_call>'
    message = run("a < b and <tool", None, thinking=False)
    assert message["content"] == "a < b and <tool"


def test_a_tool_call_tag_in_prose_keeps_the_space_before_it() -> None:
    """`<tool_call>` not followed by a call is content, with the whitespace before it (it was dropped), whole and in
    every split; before a real call that whitespace still goes."""
    text = "Wrap calls in <tool_call> tags."
    for pieces in [None, *every_split(text)]:
        assert run(text, pieces, thinking=False)["content"] == text, pieces
    message = run("Here it is: \n" + CALL, None, thinking=False)
    assert message["content"] == "Here it is:" and len(message["tool_calls"]) == 1
    assert run("Here it is: \n" + CALL, None, thinking=False, streamed=True)["content"] == "Here it is: \n"


@pytest.mark.parametrize(
    ("text", "full", "streamed"),
    [
        # vLLM 0.26's qwen3_coder chain, run on these outputs (parse and parse_delta): not streamed, the text before
        # the first call stripped and the rest dropped; streamed, all of it but what lies between </function> and
        # </tool_call>, and whitespace-only text before any other content once a call opens
        ("\n\n  Let me check.  \n\n" + CALL, "Let me check.", "\n\n  Let me check.  \n\n"),
        ("\n \n" + CALL, None, None),
        ("Sure.\n" + CALL + "\nDone, see above.", "Sure.", "Sure.\n\nDone, see above."),
        ("A\n" + CALL + "\nmiddle\n" + CALL + "\ntail  ", "A", "A\n\nmiddle\n\ntail  "),
        ("A" + CALL.replace("</function>", "</function> lost") + " after", "A", "A after"),
        ("  no call  ", "  no call  ", "  no call  "),
        ("   ", "   ", "   "),
    ],
)
def test_content_around_calls_as_vllm_returns_it(text: str, full: str | None, streamed: str | None) -> None:
    for pieces in [None, *every_split(text)[:: max(1, len(text) // 40)]]:
        assert run(text, pieces, thinking=False)["content"] == full, pieces
        assert run(text, pieces, thinking=False, streamed=True)["content"] == streamed, pieces


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        ("4.5", {"type": "number"}, 4.5),
        ("4", {"type": "number"}, 4),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("['x']", {"type": "array"}, "['x']"),  # vLLM 0.26 reads JSON only, no Python literals
        ("null", {"type": ["string", "null"]}, None),
        ("007", {"type": "string"}, "007"),
        ("abc", {"type": "integer"}, "abc"),
        ("12", None, "12"),
        ("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 5),
        # vLLM 0.26's coerce_to_schema_type (tool_parsers/utils.py), as its qwen3_coder parser applies it
        ("1", {"type": "boolean"}, True),
        ("0", {"type": "boolean"}, False),
        ("5.0", {"type": "number"}, 5),
        ("1e3", {"type": "number"}, 1000),
        ("inf", {"type": "number"}, "inf"),
        ("nan", {"type": "number"}, "nan"),
        ("{'a': 1}", {"type": "object"}, "{'a': 1}"),
        ("null", None, "null"),
        ("null", {"description": "no type: a string"}, "null"),
        ("2", {"enum": [1, 2, 3]}, 2),
        ("7", {"allOf": [{"type": "integer"}]}, 7),
        ("9", {"type": "int64"}, 9),
        ("true", {"type": "integer"}, True),
    ],
)
def test_convert_value_by_schema(raw: str, schema: dict[str, Any] | None, value: Any) -> None:
    assert convert_value(raw, schema) == value
