"""POST /v1/chat/completions/batch (vLLM's batched chat) on the real engine serving the trained tiny dense checkpoint.

Its choices equal separate /v1/chat/completions calls token for token at temperature 0 (logprobs included), usage
sums over the conversations and each conversation counts as a request in the metrics; what the batch cannot carry
(streaming, tools, n > 1, beam search) and malformed `messages` are 400s in vLLM's words; one conversation too long
for the context fails the whole request before anything runs; a failing conversation cancels the rest, whose
cleanup has run when the request fails. The disconnect case (every conversation aborted) is in
test_api_disconnect.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deltaserve.api.serving_chat_batch import gather_all
from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine_config import EngineConfig
from deltaserve.tiny.trained import trained_model_dir

from .server_thread import MODEL_NAME, serve

MAX_MODEL_LEN = 256
CONVERSATIONS = [
    [{"role": "user", "content": "The river ran"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the weather today."}],
    [{"role": "user", "content": "Once"}, {"role": "assistant", "content": "upon a time"},
     {"role": "user", "content": "go on"}],
]  # fmt: skip
BATCH_PATH = "/v1/chat/completions/batch"


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """A client of the real engine on the trained tiny dense checkpoint, with vLLM's Qwen3.5 reasoning parser."""
    config = EngineConfig(model=str(trained_model_dir("dense")), device="cpu", dtype="float32",
                          max_model_len=MAX_MODEL_LEN, max_num_seqs=4)  # fmt: skip
    server = serve(AsyncEngine.from_config(config, multiprocess=False), reasoning_parser="qwen3")
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            yield client
    finally:
        server.stop()


def num_requests_finished(client: httpx.Client) -> float:
    """vllm:request_success_total summed over its finished_reason labels."""
    lines = client.get("/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total{"))


def single(client: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def batch(client: httpx.Client, conversations: list[Any], **fields: Any) -> httpx.Response:
    return client.post(BATCH_PATH, json={"model": MODEL_NAME, "messages": conversations, **fields})


def test_choices_equal_separate_chat_completions(http: httpx.Client) -> None:
    fields = {"temperature": 0, "max_tokens": 6, "return_token_ids": True}
    alone = [single(http, messages, **fields) for messages in CONVERSATIONS]
    num_finished = num_requests_finished(http)
    response = batch(http, CONVERSATIONS, **fields)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL_NAME and body["id"].startswith("chatcmpl-")
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    for choice, reply in zip(body["choices"], alone, strict=True):
        (expected,) = reply["choices"]
        assert choice["token_ids"] == expected["token_ids"] and len(choice["token_ids"]) > 0
        assert choice["message"] == expected["message"]
        assert (choice["finish_reason"], choice["stop_reason"]) == (expected["finish_reason"], expected["stop_reason"])
        assert choice["logprobs"] is None
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(reply["usage"][key] for reply in alone)
    # each conversation is one engine request, as vLLM counts it
    assert num_requests_finished(http) == num_finished + len(CONVERSATIONS)


def test_logprobs_equal_separate_chat_completions(http: httpx.Client) -> None:
    fields = {"temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}
    alone = [single(http, messages, **fields)["choices"][0]["logprobs"] for messages in CONVERSATIONS[:2]]
    response = batch(http, CONVERSATIONS[:2], **fields)
    assert response.status_code == 200, response.text
    logprobs = [choice["logprobs"] for choice in response.json()["choices"]]
    for got, expected in zip(logprobs, alone, strict=True):
        assert [entry["token"] for entry in got["content"]] == [entry["token"] for entry in expected["content"]]
        assert all(len(entry["top_logprobs"]) == 3 for entry in got["content"])
        for entry, want in zip(got["content"], expected["content"], strict=True):
            # the same tokens, bytes and top-3 ranking; the values to fp32 rounding (one batch of N rows is not
            # N batches of one: the matmuls sum in another order)
            assert entry["bytes"] == want["bytes"] and entry["logprob"] == pytest.approx(want["logprob"], abs=1e-5)
            assert [top["token"] for top in entry["top_logprobs"]] == [top["token"] for top in want["top_logprobs"]]
            got_values = [top["logprob"] for top in entry["top_logprobs"]]
            assert got_values == pytest.approx([top["logprob"] for top in want["top_logprobs"]], abs=1e-5)


@pytest.mark.parametrize(
    ("fields", "message", "loc"),
    [
        ({"stream": True}, "Batch chat completions do not support streaming. Please set `stream` to False.", "body"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]},
         "Batch chat completions do not support tool use. Please omit `tools`.", "body"),
        ({"n": 2}, "Batch chat completions do not support `n > 1`. Please set `n` to 1.", "body"),
        ({"use_beam_search": True},
         "Batch chat completions do not support beam search. Please set `use_beam_search` to False.", "body"),
        ({"logprob_token_ids": [1]}, "when using `logprob_token_ids`, `logprobs` must be set to true.", "body"),
        ({"messages": []}, "List should have at least 1 item after validation, not 0", "body.messages"),
        ({"messages": [CONVERSATIONS[0], []]}, "List should have at least 1 item after validation, not 0",
         "body.messages.1"),
        ({"tool_choice": "auto"}, "Input should be 'none'", "body.tool_choice"),
    ],
    ids=["stream", "tools", "n", "beam-search", "logprob-token-ids", "no-conversation", "empty-conversation",
         "tool-choice"],
)  # fmt: skip
def test_refusals_in_vllm_words(http: httpx.Client, fields: dict[str, Any], message: str, loc: str) -> None:
    response = http.post(BATCH_PATH, json={"model": MODEL_NAME, "messages": CONVERSATIONS, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == loc
    assert message in error["message"] and f"'loc': '{loc}'" in error["message"]


def test_single_endpoint_checks_apply(http: httpx.Client) -> None:
    """A field the chat endpoint refuses is refused here in its words; a null one is left out, as vLLM's batch
    drops nulls before it builds each chat request."""
    response = batch(http, CONVERSATIONS, top_logprobs=2)
    assert response.status_code == 400
    error = response.json()["error"]  # vLLM's chat request model refuses it in its validator, naming the field
    assert "Value error, when using `top_logprobs`, `logprobs` must be set to true." in error["message"]
    assert error["param"] == "top_logprobs"
    assert batch(http, CONVERSATIONS[:1], n=None, max_tokens=1, temperature=None).status_code == 200


def test_echo_as_the_chat_endpoint(http: httpx.Client) -> None:
    """`echo` prepends only an assistant turn that the answer continues (the chat endpoint's rule, and vLLM's batch
    since its echo fix), never a final user message."""
    continued = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}]
    fields = {"temperature": 0, "max_tokens": 3, "echo": True}
    response = batch(http, [continued], add_generation_prompt=False, continue_final_message=True, **fields)
    assert response.status_code == 200, response.text
    reply = single(http, continued, add_generation_prompt=False, continue_final_message=True, **fields)
    content = response.json()["choices"][0]["message"]["content"]
    assert content.startswith("one, two,") and content == reply["choices"][0]["message"]["content"]
    response = batch(http, CONVERSATIONS[:1], **fields)
    assert response.json()["choices"][0]["message"] == single(http, CONVERSATIONS[0], **fields)["choices"][0]["message"]


def test_many_conversations_are_validated_whole(http: httpx.Client) -> None:
    """More conversations than body.py validates at once is no 500 (the per-message path is for list[ChatMessage])."""
    response = batch(http, [CONVERSATIONS[0]] * 300, n=2)
    assert response.status_code == 400
    assert "Please set `n` to 1." in response.json()["error"]["message"]


def test_one_conversation_over_the_context_fails_the_request(http: httpx.Client) -> None:
    """The failing conversation's own 400 (as the chat endpoint gives it) for the whole request, and nothing runs."""
    too_long = [{"role": "user", "content": "word " * (2 * MAX_MODEL_LEN)}]
    alone = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": too_long, "max_tokens": 4})
    assert alone.status_code == 400
    num_finished = num_requests_finished(http)
    response = batch(http, [CONVERSATIONS[0], too_long, CONVERSATIONS[1]], max_tokens=4)
    assert response.status_code == 400 and response.json()["error"] == alone.json()["error"]
    # a prompt that fits, but not with max_tokens: the second conversation (the longer prompt) alone is over
    lengths = [http.post("/tokenize", json={"messages": m}).json()["count"] for m in CONVERSATIONS[:2]]
    assert lengths[0] < lengths[1]
    max_tokens = MAX_MODEL_LEN - lengths[1] + 1
    single(http, CONVERSATIONS[0], max_tokens=1)  # the first fits (a short answer keeps this test fast)
    num_finished = num_requests_finished(http)
    over = http.post("/v1/chat/completions", json={"messages": CONVERSATIONS[1], "max_tokens": max_tokens})
    response = batch(http, CONVERSATIONS[:2], max_tokens=max_tokens)
    assert over.status_code == response.status_code == 400
    assert response.json()["error"] == over.json()["error"]
    assert num_requests_finished(http) == num_finished  # nothing ran: every conversation is checked before any runs


def test_gather_all_cleans_up_the_rest_before_it_raises() -> None:
    """One conversation failing (or the handler being cancelled by a disconnect) cancels the others, and their
    cleanup (the engine abort) has run when gather_all raises."""
    cleaned: list[int] = []

    async def runs(index: int) -> int:
        try:
            await asyncio.sleep(60)
            return index
        finally:
            await asyncio.sleep(0.01)  # an abort awaits the engine
            cleaned.append(index)

    async def fails() -> int:
        await asyncio.sleep(0.01)
        raise RuntimeError("conversation failed")

    async def failing() -> None:
        with pytest.raises(RuntimeError, match="conversation failed"):
            await gather_all([runs(0), fails(), runs(2)])
        assert sorted(cleaned) == [0, 2]

    async def cancelled() -> None:
        cleaned.clear()
        task = asyncio.ensure_future(gather_all([runs(0), runs(1)]))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(cleaned) == [0, 1]

    asyncio.run(failing())
    asyncio.run(cancelled())
