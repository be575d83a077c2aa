"""POST /v1/responses with the `openai` client's responses.create against the FakeEngine (qwen3 reasoning parser,
qwen3_coder tool calls): plain, instructions, streamed (vLLM's event order, sequence numbers, every event and the
final Response validated by the openai package's own models), vLLM's ids (streamed items bare, the completed
Response built again from the whole text), tool calls both ways, function-call history in the input,
max_output_tokens, logprobs (per step in the stream, every token in the message, the sampled token first), vLLM's
request checks and fields (tool_choice, include_reasoning, chat_template_kwargs), and every unsupported part
refused in vLLM's envelope."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deltaserve.api.responses_output import output_items
from deltaserve.engine.request import Logprob

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .test_api_chat import TOOL_OUTPUT

QUESTION = "What is the weather in Paris?"
TOOLS: list[Any] = [{
    "type": "function", "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]},
}]  # fmt: skip
EVENTS = TypeAdapter(ResponseStreamEvent)
# vLLM's reasoning-part events, which the openai package does not model (openai-python issue 2634)
VLLM_ONLY_EVENTS = {"response.reasoning_part.added", "response.reasoning_part.done"}


def strict(body: dict[str, Any]) -> Response:
    """The body validated by the openai package's Response model (the client itself only constructs it). vLLM's
    usage has no input_tokens_details.cache_write_tokens, which the package requires: checked on its own."""
    usage = body["usage"]
    if usage is not None:
        assert set(usage) == {"input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
                              "total_tokens"}  # fmt: skip
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    return Response.model_validate({**body, "usage": None})


def without_bytes(entry: dict[str, Any]) -> dict[str, Any]:
    """A message's logprob entry as a text delta carries it (vLLM's stream entries have no bytes)."""
    tops = [{"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]]
    return {"token": entry["token"], "logprob": entry["logprob"], "top_logprobs": tops}


def stream_events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed response, each checked against its `event:` line and the openai models."""
    response = http.post("/v1/responses", json={**body, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        if event["type"] not in VLLM_ONLY_EVENTS:
            EVENTS.validate_python({**event, "response": {**event["response"], "usage": None}}
                                   if "response" in event else event)  # fmt: skip
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def test_plain_response_with_reasoning_and_usage(client: openai.OpenAI, fake_engine: FakeEngine,
                                                 http: httpx.Client) -> None:  # fmt: skip
    fake_engine.scripts.append(["Simple.</think>\n\nIt is sunny."])
    response = client.responses.create(model=MODEL_NAME, input=QUESTION)
    assert response.object == "response" and re.fullmatch("resp_[0-9a-f]{16}", response.id)
    assert response.status == "completed"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Simple." and reasoning.status is None
    assert re.fullmatch("rs_[0-9a-f]{16}", reasoning.id) and re.fullmatch("msg_[0-9a-f]{16}", message.id)
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.output_text == "\n\nIt is sunny." and message.content[0].type == "output_text"
    prompt = fake_engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                                       add_generation_prompt=True)  # fmt: skip
    usage = response.usage
    assert usage.input_tokens == len(fake_engine.tokenizer.encode(prompt)) == len(fake_engine.last_prompt_ids)
    num_output = len(fake_engine.tokenizer.encode("Simple.</think>\n\nIt is sunny.")) + 1  # + eos
    assert usage.output_tokens == num_output and usage.total_tokens == usage.input_tokens + num_output
    assert usage.output_tokens_details.reasoning_tokens == len(fake_engine.tokenizer.encode("Simple."))
    assert usage.input_tokens_details.cached_tokens == 0
    fake_engine.scripts.append(["Simple.</think>\n\nIt is sunny."])
    body = http.post("/v1/responses", json={"model": MODEL_NAME, "input": QUESTION, "temperature": 0.5}).json()
    strict(body)
    # vLLM's check_tool_usage: without tools "auto" is "none"; its per-turn usage lists stay empty
    assert body["temperature"] == 0.5 and body["top_p"] == 1.0 and body["tool_choice"] == "none"
    assert (body["presence_penalty"], body["frequency_penalty"], body["kv_transfer_params"]) == (0.0, 0.0, None)
    details = body["usage"]["input_tokens_details"], body["usage"]["output_tokens_details"]
    assert details[0]["input_tokens_per_turn"] == details[1]["output_tokens_per_turn"] == []
    assert body["max_output_tokens"] == fake_engine.last_params.max_tokens == 2048 - usage.input_tokens


def test_instructions_message_list_and_sampling_fields(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Bonjour."])
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Say hello"}]},
                {"role": "assistant", "content": "Hello."},
                {"type": "message", "role": "user", "content": "In French."}]  # fmt: skip
    response = client.responses.create(
        model=MODEL_NAME, input=messages, instructions="Be brief.", max_output_tokens=40, temperature=0.3,
        top_p=0.9, reasoning={"effort": "none"}, extra_body={"top_k": 7, "seed": 5, "min_p": 0.1},
    )  # fmt: skip
    assert response.output_text == "Bonjour." and response.instructions == "Be brief."
    assert [item.type for item in response.output] == ["message"]  # thinking off: no reasoning item
    expected = fake_engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "In French."}],
        tokenize=False, add_generation_prompt=True, enable_thinking=False, reasoning_effort="none",
    )  # fmt: skip
    assert fake_engine.tokenizer.decode(fake_engine.last_prompt_ids) == expected
    params = fake_engine.last_params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed, params.min_p) == (
        40, 0.3, 0.9, 7, 5, 0.1)  # fmt: skip


def test_stream_event_sequence(client: openai.OpenAI, fake_engine: FakeEngine, http: httpx.Client) -> None:
    fake_engine.scripts.append(["Hmm.</think>\n\nHi there!"])
    events = stream_events(http, {"model": MODEL_NAME, "input": QUESTION})
    kinds = [event["type"] for event in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.reasoning_part.added", "response.reasoning_text.delta"]  # fmt: skip
    first_text = kinds.index("response.output_text.delta")
    assert kinds[first_text - 5 : first_text] == [
        "response.reasoning_text.done", "response.reasoning_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert set(kinds[first_text:-4]) == {"response.output_text.delta"}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    reasoning = "".join(event["delta"] for event in events if event["type"] == "response.reasoning_text.delta")
    assert (reasoning, text) == ("Hmm.", "\n\nHi there!")
    done_items = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    final = strict(events[-1]["response"])
    assert final.status == "completed" and final.output_text == text
    assert events[-1]["response"]["usage"]["output_tokens"] > 0
    added = [event for event in events if event["type"] == "response.output_item.added"]
    assert [event["output_index"] for event in added] == [0, 1] and added[1]["item"]["id"] == done_items[1]["id"]
    # vLLM's streamed items have bare ids; the completed Response is built again from the whole text, with its own
    assert all(re.fullmatch("[0-9a-f]{16}", item["id"]) for item in done_items)
    assert [item["id"].split("_")[0] for item in events[-1]["response"]["output"]] == ["rs", "msg"]
    assert [item["content"] for item in events[-1]["response"]["output"]] == [item["content"] for item in done_items]
    # the openai client parses the same stream into its event models
    fake_engine.scripts.append(["Hmm.</think>\n\nHi there!"])
    parsed = list(client.responses.create(model=MODEL_NAME, input=QUESTION, stream=True))
    assert [event.type for event in parsed] == kinds
    assert parsed[-1].response.output_text == "\n\nHi there!"


def test_tool_call_non_streaming_and_streamed(client: openai.OpenAI, fake_engine: FakeEngine,
                                              http: httpx.Client) -> None:  # fmt: skip
    fake_engine.scripts.append([TOOL_OUTPUT])
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, tools=TOOLS)
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and call.type == "function_call" and call.status == "completed"
    assert call.name == "get_weather" and re.fullmatch("chatcmpl-tool-[0-9a-f]{16}", call.call_id)
    assert re.fullmatch("fc_[0-9a-f]{16}", call.id)
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert "<tools>" in fake_engine.tokenizer.decode(fake_engine.last_prompt_ids)
    fake_engine.scripts.append([TOOL_OUTPUT])
    events = stream_events(http, {"model": MODEL_NAME, "input": QUESTION, "tools": TOOLS})
    kinds = [event["type"] for event in events]
    added = [event for event in events if event["type"] == "response.output_item.added"][-1]
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "get_weather"
    arguments = "".join(event["delta"] for event in events if event["type"] == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    # vLLM: the streamed call's call_id is call_ and 16 hex digits, the completed Response's the parser's id
    assert re.fullmatch("call_[0-9a-f]{16}", added["item"]["call_id"]) and re.fullmatch(
        "[0-9a-f]{16}", added["item"]["id"]
    )
    final = strict(events[-1]["response"])
    assert final.output[-1].arguments == arguments and final.output[-1].call_id.startswith("chatcmpl-tool-")
    fake_engine.scripts.append([TOOL_OUTPUT])
    named = client.responses.create(model=MODEL_NAME, input=QUESTION, tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert named.output[-1].type == "function_call" and named.tool_choice.name == "get_weather"


def test_function_call_history_renders_as_tool_turns(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    history = [
        {"role": "user", "content": QUESTION},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
    ]
    fake_engine.scripts.append(["done</think>It is 22C."])
    response = client.responses.create(model=MODEL_NAME, input=history, tools=TOOLS)
    assert response.output_text == "It is 22C."
    prompt = fake_engine.tokenizer.decode(fake_engine.last_prompt_ids)
    assert "<parameter=city>\nParis\n</parameter>" in prompt and "<tool_response>\n22C\n</tool_response>" in prompt


def test_max_output_tokens_is_incomplete_and_logprobs(client: openai.OpenAI, fake_engine: FakeEngine,
                                                      http: httpx.Client) -> None:  # fmt: skip
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=3,
                                       reasoning={"effort": "none"})  # fmt: skip
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.max_output_tokens == 3
    body = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 4, "reasoning": {"effort": "none"},
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}  # fmt: skip
    events = stream_events(http, body)
    assert events[-1]["response"]["status"] == "incomplete"
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    logprobs = [entry for event in deltas for entry in event["logprobs"]]
    assert len(logprobs) == 4 and all(len(entry["top_logprobs"]) == 2 for entry in logprobs)
    part = events[-1]["response"]["output"][0]["content"][0]
    # vLLM: a text delta's entries have no bytes, the completed message's do; output_text.done carries none
    assert logprobs == [without_bytes(entry) for entry in part["logprobs"]]
    assert "".join(entry["token"] for entry in part["logprobs"]) == part["text"]
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in part["logprobs"])
    done = next(event for event in events if event["type"] == "response.output_text.done")
    assert done["logprobs"] == [] and done["text"] == part["text"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"previous_response_id": "resp_123"}, 404, "response_id"),
        ({"background": True}, 400, "background"),
        ({"background": True, "store": False}, 400, "background"),
        ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
        ({"tools": [{"type": "web_search_preview"}]}, 400, "tools.0.type"),
        ({"tool_choice": {"type": "file_search"}, "tools": TOOLS}, 400, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400, "input.0.content.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]}, 400, None),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type"),
        ({"input": []}, 400, "input"),
        ({"conversation": "conv_1"}, 400, "conversation"),
        ({"model": "other"}, 404, "model"),
        ({"max_output_tokens": 5000}, 400, "max_tokens"),
        ({"include": ["nothing.real"]}, 400, None),
    ],
)
def test_unsupported_parts_are_refused(http: httpx.Client, body: dict[str, Any], status: int,
                                       param: str | None) -> None:  # fmt: skip
    response = http.post("/v1/responses", json={"model": MODEL_NAME, "input": QUESTION, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param


def test_refusal_raises_in_the_client_and_stored_responses_do_not_exist(client: openai.OpenAI,
                                                                        http: httpx.Client) -> None:  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input=QUESTION, previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, input=QUESTION, tools=[{"type": "web_search_preview"}])
    for response in (http.get("/v1/responses/resp_1"), http.post("/v1/responses/resp_1/cancel")):
        assert response.status_code == 404 and response.json()["error"]["param"] == "response_id"


def test_mid_stream_failure_is_an_error_event(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.fail_after_tokens = 2
    received = []
    with pytest.raises(openai.APIError, match="Internal server error"):
        for event in client.responses.create(model=MODEL_NAME, input=QUESTION, stream=True):
            received.append(event.type)
    assert received[:2] == ["response.created", "response.in_progress"] and "response.completed" not in received


def test_parallel_tool_calls_false_and_text_format(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    second = TOOL_OUTPUT.split("</think>\n\n")[1].replace("Paris", "Rome")
    fake_engine.scripts.append([TOOL_OUTPUT + "\n" + second])
    both = client.responses.create(model=MODEL_NAME, input=QUESTION, tools=TOOLS)
    assert [json.loads(item.arguments)["city"] for item in both.output[1:]] == ["Paris", "Rome"]
    fake_engine.scripts.append([TOOL_OUTPUT + "\n" + second])
    first = client.responses.create(model=MODEL_NAME, input=QUESTION, tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(item.arguments)["city"] for item in first.output[1:]] == ["Paris"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fake_engine.scripts.append(['{"a": 1}'])
    text = {"format": {"type": "json_schema", "name": "a", "schema": schema}}
    reply = client.responses.create(model=MODEL_NAME, input=QUESTION, reasoning={"effort": "none"}, text=text)
    assert reply.output_text == '{"a": 1}' and fake_engine.last_params.structured_outputs.json == schema


def test_the_completed_response_is_the_non_streamed_parse(client: openai.OpenAI, fake_engine: FakeEngine,
                                                          http: httpx.Client) -> None:  # fmt: skip
    """vLLM builds a stream's completed Response again from the whole text: its items have their own ids and the
    non-streamed content rules (qwen3_coder: the text before a call stripped, the text after it dropped), while
    the events follow the streamed parse; the openai client's stream helper takes that Response as final."""
    call = TOOL_OUTPUT.split("</think>\n\n")[1]
    script = "Look.</think>\n\nSure.\n" + call + "\nDone."
    fake_engine.scripts.append([script])
    events = stream_events(http, {"model": MODEL_NAME, "input": QUESTION, "tools": TOOLS})
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == ["reasoning", "message", "function_call", "message"]
    assert [item["content"][0]["text"] for item in done if item["type"] == "message"] == ["\n\nSure.\n", "\nDone."]
    assert done[1]["summary"] == [] and done[1]["content"][0]["logprobs"] is None
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message", "function_call"]
    assert final[1]["content"][0]["text"] == "Sure." and final[2]["arguments"] == done[2]["arguments"]
    assert not {item["id"] for item in final} & {item["id"] for item in done}
    assert final[2]["call_id"] != done[2]["call_id"]
    fake_engine.scripts.append([script])
    with client.responses.stream(model=MODEL_NAME, input=QUESTION, tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        response = stream.get_final_response()
    assert kinds == [event["type"] for event in events]
    assert response.output_text == "Sure." and response.output[-1].call_id.startswith("chatcmpl-tool-")


def test_streamed_logprobs_are_the_text_steps_own(client: openai.OpenAI, fake_engine: FakeEngine,
                                                  http: httpx.Client) -> None:  # fmt: skip
    """vLLM: a text delta carries the logprobs of its engine step's tokens; steps of reasoning or held-back text
    keep none in the stream, while the completed message's logprobs cover every generated token."""
    fake_engine.scripts.append(["Hmm.</think>\n\nHi there!"])
    body = {"model": MODEL_NAME, "input": QUESTION, "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    events = stream_events(http, body)
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert all(len(event["logprobs"]) == 1 for event in deltas)  # one token a step in the FakeEngine
    message = events[-1]["response"]["output"][-1]
    num_output = events[-1]["response"]["usage"]["output_tokens"]
    assert len(message["content"][0]["logprobs"]) == num_output > len(deltas)
    fake_engine.scripts.append(["Hmm.</think>\n\nHi there!"])
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, include=["message.output_text.logprobs"])
    logprobs = response.output[-1].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens and "".join(lp.token for lp in logprobs).startswith("Hmm.")


def test_top_logprobs_list_the_sampled_token_first(client: openai.OpenAI, fake_engine: FakeEngine,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """vLLM takes the first top_logprobs entries of the engine's dict, which holds the sampled token first: a
    token sampled outside the best leads its own top_logprobs."""

    def sampled_third(token_id: int, num_top: int) -> dict[int, Logprob]:
        best, second = (token_id + 1) % 100, (token_id + 2) % 100
        return {token_id: Logprob(-3.0, 3, "t"), best: Logprob(-1.0, 1, "b"), second: Logprob(-2.0, 2, "s")}

    monkeypatch.setattr(fake_engine, "_logprobs", sampled_third)
    fake_engine.scripts.append(["Hi."])
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, reasoning={"effort": "none"},
                                       include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    entry = response.output[0].content[0].logprobs[0]
    assert [(top.token, top.logprob) for top in entry.top_logprobs] == [("t", -3.0), ("b", -1.0)]
    assert entry.bytes == list(b"t")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "required"}, "Tool choice 'required' must be specified with 'tools' parameter."),
        ({"tool_choice": {"type": "function", "name": "get_weather"}},
         "Tool choice 'function' not found in 'tools' parameter."),
        ({"tool_choice": {"type": "function", "name": "other"}, "tools": TOOLS},
         "Tool choice 'function' not found in 'tools' parameter."),
        ({"background": True, "store": False}, "background can only be used when `store` is true"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt template is not supported"),
    ],
)  # fmt: skip
def test_request_checks_in_vllms_words(http: httpx.Client, body: dict[str, Any], message: str) -> None:
    """vLLM's ResponsesRequest validators: a 400 in its validation envelope naming the validator's field."""
    response = http.post("/v1/responses", json={"model": MODEL_NAME, "input": QUESTION, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    param = next(iter(body)) if "tools" not in body else "tool_choice"
    assert error["message"].startswith("1 validation error:") and error["param"] == param
    assert f"{message} (parameter={param})" in error["message"]


def test_include_reasoning_chat_template_kwargs_and_tool_choice_none(client: openai.OpenAI, fake_engine: FakeEngine,
                                                                    http: httpx.Client) -> None:  # fmt: skip
    """vLLM's Responses fields that deltaserve used to drop: include_reasoning=false leaves the reasoning (and the
    logprobs) out, chat_template_kwargs reach the template; tool_choice "none" renders no tools (vLLM's
    construct_tool_dicts) while the Response still echoes them."""
    fake_engine.scripts.append(["Hmm.</think>\n\nHi."])
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, include=["message.output_text.logprobs"],
                                       extra_body={"include_reasoning": False})  # fmt: skip
    assert [item.type for item in response.output] == ["message"] and response.output_text == "\n\nHi."
    assert response.output[0].content[0].logprobs is None
    fake_engine.scripts.append(["Hmm.</think>\n\nHi."])
    body = {"model": MODEL_NAME, "input": QUESTION, "include_reasoning": False,
            "include": ["message.output_text.logprobs"]}  # fmt: skip
    events = stream_events(http, body)
    assert not [event for event in events if "reasoning" in event["type"]]
    assert all(event["logprobs"] == [] for event in events if event["type"] == "response.output_text.delta")
    fake_engine.scripts.append(["Hi."])
    client.responses.create(
        model=MODEL_NAME, input=QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    expected = fake_engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                                         add_generation_prompt=True, enable_thinking=False)  # fmt: skip
    assert fake_engine.tokenizer.decode(fake_engine.last_prompt_ids) == expected
    fake_engine.scripts.append(["Hmm.</think>\n\nNo tools."])
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in fake_engine.tokenizer.decode(fake_engine.last_prompt_ids)
    assert response.tool_choice == "none" and response.tools[0].name == "get_weather"


def test_a_server_without_parsers_always_answers_a_message() -> None:
    """vLLM's fallback without a reasoning or tool parser: one message, with no content part when nothing was
    generated (with parsers, empty text makes no item)."""
    (message,) = output_items("", "", [], None, is_parsed=False)
    assert message["type"] == "message" and message["content"] == [] and message["status"] == "completed"
    assert re.fullmatch("msg_[0-9a-f]{16}", message["id"]) and output_items("", "", [], None) == []


def test_function_call_arguments_stream_as_vllms(fake_engine: FakeEngine, http: httpx.Client) -> None:
    """The function_call_arguments.delta events are the chat stream's argument deltas (vLLM's Responses stream runs
    the same parse_delta), replayed through vLLM 0.26's qwen3_coder chain: a string value token by token."""
    fake_engine.scripts.append([TOOL_OUTPUT])
    events = stream_events(http, {"model": MODEL_NAME, "input": QUESTION, "tools": TOOLS})
    deltas = [event["delta"] for event in events if event["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"city": "', "P", "ar", "is", '", "days": ', "2}"]


def test_a_call_written_under_tool_choice_none_is_dropped(client: openai.OpenAI, fake_engine: FakeEngine,
                                                          http: httpx.Client) -> None:  # fmt: skip
    """vLLM 0.26 parses the output under tool_choice "none" too and drops the call: with tools, the text around it
    is the message as generated; without tools, as under "auto" (the text after the call dropped)."""
    output = "Sure.\n" + TOOL_OUTPUT.split("</think>\n\n")[1] + "\nDone."
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    fake_engine.scripts.append([output])
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, tools=TOOLS, tool_choice="none",
                                       extra_body=no_thinking)  # fmt: skip
    assert [item.type for item in response.output] == ["message"] and response.output_text == "Sure.\n\nDone."
    fake_engine.scripts.append([output])
    events = stream_events(http, {"model": MODEL_NAME, "input": QUESTION, "tools": TOOLS, "tool_choice": "none",
                                  **no_thinking})  # fmt: skip
    assert not [event for event in events if "function_call" in event["type"]]
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert text == "Sure.\n\nDone." and strict(events[-1]["response"]).output_text == "Sure.\n\nDone."
    fake_engine.scripts.append([output])
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, extra_body=no_thinking)
    assert [item.type for item in response.output] == ["message"] and response.output_text == "Sure."
