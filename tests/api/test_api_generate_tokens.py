"""POST /inference/v1/generate, vLLM 0.26's tokens-in, tokens-out route: its body and reply shapes (read off
vllm/entrypoints/scale_out/token_in_token_out/{protocol,serving}.py), its defaults and refusals against the FakeEngine,
and the tokens a real engine gives through it: those /v1/completions gives for the same token ids."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaserve.engine.request import Logprob

from .fake_engine import FakeEngine
from .server_thread import MODEL_NAME, ServerThread, serve
from .test_api_completions import sse_events

ROUTE = "/inference/v1/generate"
PROMPT = [85, 251, 578, 389, 279, 785]
CHOICE_KEYS = ["index", "logprobs", "finish_reason", "token_ids", "routed_experts"]
BODY_KEYS = ["request_id", "model", "created", "choices", "usage", "prompt_logprobs", "kv_transfer_params",
             "ec_transfer_params"]  # fmt: skip


def events(response: httpx.Response) -> list[dict[str, Any]]:
    found = sse_events(response)
    assert found[-1] == "[DONE]"
    return [json.loads(event) for event in found[:-1]]


def test_the_body_is_vllms_generate_response(http: httpx.Client, fake_engine: FakeEngine) -> None:
    reply = http.post(ROUTE, json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}},
                      headers={"x-request-id": "abc"})  # fmt: skip
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert list(body) == BODY_KEYS and body["request_id"] == "generate-tokens-abc" and body["model"] == MODEL_NAME
    (choice,) = body["choices"]
    assert list(choice) == CHOICE_KEYS and len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None and body["prompt_logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 9, "completion_tokens": 3,
                             "prompt_tokens_details": None}  # fmt: skip
    # the body's request_id when no header gives one; the generation_config defaults do not apply to the rest
    assert http.post(ROUTE, json={"token_ids": PROMPT, "request_id": "mine"}).json()["request_id"] == (
        "generate-tokens-mine"
    )  # fmt: skip


def test_an_unset_max_tokens_is_the_rest_of_the_context(http: httpx.Client, fake_engine: FakeEngine) -> None:
    http.post(ROUTE, json={"token_ids": PROMPT, "sampling_params": {"temperature": 0.0}})
    assert fake_engine.last_params is not None
    assert fake_engine.last_params.max_tokens == fake_engine.max_model_len - len(PROMPT)
    assert fake_engine.last_params.temperature == 0.0
    http.post(ROUTE, json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "stop_token_ids": [5],
                                                                   "structured_outputs": {"regex": "a+"}}})  # fmt: skip
    params = fake_engine.last_params
    assert params.max_tokens == 2 and params.stop_token_ids == [5] and params.structured_outputs.regex == "a+"


def test_a_constraint_waits_for_the_end_of_an_open_thinking_block(fake_engine: FakeEngine) -> None:
    """With a reasoning parser, as chat does (and vLLM's engine on every route): a prompt whose last <think> is
    open gets its constraint after </think>; a closed or absent block constrains from the first token."""
    server = serve(fake_engine, reasoning_parser="qwen3")
    try:
        tokenizer = fake_engine.tokenizer
        start, end = tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")
        sampling = {"max_tokens": 1, "structured_outputs": {"regex": "a+"}}
        for prompt, expected in (([*PROMPT, start], end), ([*PROMPT, start, 5, end], None), (PROMPT, None)):
            reply = httpx.post(server.base_url + ROUTE, json={"token_ids": prompt, "sampling_params": sampling})
            assert reply.status_code == 200, reply.text
            assert fake_engine.last_params.structured_outputs.start_after_token_id == expected
    finally:
        server.stop()


def test_logprobs_name_tokens_by_id(http: httpx.Client) -> None:
    sampling = {"max_tokens": 2, "logprobs": 2, "temperature": 0.0}
    (choice,) = http.post(ROUTE, json={"token_ids": PROMPT, "sampling_params": sampling}).json()["choices"]
    content = choice["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    for entry in content:
        assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"] and entry["bytes"] is None
        # the sampled token's entry first, then the top ones, max(logprobs, 1) in all (vLLM's count)
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]


def test_the_stream_sends_new_tokens_and_a_usage_chunk(http: httpx.Client) -> None:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "n": 2}, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = events(http.post(ROUTE, json=body))
    *tokens, last = chunks
    assert all(list(chunk) == ["request_id", "choices", "usage"] and chunk["usage"] is None for chunk in tokens)
    assert all(len(chunk["choices"]) == 1 and chunk["choices"][0]["token_ids"] for chunk in tokens)
    per_choice = {0: [], 1: []}
    for chunk in tokens:
        per_choice[chunk["choices"][0]["index"]] += chunk["choices"][0]["token_ids"]
    assert [len(ids) for ids in per_choice.values()] == [3, 3]
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 6, "total_tokens": 12, "completion_tokens": 6}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [-1]}, "token_ids"),
        ({"token_ids": [10**9]}, "token_ids"),
        ({"token_ids": PROMPT, "sampling_params": {"temperature": -1.0}}, "temperature"),
        ({"token_ids": PROMPT, "sampling_params": {"n": 0}}, "n"),
        ({"token_ids": PROMPT, "features": {"mm_hashes": {}, "mm_placeholders": {}}}, "features"),
        ({"token_ids": PROMPT, "model": "other"}, None),
    ],
)
def test_bad_bodies_get_vllms_error_envelope(http: httpx.Client, body: dict[str, Any], param: str | None) -> None:
    reply = http.post(ROUTE, json=body)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["code"] == reply.status_code and error["message"]
    if param is not None and reply.status_code == 400:
        assert param in (error.get("param") or "") + error["message"]


def test_unknown_sampling_keys_are_logged(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    reply = http.post(ROUTE, json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "no_such_key": 1}})
    assert reply.status_code == 200
    assert any("no_such_key" in record.getMessage() for record in caplog.records)


def test_token_logprobs_follow_vllms_quirks() -> None:
    from deltaserve.api.serving_generate import token_logprobs

    step = {7: Logprob(-0.5, 1), 3: Logprob(-1.5, 2), 9: Logprob(float("-inf"), 3)}
    every = token_logprobs([7], [step], -1)  # -1 (every token) still lists max(-1, 1) = 1 entry, as vLLM's
    entry = {"token": "token_id:7", "logprob": -0.5, "bytes": None}
    assert every == {"content": [{**entry, "top_logprobs": [entry]}]}
    three = token_logprobs([7], [step], 3)["content"][0]["top_logprobs"]
    assert [entry["logprob"] for entry in three] == [-0.5, -1.5, -9999.0]  # -inf floored, as vLLM's JSON
    assert token_logprobs([4], [step], 1)["content"][0] == {"token": "token_id:4", "logprob": -9999.0, "bytes": None,
                                                           "top_logprobs": []}  # fmt: skip
    assert token_logprobs([7], [step], None) is None


# -- a real engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_server(tiny_dense: Path) -> Iterator[ServerThread]:
    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.engine_config import EngineConfig

    config = EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=256, max_num_seqs=4)
    server = serve(AsyncEngine.from_config(config), enable_prompt_tokens_details=True, disable_log_stats=True)
    yield server
    server.stop()


def test_the_tokens_are_the_completions_tokens(real_server: ServerThread) -> None:
    url = real_server.base_url
    request = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True, "logprobs": 1}
    completion = httpx.post(url + "/v1/completions", json=request, timeout=60)
    expected = completion.json()["choices"][0]
    sampling = {"max_tokens": 8, "temperature": 0.0, "logprobs": 1, "prompt_logprobs": 1}
    body = httpx.post(url + ROUTE, json={"token_ids": PROMPT, "sampling_params": sampling}, timeout=60).json()
    (choice,) = body["choices"]
    assert choice["token_ids"] == expected["token_ids"] and choice["finish_reason"] == expected["finish_reason"]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert logprobs == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-6)
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(PROMPT)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None,
                                                      "multimodal_tokens": None}  # fmt: skip
    streamed = events(httpx.post(url + ROUTE, json={"token_ids": PROMPT, "stream": True,
                                                    "sampling_params": {"max_tokens": 8, "temperature": 0.0}},
                                 timeout=60))  # fmt: skip
    assert [t for chunk in streamed for t in chunk["choices"][0]["token_ids"]] == expected["token_ids"]


# -- the render routes -------------------------------------------------------------------------------------------

RENDER_KEYS = ["request_id", "token_ids", "assistant_tokens_mask", "token_offsets", "features", "sampling_params",
               "model", "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params",
               "ec_transfer_params"]  # fmt: skip


def test_sampling_json_is_vllms_omit_defaults_form() -> None:
    from deltaserve.api.serving_render import sampling_json
    from deltaserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    # skip_reading_prefix_cache is set by __post_init__ (None -> False), so it differs from its default, as in vLLM
    assert sampling_json(SamplingParams()) == {"skip_reading_prefix_cache": False}
    params = SamplingParams(temperature=0.0, max_tokens=7, output_kind=RequestOutputKind.DELTA,
                            structured_outputs=StructuredOutputsParams(regex="a+"), bad_words=["x"])  # fmt: skip
    params.bad_words_token_ids = [[5]]  # the engine's, private in vLLM: never rendered
    found = sampling_json(params)
    assert found["temperature"] == 0.0 and found["max_tokens"] == 7 and found["output_kind"] == 1
    assert found["bad_words"] == ["x"] and "bad_words_token_ids" not in found
    assert found["structured_outputs"]["regex"] == "a+" and "start_after_token_id" not in found["structured_outputs"]


def test_chat_render_is_what_the_chat_route_would_submit(http: httpx.Client, fake_engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = http.post("/v1/chat/completions/render", json={"messages": messages, "max_tokens": 5, "seed": 3,
                                                              "stream": True, "cache_salt": "s"})  # fmt: skip
    assert rendered.status_code == 200, rendered.text
    body = rendered.json()
    assert list(body) == RENDER_KEYS and body["request_id"].startswith("chatcmpl-")
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert body["token_ids"] == tokens
    assert body["sampling_params"]["max_tokens"] == 5 and body["sampling_params"]["seed"] == 3
    assert (body["stream"], body["stream_options"], body["cache_salt"], body["features"]) == (True, None, "s", None)
    # the chat route submits the same SamplingParams
    http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "seed": 3})
    from deltaserve.api.serving_render import sampling_json

    assert sampling_json(fake_engine.last_params) == body["sampling_params"]
    assert fake_engine.last_prompt_ids == tokens
    beam = http.post("/v1/chat/completions/render", json={"messages": messages, "use_beam_search": True})
    assert beam.status_code == 400 and "not supported by the render endpoint" in beam.json()["error"]["message"]


def test_completion_render_lists_one_request_per_prompt(http: httpx.Client) -> None:
    rendered = http.post("/v1/completions/render", json={"prompt": [[1, 2], [5, 6, 7]], "max_tokens": 3})
    assert rendered.status_code == 200, rendered.text
    first, second = rendered.json()
    assert list(first) == RENDER_KEYS and first["request_id"].startswith("cmpl-")
    assert (first["token_ids"], second["token_ids"]) == ([1, 2], [5, 6, 7])
    assert first["sampling_params"]["max_tokens"] == 3
    bad = http.post("/v1/completions/render", json={"prompt": "x", "max_tokens": 10**6})
    assert bad.status_code == 400  # the completions route's own length check


def test_render_then_generate_gives_the_chat_routes_tokens(real_server: ServerThread) -> None:
    url = real_server.base_url
    request = {"messages": [{"role": "user", "content": "The cat sat on the mat"}], "max_tokens": 6,
               "temperature": 0.0}  # fmt: skip
    rendered = httpx.post(url + "/v1/chat/completions/render", json=request, timeout=60).json()
    generated = httpx.post(url + ROUTE, json=rendered, timeout=60).json()["choices"][0]["token_ids"]
    chat = httpx.post(url + "/v1/chat/completions", json={**request, "return_token_ids": True}, timeout=60).json()
    assert generated == chat["choices"][0]["token_ids"] and len(generated) == 6


# -- the derender routes -----------------------------------------------------------------------------------------


def test_chat_derender_without_a_request_decodes_plainly(http: httpx.Client, fake_engine: FakeEngine) -> None:
    tokenizer = fake_engine.tokenizer
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    entries = [
        {"token": f"token_id:{t}", "logprob": -0.5, "top_logprobs": [{"token": f"token_id:{t}", "logprob": -0.5}]}
        for t in ids
    ]
    choice = {"index": 0, "token_ids": ids, "finish_reason": "length", "logprobs": {"content": entries}}
    gen = {"request_id": "gen-1", "choices": [choice]}
    reply = http.post("/v1/chat/completions/derender", json={"model": MODEL_NAME, "generate_response": gen,
                                                             "prompt_tokens": 4})  # fmt: skip
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert list(body) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                          "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                          "ec_transfer_params", "metrics"]  # fmt: skip
    expected_usage = {"prompt_tokens": 4, "total_tokens": 4 + len(ids), "completion_tokens": len(ids),
                      "prompt_tokens_details": None}  # fmt: skip
    assert body["id"] == "gen-1" and body["usage"] == expected_usage
    (choice,) = body["choices"]
    assert choice["message"]["content"] == "Hello there" and choice["finish_reason"] == "length"
    names = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert "".join(names) == "Hello there"  # each placeholder named by its text again
    first = choice["logprobs"]["content"][0]
    assert first["bytes"] == list(first["token"].encode()) and first["top_logprobs"][0]["token"] == first["token"]


def test_chat_derender_parses_reasoning_as_the_chat_route(fake_engine: FakeEngine) -> None:
    server = serve(fake_engine, reasoning_parser="qwen3")
    try:
        tokenizer = fake_engine.tokenizer
        ids = tokenizer.encode("Let me think.</think>\n\nParis.", add_special_tokens=False)
        chat_request = {"messages": [{"role": "user", "content": "Capital of France?"}]}
        gen = {"choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop"}]}
        body = {"model": MODEL_NAME, "generate_response": gen, "chat_request": chat_request}
        message = httpx.post(server.base_url + "/v1/chat/completions/derender", json=body).json()["choices"][0][
            "message"
        ]  # fmt: skip
        # the tiny template opens a thinking block: the text before </think> is the reasoning
        assert (message["reasoning"], message["content"]) == ("Let me think.", "\n\nParis.")  # the chat route's split
        without = httpx.post(server.base_url + "/v1/chat/completions/derender", json={**body, "chat_request": None})
        assert without.json()["choices"][0]["message"]["reasoning"] is None  # no request: no parsing, as vLLM's
    finally:
        server.stop()


def test_derender_checks_vllms_bounds(http: httpx.Client, fake_engine: FakeEngine) -> None:
    route = "/v1/chat/completions/derender"
    empty = {"model": MODEL_NAME, "generate_response": {"choices": [{"index": 0, "token_ids": []}]}}
    assert "has empty or null token_ids" in http.post(route, json=empty).json()["error"]["message"]
    too_many = [5] * (fake_engine.max_model_len + 1)
    long = {"model": MODEL_NAME, "generate_response": {"choices": [{"index": 0, "token_ids": too_many}]}}
    assert "exceeds max_model_len" in http.post(route, json=long).json()["error"]["message"]
    assert http.post(route, json={**empty, "model": "other"}).status_code == 404
    mismatch = {"model": MODEL_NAME, "generate_responses": [{"choices": [{"index": 0, "token_ids": [5]}]}],
                "prompt_tokens": [1, 2]}  # fmt: skip
    reply = http.post("/v1/completions/derender", json=mismatch)
    assert reply.status_code == 400 and "must equal generate_responses length" in reply.json()["error"]["message"]


def test_completion_derender_numbers_choices_across_responses(http: httpx.Client, fake_engine: FakeEngine) -> None:
    ids = fake_engine.tokenizer.encode(" the quick", add_special_tokens=False)
    entries = [{"token": f"token_id:{t}", "logprob": -1.0, "top_logprobs": []} for t in ids]
    first_choice = {"index": 0, "token_ids": ids, "finish_reason": "length", "logprobs": {"content": entries}}
    one = {"request_id": "a", "choices": [first_choice]}
    two = {"request_id": "b", "choices": [{"index": 0, "token_ids": ids[:1]}, {"index": 1, "token_ids": ids[1:]}]}
    reply = http.post("/v1/completions/derender", json={"model": MODEL_NAME, "generate_responses": [one, two],
                                                        "prompt_tokens": [3, 4]})  # fmt: skip
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"] == "a" and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["choices"][0]["text"] == " the quick" and body["usage"]["prompt_tokens"] == 7
    logprobs = body["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == " the quick" and logprobs["top_logprobs"] == [None] * len(ids)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][-1] == len(" the quick") - len(
        logprobs["tokens"][-1]
    )


def test_render_generate_derender_gives_the_chat_routes_message(real_server: ServerThread) -> None:
    url = real_server.base_url
    request = {"messages": [{"role": "user", "content": "Tell me about the mat"}], "max_tokens": 8,
               "temperature": 0.0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    rendered = httpx.post(url + "/v1/chat/completions/render", json=request, timeout=60).json()
    generated = httpx.post(url + ROUTE, json=rendered, timeout=60).json()
    derendered = httpx.post(url + "/v1/chat/completions/derender", json={
        "model": MODEL_NAME, "generate_response": generated, "prompt_tokens": len(rendered["token_ids"]),
        "chat_request": request}, timeout=60).json()  # fmt: skip
    chat = httpx.post(url + "/v1/chat/completions", json=request, timeout=60).json()
    assert derendered["choices"][0]["message"] == chat["choices"][0]["message"]
    # vLLM's derender reports no prompt_tokens_details, whatever the server's flag
    assert derendered["usage"] == {**chat["usage"], "prompt_tokens_details": None}
    ours = derendered["choices"][0]["logprobs"]["content"]
    theirs = chat["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in ours] == [entry["token"] for entry in theirs]
    assert [entry["logprob"] for entry in ours] == pytest.approx([entry["logprob"] for entry in theirs], abs=1e-6)


def test_a_split_character_is_named_with_its_context(fake_engine: FakeEngine) -> None:
    """A token that decodes to part of a UTF-8 character is named by what it adds with up to four tokens before it
    (vLLM's correction); the pieces before the last add nothing on their own."""
    from deltaserve.api.serving_derender import Logprobs, TokenNames

    tokenizer = fake_engine.tokenizer
    ids = tokenizer.encode("\u2603", add_special_tokens=False)
    assert len(ids) > 1  # the tiny byte-level vocabulary splits the snowman's three bytes
    names = TokenNames(tokenizer, len(tokenizer))
    logprobs = Logprobs.model_validate({"content": [{"token": f"token_id:{t}", "logprob": -1.0} for t in ids]})
    tokens = [entry["token"] for entry in names.chat_logprobs(logprobs)["content"]]
    assert "".join(tokens) == "\u2603" and tokens[-1].endswith("\u2603")
    assert names.text("not-a-placeholder", []) == ("not-a-placeholder", None)
    assert names.text("token_id:999999999", []) == ("", None)  # outside the vocabulary: empty, as vLLM's
