"""/v1/chat/completions against the FakeEngine: template, reasoning, tool calls, streaming order, logprobs."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .test_api_completions import sse_events

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_OUTPUT = (
    "The user wants weather.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
CALL = TOOL_OUTPUT.split("</think>\n\n")[1]
# vLLM 0.26's make_tool_call_id for Qwen (entrypoints/chat_utils.py): chatcmpl-tool- and random_uuid()'s 16 hex digits
VLLM_CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_chat_reasoning_and_usage_counts_template_tokens(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Simple.</think>\n\nIt is sunny."])
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER)
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    message = completion.choices[0].message
    assert message.role == "assistant" and message.content == "\n\nIt is sunny."
    assert message.model_extra["reasoning"] == "Simple."
    assert completion.choices[0].finish_reason == "stop"
    prompt = fake_engine.tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert (
        completion.usage.prompt_tokens == len(fake_engine.tokenizer.encode(prompt)) == len(fake_engine.last_prompt_ids)
    )


def test_thinking_disabled_means_no_reasoning(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Just the answer."])
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    message = completion.choices[0].message
    assert message.content == "Just the answer." and message.model_extra["reasoning"] is None
    prompt = fake_engine.tokenizer.decode(fake_engine.last_prompt_ids)
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_truncated_thinking_is_all_reasoning(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Still thinking about this"])
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_completion_tokens=3)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "length"
    assert message.content is None and message.model_extra["reasoning"]


def test_max_tokens_default_is_rest_of_context(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["ok"])
    client.chat.completions.create(model=MODEL_NAME, messages=USER)
    assert fake_engine.last_params.max_tokens == fake_engine.max_model_len - len(fake_engine.last_prompt_ids)
    client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=7)
    assert fake_engine.last_params.max_tokens == 7


def test_tool_call_non_streaming(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append([TOOL_OUTPUT])
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert VLLM_CALL_ID.fullmatch(call.id) and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert "<tools>" in fake_engine.tokenizer.decode(fake_engine.last_prompt_ids)


def test_tool_call_streaming_first_name_then_arguments(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Checking.</think>\n\nLet me look.\n\n" + CALL])
    stream = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, stream=True)
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += delta.model_extra.get("reasoning") or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    # vLLM streams the whitespace around the content before a call (its non-streamed content strips it)
    assert reasoning == "Checking." and content == "\n\nLet me look.\n\n" and finish == "tool_calls"
    assert VLLM_CALL_ID.fullmatch(calls[0].id) and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments is None  # vLLM's name delta has no arguments key
    assert all(call.id is None and call.function.name is None for call in calls[1:]) and len(calls) > 2
    arguments = "".join(call.function.arguments or "" for call in calls)
    assert json.loads(arguments) == {"city": "Paris", "days": 2}


def stream_tool_chat(client: openai.OpenAI) -> tuple[str, list[Any]]:
    """A streamed tool chat (thinking off): its content joined, and its tool-call deltas."""
    stream = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, stream=True,
                                            extra_body=NO_THINKING)  # fmt: skip
    content, calls = "", []
    for chunk in stream:
        content += chunk.choices[0].delta.content or ""
        calls += chunk.choices[0].delta.tool_calls or []
    return content, calls


def full_tool_chat(client: openai.OpenAI) -> Any:
    """A non-streamed tool chat (thinking off): its message."""
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, extra_body=NO_THINKING)
    return completion.choices[0].message


def test_tool_call_ids_are_vllms(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    """vLLM 0.26 names a Qwen call `chatcmpl-tool-` and 16 hex digits (make_tool_call_id's "random" kind), streamed
    or not; each call has its own."""
    fake_engine.scripts.append([CALL + "\n" + CALL])
    calls = full_tool_chat(client).tool_calls
    assert len(calls) == 2 and all(VLLM_CALL_ID.fullmatch(call.id) for call in calls) and calls[0].id != calls[1].id
    fake_engine.scripts.append([CALL])
    _, deltas = stream_tool_chat(client)
    (first, *rest) = deltas
    assert VLLM_CALL_ID.fullmatch(first.id) and all(delta.id is None for delta in rest)


def test_whitespace_before_a_call_is_stripped_only_when_not_streamed(
    client: openai.OpenAI, fake_engine: FakeEngine
) -> None:
    """vLLM 0.26's qwen3_coder chain: a non-streamed message's content is the text before the call stripped on both
    sides (None when only whitespace is left); a stream sends it as generated, except whitespace-only text before
    any other content, which a call drops."""
    text = "\n\n  Let me check.  \n\n"
    fake_engine.scripts.append([text + CALL])
    message = full_tool_chat(client)
    assert message.content == "Let me check." and len(message.tool_calls) == 1
    fake_engine.scripts.append([text + CALL])
    content, calls = stream_tool_chat(client)
    assert content == text and calls[0].function.name == "get_weather"
    for stream in (False, True):
        fake_engine.scripts.append(["\n \n" + CALL])
        content = stream_tool_chat(client)[0] if stream else full_tool_chat(client).content
        assert content == ("" if stream else None), stream


def test_text_after_a_call_is_streamed_and_dropped_when_not_streamed(
    client: openai.OpenAI, fake_engine: FakeEngine
) -> None:
    """vLLM 0.26 streams the text after a call's </tool_call> (and between two calls) as content and leaves it out
    of the non-streamed message; text between </function> and </tool_call> is dropped in both."""
    output = "Sure.\n" + CALL + "\nBetween.\n" + CALL.replace("</function>", "</function> lost") + "\nDone."
    fake_engine.scripts.append([output])
    message = full_tool_chat(client)
    assert message.content == "Sure." and len(message.tool_calls) == 2
    fake_engine.scripts.append([output])
    content, calls = stream_tool_chat(client)
    assert content == "Sure.\n\nBetween.\n\nDone." and len({call.index for call in calls}) == 2


def stream_deltas(http: httpx.Client, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """A streamed chat's deltas as sent (the role chunk and empty deltas left out), and its finish_reason."""
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": USER, "stream": True, **body})
    chunks = [json.loads(data) for data in sse_events(response)[:-1]]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    finish = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]][-1]
    return [delta for delta in deltas if delta and "role" not in delta], finish


def test_streamed_tool_call_deltas_are_vllms(fake_engine: FakeEngine, http: httpx.Client) -> None:
    """vLLM 0.26's qwen3_coder stream, replayed token by token through its own parser chain: the id and name
    (no arguments key), `{"city": "`, the string value token by token, and a value that needs its whole text (an
    integer) once the next parameter opens or the call ends."""
    fake_engine.scripts.append(["Sure.\n" + CALL])
    deltas, finish = stream_deltas(http, {"tools": TOOLS, **NO_THINKING})
    assert deltas[:3] == [{"content": "S"}, {"content": "ure"}, {"content": ".\n"}] and finish == "tool_calls"
    (first,) = deltas[3]["tool_calls"]
    assert VLLM_CALL_ID.fullmatch(first.pop("id"))
    assert first == {"index": 0, "type": "function", "function": {"name": "get_weather"}}
    arguments = [delta["tool_calls"] for delta in deltas[4:]]
    assert arguments == [[{"index": 0, "function": {"arguments": fragment}}]
                         for fragment in ('{"city": "', "P", "ar", "is", '", "days": ', "2}")]  # fmt: skip
    days_first = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n<parameter=city>\nNew York\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    fake_engine.scripts.append([days_first])
    deltas, _ = stream_deltas(http, {"tools": TOOLS, **NO_THINKING})
    fragments = [call["function"].get("arguments") for delta in deltas for call in delta["tool_calls"]]
    assert fragments == [None, '{"days": ', '2, "city": "', "N", "ew", " ", "Y", "or", "k", '"}']


def test_a_call_written_under_tool_choice_none_is_dropped(
    client: openai.OpenAI, fake_engine: FakeEngine, http: httpx.Client
) -> None:
    """vLLM 0.26 with --enable-auto-tool-choice runs its qwen3_coder parser under tool_choice "none" and drops the
    call (DelegatingParser, vllm/parser/abstract_parser.py). With tools sent the calls' events are ignored: the text
    around them is the content as generated, and each streamed delta carries `"tool_calls": []`."""
    output = "Sure.\n" + CALL + "\nDone."
    fake_engine.scripts.append([output])
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="none",
                                                extra_body=NO_THINKING)  # fmt: skip
    choice = completion.choices[0]
    assert choice.message.content == "Sure.\n\nDone." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    fake_engine.scripts.append([output])
    deltas, finish = stream_deltas(http, {"tools": TOOLS, "tool_choice": "none", **NO_THINKING})
    assert deltas == [{"content": text, "tool_calls": []} for text in ("S", "ure", ".\n", "\n", "D", "one", ".")]
    assert finish == "stop"


def test_a_call_written_without_tools_is_read_and_dropped(
    client: openai.OpenAI, fake_engine: FakeEngine, http: httpx.Client
) -> None:
    """No tools: tool_choice is "none" and vLLM reads the call as under "auto" (the content before it stripped and
    the text after it dropped when not streamed) and returns none; its stream sends `"tool_calls": []` where the
    call's deltas would have gone."""
    output = "Sure.\n" + CALL + "\nDone."
    fake_engine.scripts.append([output])
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body=NO_THINKING)
    choice = completion.choices[0]
    assert choice.message.content == "Sure." and choice.message.tool_calls is None and choice.finish_reason == "stop"
    fake_engine.scripts.append([output])
    deltas, finish = stream_deltas(http, NO_THINKING)
    marked = [{"content": text, "tool_calls": []} for text in ("S", "ure", ".\n")]
    assert deltas == marked + [{"tool_calls": []}] * 8 + [
        {"content": text, "tool_calls": []} for text in ("\n", "D", "one", ".")
    ]
    assert finish == "stop"


def test_tool_choice_none_and_validation(client: openai.OpenAI, fake_engine: FakeEngine, http: httpx.Client) -> None:
    fake_engine.scripts.append([TOOL_OUTPUT])
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="none")
    # vLLM 0.26 reads the call and drops it: the text around it stays, untrimmed
    assert completion.choices[0].message.tool_calls is None and completion.choices[0].message.content == "\n\n"
    fake_engine.scripts.append([TOOL_OUTPUT])
    named = {"type": "function", "function": {"name": "get_weather"}}
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=named)
    assert completion.choices[0].message.tool_calls[0].function.name == "get_weather"
    bad = {"type": "function", "function": {"name": "nope"}}
    response = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": bad})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    response = http.post("/v1/chat/completions", json={"messages": USER, "tool_choice": "required"})
    assert response.status_code == 400


def test_assistant_history_with_tool_calls_renders(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]
    fake_engine.scripts.append(["done</think>It is 22C."])
    completion = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS)
    assert completion.choices[0].message.content == "It is 22C."
    prompt = fake_engine.tokenizer.decode(fake_engine.last_prompt_ids)
    assert "<parameter=city>\nParis\n</parameter>" in prompt and "<tool_response>\n22C\n</tool_response>" in prompt


def test_stream_role_chunk_comes_with_first_token(http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Hmm.</think>\n\nHi!"])
    body = {"messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    chunks = [json.loads(event) for event in sse_events(http.post("/v1/chat/completions", json=body))[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[1]["choices"][0]["delta"] == {"reasoning": "H"}, "the first token follows the role chunk"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0


def test_chat_logprobs_and_n(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["a</think>first", "b</think>second"])
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, n=2, logprobs=True, top_logprobs=2)
    assert [choice.message.content for choice in completion.choices] == ["first", "second"]
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens // 2 or len(content) > 3
    assert content[0].logprob == -0.25 and len(content[0].top_logprobs) == 2
    assert content[0].bytes == list(content[0].token.encode())


def test_fields_not_asked_for_are_null_not_absent(client: openai.OpenAI, http: httpx.Client) -> None:
    """vLLM's test_prompt_logprobs_chat reads completion.prompt_logprobs (None): its response model is sent whole."""
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2)
    assert completion.prompt_logprobs is None and completion.prompt_token_ids is None
    assert completion.choices[0].token_ids is None
    body = {"messages": USER, "max_tokens": 2, "return_token_ids": True, "prompt_logprobs": 0}
    asked = http.post("/v1/chat/completions", json=body).json()
    assert len(asked["prompt_logprobs"]) == len(asked["prompt_token_ids"]) > 0
    assert len(asked["choices"][0]["token_ids"]) == asked["usage"]["completion_tokens"]


def test_return_prompt_text_gives_the_rendered_prompt(fake_engine: FakeEngine, http: httpx.Client) -> None:
    """vLLM's return_prompt_text: the prompt the chat template rendered, the text of the ids the engine was given;
    null when not asked; a stream sends it on each choice's first chunk only."""
    body = {"messages": USER, "max_tokens": 2, "return_prompt_text": True, "return_token_ids": True}
    asked = http.post("/v1/chat/completions", json=body).json()
    assert asked["prompt_text"].endswith("<|im_start|>assistant\n<think>\n") and "Paris" in asked["prompt_text"]
    assert fake_engine.tokenizer.encode(asked["prompt_text"], add_special_tokens=False) == asked["prompt_token_ids"]
    assert http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()["prompt_text"] is None
    streamed = {"model": MODEL_NAME, **body, "stream": True, "n": 2, "temperature": 1.0}
    chunks = [json.loads(data) for data in sse_events(http.post("/v1/chat/completions", json=streamed))[:-1]]
    firsts = [chunk for chunk in chunks if "prompt_text" in chunk]
    assert len(firsts) == 2 and all(chunk["prompt_text"] == asked["prompt_text"] for chunk in firsts)
    assert all(chunk["choices"][0]["delta"].get("role") == "assistant" for chunk in firsts)


def test_the_message_carries_vllms_null_fields(client: openai.OpenAI, http: httpx.Client) -> None:
    """vLLM's test_invocations compares the client's dump of a reply with the raw JSON: the message's OpenAI fields
    and reasoning are null, not absent (tool_calls is left out when empty, as vLLM's serializer drops it)."""
    raw = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "temperature": 0}).json()
    message = raw["choices"][0]["message"]
    assert {key: message[key] for key in ("refusal", "annotations", "audio", "function_call")} == dict.fromkeys(
        ("refusal", "annotations", "audio", "function_call")
    )
    assert "reasoning" in message and "tool_calls" not in message
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, temperature=0)
    dumped = reply.model_dump()["choices"][0]["message"]
    assert {key: value for key, value in dumped.items() if key != "tool_calls"} == message


def test_continue_final_message(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    messages = [*USER, {"role": "assistant", "content": "The weather is"}]
    fake_engine.scripts.append([" sunny."])
    client.chat.completions.create(
        model=MODEL_NAME, messages=messages, extra_body={"continue_final_message": True, "add_generation_prompt": False}
    )
    assert fake_engine.tokenizer.decode(fake_engine.last_prompt_ids).endswith("The weather is")


def test_request_template_is_refused_without_trust(fake_engine: FakeEngine, http: httpx.Client) -> None:
    body = {"messages": USER, "chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}", "max_tokens": 2}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "--trust-request-chat-template" in response.json()["error"]["message"]
    body = {"messages": USER, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 400


def test_include_reasoning_false_drops_reasoning(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["secret plan</think>Answer."])
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, extra_body={"include_reasoning": False}
    )
    assert completion.choices[0].message.content == "Answer."
    assert not completion.choices[0].message.model_extra.get("reasoning")


def test_stream_n_sends_a_role_chunk_per_choice(http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["a</think>x", "b</think>y"])
    body = {"messages": USER, "n": 2, "stream": True}
    chunks = [json.loads(event) for event in sse_events(http.post("/v1/chat/completions", json=body))[:-1]]
    roles = [chunk["choices"][0]["index"] for chunk in chunks if "role" in chunk["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1]
    content = {0: "", 1: ""}
    for chunk in chunks:
        choice = chunk["choices"][0]
        content[choice["index"]] += choice["delta"].get("content", "")
    assert content == {0: "x", 1: "y"}
