"""max_tokens and the context-length rules, for /v1/completions and /v1/chat/completions, streamed and not.

The API derives a prompt's max_tokens once (engine/frontend.resolve_max_tokens, called by
api/sampling.build_sampling_params): unset means the rest of the context (chat; a completion's default, or null, is
16 as in vLLM), a generation_config max_new_tokens caps
even an explicit value, and the same call refuses a prompt that leaves no room and a prompt + max_tokens over the
context, as 400s naming the field, before any stream starts. The FakeEngine's max_model_len is 2048.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from deltaserve.api import sampling

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine

MAX_MODEL_LEN = 2048
USER = [{"role": "user", "content": "hi"}]


def _consume(response: Any, is_stream: bool) -> None:
    if is_stream:
        for _ in response:
            pass


def _chat_prompt_tokens(http: httpx.Client, messages: list[dict[str, Any]]) -> int:
    """The templated prompt's token count, as /tokenize renders it (the chat endpoint renders it alike)."""
    response = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
    assert response.status_code == 200, response.text
    return response.json()["count"]


def _error(exc: pytest.ExceptionInfo[openai.BadRequestError]) -> dict[str, Any]:
    assert exc.value.status_code == 400
    return exc.value.body if "message" in exc.value.body else exc.value.body["error"]


@pytest.mark.parametrize("is_stream", [False, True])
def test_completion_max_tokens_default_and_bounds(
    client: openai.OpenAI, fake_engine: FakeEngine, is_stream: bool
) -> None:
    # a null max_tokens is the default 16, as vLLM normalises it (its PR #45491), not the rest of the context
    _consume(
        client.completions.create(model=MODEL_NAME, prompt=[5] * 2000, max_tokens=None, stream=is_stream), is_stream
    )
    assert fake_engine.last_params.max_tokens == 16
    with pytest.raises(openai.BadRequestError) as exc:  # one token of room is too little for those 16
        client.completions.create(model=MODEL_NAME, prompt=[5] * (MAX_MODEL_LEN - 1), max_tokens=None, stream=is_stream)
    assert _error(exc)["param"] == "max_tokens"
    # each prompt of a batch is checked against its own context
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt=[[5] * 2000, [5] * 2040], max_tokens=None, stream=is_stream)
    assert _error(exc)["message"].endswith("(16 > 2048 - 2040).")
    # prompt + max_tokens exactly fills the context: accepted; one more is a 400 naming max_tokens
    _consume(client.completions.create(model=MODEL_NAME, prompt=[5] * 2000, max_tokens=48, stream=is_stream), is_stream)
    assert fake_engine.last_params.max_tokens == 48
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt=[5] * 2000, max_tokens=49, stream=is_stream)
    error = _error(exc)
    assert error["param"] == "max_tokens"
    assert error["message"] == (
        "'max_tokens' or 'max_completion_tokens' is too large: 49. This model's maximum context length is 2048 "
        "tokens and your request has 2000 input tokens (49 > 2048 - 2000)."
    )
    # a prompt that leaves no room for one token
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt=[5] * MAX_MODEL_LEN, stream=is_stream)
    error = _error(exc)
    assert error["param"] == "prompt"
    assert error["message"] == (
        "This model's maximum context length is 2048 tokens. However, your request has 2048 input tokens. "
        "Please reduce the length of the input."
    )


@pytest.mark.parametrize("is_stream", [False, True])
def test_chat_max_tokens_default_and_bounds(
    client: openai.OpenAI, http: httpx.Client, fake_engine: FakeEngine, is_stream: bool
) -> None:
    num_prompt = _chat_prompt_tokens(http, USER)
    fake_engine.scripts.append(["ok"])
    _consume(client.chat.completions.create(model=MODEL_NAME, messages=USER, stream=is_stream), is_stream)
    assert len(fake_engine.last_prompt_ids) == num_prompt
    assert fake_engine.last_params.max_tokens == MAX_MODEL_LEN - num_prompt
    # max_completion_tokens wins over max_tokens
    fake_engine.scripts.append(["ok"])
    _consume(
        client.chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=9, max_completion_tokens=7, stream=is_stream
        ),
        is_stream,
    )
    assert fake_engine.last_params.max_tokens == 7
    with pytest.raises(openai.BadRequestError) as exc:
        too_many = MAX_MODEL_LEN - num_prompt + 1
        client.chat.completions.create(
            model=MODEL_NAME, messages=USER, max_completion_tokens=too_many, stream=is_stream
        )
    error = _error(exc)
    assert error["param"] == "max_tokens"
    assert error["message"].startswith(f"'max_tokens' or 'max_completion_tokens' is too large: {too_many}.")
    long_messages = [{"role": "user", "content": " hello" * MAX_MODEL_LEN}]
    num_long = _chat_prompt_tokens(http, long_messages)
    assert num_long >= MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL_NAME, messages=long_messages, stream=is_stream)
    error = _error(exc)
    assert error["param"] == "messages"
    assert error["message"] == (
        f"This model's maximum context length is 2048 tokens. However, your request has {num_long} input tokens. "
        "Please reduce the length of the input."
    )


@pytest.mark.parametrize("is_stream", [False, True])
def test_generation_config_caps_max_tokens(client: openai.OpenAI, fake_engine: FakeEngine, is_stream: bool) -> None:
    """A generation_config max_new_tokens caps unset and explicit values, and the length rule sees the capped one."""
    fake_engine.default_sampling = {"max_tokens": 5}
    _consume(client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=None, stream=is_stream), is_stream)
    assert fake_engine.last_params.max_tokens == 5
    # 100 would not fit beside 2000 prompt tokens; capped to 5 it does
    _consume(
        client.completions.create(model=MODEL_NAME, prompt=[5] * 2000, max_tokens=100, stream=is_stream), is_stream
    )
    assert fake_engine.last_params.max_tokens == 5
    fake_engine.scripts.append(["ok"])
    _consume(client.chat.completions.create(model=MODEL_NAME, messages=USER, stream=is_stream), is_stream)
    assert fake_engine.last_params.max_tokens == 5


@pytest.fixture
def derivations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Every call of the one max_tokens derivation the API makes (the server runs in a thread of this process)."""
    calls: list[tuple[Any, ...]] = []
    derive = sampling.resolve_max_tokens

    def counted(*args: Any) -> int:
        calls.append(args)
        return derive(*args)

    monkeypatch.setattr(sampling, "resolve_max_tokens", counted)
    yield calls


@pytest.mark.parametrize("is_stream", [False, True])
def test_max_tokens_is_derived_once_per_prompt(
    client: openai.OpenAI, fake_engine: FakeEngine, derivations: list[tuple[Any, ...]], is_stream: bool
) -> None:
    _consume(
        client.completions.create(model=MODEL_NAME, prompt=["a", "b", "c"], max_tokens=3, stream=is_stream), is_stream
    )
    assert len(derivations) == 3
    derivations.clear()
    fake_engine.scripts.append(["ok"])
    _consume(client.chat.completions.create(model=MODEL_NAME, messages=USER, stream=is_stream), is_stream)
    assert len(derivations) == 1
    assert derivations[0][0] is None and derivations[0][1] == len(fake_engine.last_prompt_ids)
