"""/v1/completions against the FakeEngine, driven by the official openai client (and raw SSE where it matters)."""

from __future__ import annotations

import json

import httpx
import openai

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine


def sse_events(response: httpx.Response) -> list[str]:
    """The data payloads of an SSE body, in order (the last one is [DONE])."""
    return [line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")]


def test_default_max_tokens_is_16_and_usage(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello there")
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.model == MODEL_NAME
    (choice,) = completion.choices
    assert choice.finish_reason == "length" and choice.text.startswith(" the quick")
    num_prompt = len(fake_engine.tokenizer.encode("Hello there"))
    assert completion.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 16,
        "total_tokens": num_prompt + 16,
    }
    # an explicit null is the default too, not the rest of the context (vLLM's normalize_null_max_tokens)
    nulled = client.completions.create(model=MODEL_NAME, prompt="Hello there", extra_body={"max_tokens": None})
    assert nulled.usage.completion_tokens == 16


def test_batch_prompts_and_n_index_choices(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.extend([["a0", "a1"], ["b0", "b1"]])
    completion = client.completions.create(model=MODEL_NAME, prompt=["first", "second"], n=2, max_tokens=5)
    texts = {choice.index: choice.text for choice in completion.choices}
    assert texts == {0: "a0", 1: "a1", 2: "b0", 3: "b1"}
    assert all(choice.finish_reason == "stop" for choice in completion.choices)
    encode = fake_engine.tokenizer.encode
    assert completion.usage.prompt_tokens == len(encode("first")) + len(encode("second"))
    num_generated = sum(len(encode(text)) + 1 for text in ("a0", "a1", "b0", "b1"))  # + eos each
    assert completion.usage.completion_tokens == num_generated


def test_token_id_prompts(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    completion = client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=2)
    assert fake_engine.last_prompt_ids == [1, 2, 3] and completion.usage.prompt_tokens == 3
    completion = client.completions.create(model=MODEL_NAME, prompt=[[5, 6], [7]], max_tokens=2)
    assert len(completion.choices) == 2 and completion.usage.prompt_tokens == 3


def test_fields_not_asked_for_are_null_not_absent(client: openai.OpenAI, http: httpx.Client) -> None:
    """vLLM's test_single_completion reads choices[0].prompt_logprobs (None): its choice model is sent whole."""
    completion = client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=2)
    choice = completion.choices[0]
    assert choice.prompt_logprobs is None and choice.token_ids is None and choice.prompt_token_ids is None
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "return_token_ids": True, "prompt_logprobs": 0}
    asked = http.post("/v1/completions", json=body).json()["choices"][0]
    assert asked["prompt_token_ids"] == [1, 2, 3] and len(asked["token_ids"]) == 2
    assert len(asked["prompt_logprobs"]) == 3


def test_missing_or_empty_prompt_is_refused_in_vllms_words(http: httpx.Client) -> None:
    """vLLM's test_prompt_validation and test_empty_prompt_list: no prompt, "" or [] is one 400 naming prompt."""
    for body in ({}, {"prompt": None, "prompt_embeds": []}, {"prompt": ""}, {"prompt": []}):
        response = http.post("/v1/completions", json={"max_tokens": 1, **body})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "prompt", body
        assert error["message"] == "Either prompt or prompt_embeds must be provided and non-empty.", body


def test_echo_stop_and_include_stop(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["one two three four"])
    completion = client.completions.create(model=MODEL_NAME, prompt="Count:", echo=True, stop=[" three"])
    choice = completion.choices[0]
    assert choice.text == "Count:one two" and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == " three"
    fake_engine.scripts.append(["one two three four"])
    completion = client.completions.create(
        model=MODEL_NAME, prompt="x", stop=" three", extra_body={"include_stop_str_in_output": True}
    )
    assert completion.choices[0].text == "one two three"


def test_logprobs(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Hello world"])
    completion = client.completions.create(model=MODEL_NAME, prompt="x", logprobs=2, max_tokens=3)
    logprobs = completion.choices[0].logprobs
    num = len(logprobs.tokens)
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == num
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])
    assert logprobs.token_logprobs[0] == -0.25


def test_stream_chunks_usage_and_done(http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["Hello world"])
    body = {"model": MODEL_NAME, "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert all(chunk["choices"] for chunk in chunks[:-1]), "no choice-less chunk before the usage chunk"
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks[:-1]) == "Hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(chunks) - 1


def test_stream_without_stream_options_has_no_usage_and_continuous_usage(http: httpx.Client) -> None:
    events = sse_events(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}))
    chunks = [json.loads(event) for event in events[:-1]]
    assert len(chunks) == 3 and all("usage" not in chunk for chunk in chunks)
    body = {"prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    chunks = [json.loads(event) for event in sse_events(http.post("/v1/completions", json=body))[:-1]]
    assert len(chunks) == 3 and all("usage" not in chunk for chunk in chunks), "continuous stats need include_usage"
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [json.loads(event) for event in sse_events(http.post("/v1/completions", json=body))[:-1]]
    assert [chunk["usage"]["completion_tokens"] for chunk in chunks] == [1, 2, 3, 3]


def test_openai_streaming_with_n(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.scripts.append(["alpha", "beta"])
    stream = client.completions.create(
        model=MODEL_NAME, prompt="x", n=2, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == {0: "alpha", 1: "beta"} and usage is not None and usage.completion_tokens > 2


def test_sampling_defaults_and_extensions_reach_the_engine(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.default_sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    client.completions.create(
        model=MODEL_NAME,
        prompt="x",
        max_tokens=4,
        top_p=0.5,
        seed=7,
        extra_body={"min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2, "unknown": 1},
    )
    params = fake_engine.last_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.5, 20, 0.1)
    assert (params.repetition_penalty, params.seed, params.ignore_eos, params.min_tokens) == (1.1, 7, True, 2)
    assert params.max_tokens == 4


def test_request_id_header_names_the_response(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "abc"})
    assert response.json()["id"] == "cmpl-abc"


def test_generation_config_max_tokens_caps_requests(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.default_sampling = {"max_tokens": 5}
    completion = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=100)
    assert fake_engine.last_params.max_tokens == 5 and completion.usage.completion_tokens == 5
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    assert fake_engine.last_params.max_tokens == 5
