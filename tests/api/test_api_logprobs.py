"""vLLM's -1 logprobs counts through the `openai` client: `--max-logprobs -1` lifts the cap to the vocabulary, and a
request's `top_logprobs: -1` / `prompt_logprobs: -1` asks for the whole vocabulary at every position.

The real engine serves the trained tiny dense checkpoint (vocabulary 1,344) with max_logprobs=-1, so a whole
vocabulary per position is cheap; the FakeEngine server (the default cap of 20) checks the refusals and their words,
which are vLLM's: the protocol layer's for values below -1, the engine's "Requested ... logprobs of N, which is
greater than max allowed: M" (N the resolved count) above the cap.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from deltaserve.config import ModelConfig
from deltaserve.engine_config import EngineConfig
from deltaserve.tiny.trained import trained_model_dir

from .fake_engine import FakeEngine
from .server_thread import serve

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def vocab_size() -> int:
    return ModelConfig.from_pretrained(trained_model_dir("dense")).vocab_size


@pytest.fixture(scope="module")
def uncapped_client(vocab_size: int) -> Iterator[openai.OpenAI]:
    """The real engine on the trained tiny dense checkpoint behind a server started with max_logprobs=-1, whose
    bound on prompt-logprob entries (docs/limits.md) lets a completion have the whole vocabulary at 8 prompt
    tokens, not 9."""
    from deltaserve.engine.async_engine import AsyncEngine

    model = str(trained_model_dir("dense"))
    engine = AsyncEngine.from_config(EngineConfig(model=model, device="cpu", dtype="float32", max_model_len=128))
    server = serve(engine, model_root=model, served_model_names=[NAME], max_logprobs=-1,
                   max_prompt_logprob_entries=8 * (vocab_size + 1))  # fmt: skip
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    server.stop()


def _assert_whole_vocabulary(logprobs: list[float], vocab_size: int) -> None:
    """vocab_size distinct entries whose probabilities sum to 1: the whole distribution, not a top-k of it."""
    assert len(logprobs) == vocab_size
    assert math.isclose(sum(math.exp(lp) for lp in logprobs), 1.0, rel_tol=1e-3)


def test_chat_top_logprobs_minus_one_is_the_whole_vocabulary(uncapped_client: openai.OpenAI, vocab_size: int) -> None:
    response = uncapped_client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True, top_logprobs=-1,
        extra_body={"prompt_logprobs": -1},
    )  # fmt: skip
    content = response.choices[0].logprobs.content
    assert len(content) == 2
    for item in content:
        ranked = [top.logprob for top in item.top_logprobs]
        _assert_whole_vocabulary(ranked, vocab_size)
        assert ranked == sorted(ranked, reverse=True) and item.logprob == ranked[0]  # greedy: the top-1
    prompt_logprobs = response.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == response.usage.prompt_tokens
    for entry in prompt_logprobs[1:]:
        _assert_whole_vocabulary([value["logprob"] for value in entry.values()], vocab_size)


def test_chat_top_logprobs_list_the_sampled_token_first(uncapped_client: openai.OpenAI) -> None:
    """vLLM 0.26's chat takes the first top_logprobs entries of its per-position dict, whose first key is the
    sampled token: a sampled token outside the best is listed first, then the best others."""
    response = uncapped_client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=16, temperature=2.0, seed=3, logprobs=True, top_logprobs=2
    )
    items = response.choices[0].logprobs.content
    assert all((item.top_logprobs[0].token, item.top_logprobs[0].logprob) == (item.token, item.logprob)
               for item in items)  # fmt: skip
    assert any(item.top_logprobs[1].logprob > item.logprob for item in items)  # a sampled token below the best


def test_logprob_token_ids_list_the_sampled_token_and_the_ids(uncapped_client: openai.OpenAI) -> None:
    """vLLM's logprob_token_ids: chat's top_logprobs and a completion's top_logprobs hold the sampled token and every
    listed id (all of them, whatever top_logprobs / logprobs say), with the whole vocabulary's values."""
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir("dense"))
    ids = [355, 11, 16]
    texts = [tokenizer.decode([i]) for i in ids]
    chat = uncapped_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                                   logprobs=True, extra_body={"logprob_token_ids": ids})  # fmt: skip
    whole = uncapped_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                                    logprobs=True, top_logprobs=-1)  # fmt: skip
    for item, full in zip(chat.choices[0].logprobs.content, whole.choices[0].logprobs.content, strict=True):
        listed = [top.token for top in item.top_logprobs]
        assert listed == [item.token, *(t for t in texts if t != item.token)]
        values = {top.token: top.logprob for top in full.top_logprobs}
        assert [top.logprob for top in item.top_logprobs] == pytest.approx([values[t] for t in listed], abs=1e-5)
    completion = uncapped_client.completions.create(model=NAME, prompt="Once upon a time, the", max_tokens=3,
                                                    temperature=0, logprobs=1,
                                                    extra_body={"logprob_token_ids": ids})  # fmt: skip
    for token, top in zip(completion.choices[0].logprobs.tokens, completion.choices[0].logprobs.top_logprobs,
                          strict=True):  # fmt: skip
        assert set(top) == {token, *texts}


def test_completions_prompt_logprobs_minus_one_is_the_whole_vocabulary(
    uncapped_client: openai.OpenAI, vocab_size: int
) -> None:
    prompt = list(range(5, 13))  # 8 tokens
    response = uncapped_client.completions.create(
        model=NAME, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": -1}
    )
    prompt_logprobs = response.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    for entry in prompt_logprobs[1:]:
        _assert_whole_vocabulary([value["logprob"] for value in entry.values()], vocab_size)
        assert sorted(value["rank"] for value in entry.values()) == list(range(1, vocab_size + 1))
    # -1 counts as the vocabulary against --max-prompt-logprob-entries: one token more is over it
    with pytest.raises(openai.BadRequestError) as refused:
        uncapped_client.completions.create(model=NAME, prompt=[*prompt, 13], max_tokens=1,
                                           extra_body={"prompt_logprobs": -1})  # fmt: skip
    assert refused.value.body["param"] == "prompt_logprobs"
    assert "--max-prompt-logprob-entries" in refused.value.body["message"]


def test_uncapped_server_caps_at_the_vocabulary(uncapped_client: openai.OpenAI, vocab_size: int) -> None:
    """max_logprobs=-1 is a cap of vocab_size (vLLM's words name it), and beam search fits under it."""
    with pytest.raises(openai.BadRequestError) as refused:
        uncapped_client.completions.create(model=NAME, prompt="x", max_tokens=1, logprobs=vocab_size + 1)
    error = refused.value.body
    assert error["message"] == (
        f"Requested sample logprobs of {vocab_size + 1}, which is greater than max allowed: {vocab_size} "
        f"(parameter=logprobs, value={vocab_size + 1})"
    )
    assert error["param"] == "logprobs"
    beams = uncapped_client.completions.create(
        model=NAME, prompt="x", max_tokens=2, n=2, extra_body={"use_beam_search": True}
    )
    assert len(beams.choices) == 2


def _error(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def assert_validator_error(error: dict[str, Any], message: str, param: str) -> None:
    """vLLM raises these in its request models' validators: pydantic's "1 validation error" list, the message as a
    value error ending with its parameter (and value), the field as param."""
    assert (
        error["message"].startswith("1 validation error:\n") and f"'msg': 'Value error, {message}" in error["message"]
    )
    assert f"(parameter={param}" in error["message"] and error["param"] == param


CHAT = {"messages": MESSAGES, "max_tokens": 1}
COMPLETION = {"prompt": "x", "max_tokens": 1}


def test_default_cap_refuses_minus_one_in_vllms_words(http: httpx.Client, fake_engine: FakeEngine) -> None:
    """The default cap (20): -1 resolves to the vocabulary, which is over it; the message names the resolved count."""
    vocab_size = len(fake_engine.tokenizer)  # the FakeEngine's vocabulary: its tokenizer's
    error = _error(http, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1})
    assert error["message"] == (
        f"Requested sample logprobs of {vocab_size}, which is greater than max allowed: 20 "
        f"(parameter=logprobs, value={vocab_size})"
    )
    assert error["param"] == "logprobs"
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        error = _error(http, path, {**body, "prompt_logprobs": -1})
        assert error["message"] == (
            f"Requested prompt logprobs of {vocab_size}, which is greater than max allowed: 20 "
            f"(parameter=prompt_logprobs, value={vocab_size})"
        )
        assert error["param"] == "prompt_logprobs"
    error = _error(http, "/v1/completions", {**COMPLETION, "logprobs": 21})
    assert error["message"] == (
        "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)"
    )


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        ("/v1/completions", {**COMPLETION, "prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1.",
         "prompt_logprobs"),
        ("/v1/chat/completions", {**CHAT, "prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1.",
         "prompt_logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -2},
         "`top_logprobs` must be a positive value or -1.", "top_logprobs"),
        ("/v1/completions", {**COMPLETION, "logprobs": -1}, "`logprobs` must be a positive value.", "logprobs"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": -1},
         "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 50},
         "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"),
        ("/v1/completions", {**COMPLETION, "prompt_logprobs": -1, "stream": True},
         "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"),
        ("/v1/chat/completions", {**CHAT, "prompt_logprobs": -1, "stream": True},
         "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"),
    ],
)  # fmt: skip
def test_protocol_refusals_in_vllms_words(
    http: httpx.Client, path: str, body: dict[str, Any], message: str, param: str
) -> None:
    """Below -1 (or -1 where a field does not take it), and -1 or more without what it needs: vLLM's request
    models' words, checked before the cap (top_logprobs 50 without logprobs is that refusal, not the cap's)."""
    error = _error(http, path, body)
    assert_validator_error(error, message, param)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/chat/completions", {**CHAT, "logprob_token_ids": [1]},
         "when using `logprob_token_ids`, `logprobs` must be set to true."),
        ("/v1/completions", {**COMPLETION, "logprob_token_ids": [1]},
         "when using `logprob_token_ids`, `logprobs` must be set."),
        ("/v1/completions", {**COMPLETION, "logprob_token_ids": [1], "logprobs": 1, "echo": True, "max_tokens": 0},
         "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no output tokens are "
         "generated."),
        ("/v1/completions", {**COMPLETION, "logprob_token_ids": [1], "logprobs": 1, "use_beam_search": True, "n": 2},
         "`logprob_token_ids` is not supported with beam search."),
    ],
)  # fmt: skip
def test_logprob_token_ids_refusals_in_vllms_words(http: httpx.Client, path: str, body: dict, message: str) -> None:
    assert_validator_error(_error(http, path, body), message, "logprob_token_ids")
