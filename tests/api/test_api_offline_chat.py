"""The offline LLM.chat (engine/offline_chat.py) against the server's chat completions on the same trained tiny MoE
checkpoint: for each conversation the prompt token ids (the server's /tokenize with messages) and the greedy answer's
token ids (the `openai` client, return_token_ids) are the same, batches included; and what it refuses, by name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.llm import LLM
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir

from .server_thread import serve

MOE = str(trained_model_dir("moe"))
SETTINGS = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# (messages, LLM.chat / request keyword arguments)
CASES: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "The river ran"}], {}),
    ([{"role": "user", "content": [{"type": "text", "text": "Once"}, {"type": "text", "text": "upon a time"}]}], {}),
    ([{"role": "user", "content": "What is the weather in Oslo?"}], {"tools": [WEATHER]}),
    ([{"role": "user", "content": "Say hello"}], {"chat_template_kwargs": {"enable_thinking": False}}),
    (
        [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MOE, **SETTINGS)


@pytest.fixture(scope="module")
def server_answers() -> Iterator[list[tuple[list[int], list[int]]]]:
    """(prompt token ids, greedy answer token ids) of each case from the real server."""
    server = serve(AsyncEngine.from_config(EngineConfig(model=MOE, **SETTINGS), multiprocess=False))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        answers = []
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            for messages, kwargs in CASES:
                body = {"model": model, "messages": messages, **kwargs}
                if "tools" in kwargs:
                    body["tool_choice"] = "none"
                prompt = http.post("/tokenize", json=body).json()["tokens"]
                out = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=12, temperature=0.0,
                    tools=kwargs.get("tools", openai.omit),
                    tool_choice="none" if "tools" in kwargs else openai.omit,  # the prompt keeps the tools
                    extra_body={"return_token_ids": True, **{k: v for k, v in kwargs.items() if k != "tools"}},
                )  # fmt: skip
                answers.append((prompt, out.choices[0].token_ids))
        yield answers
    finally:
        server.stop()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_chat_equals_the_servers_chat_completion(llm: LLM, server_answers: list, case: int) -> None:
    messages, kwargs = CASES[case]
    (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False, **kwargs)
    prompt, answer = server_answers[case]
    assert out.prompt_token_ids == prompt
    assert list(out.outputs[0].token_ids) == list(answer)


def test_a_batch_of_conversations_answers_each_in_order(llm: LLM, server_answers: list) -> None:
    batch = [CASES[0][0], CASES[1][0]]
    outs = llm.chat(batch, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(server_answers[i][1]) for i in (0, 1)]
    assert outs[0].prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


@pytest.mark.parametrize(
    ("messages", "kwargs", "error"),
    [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, "'image_url' is not"),
        ([{"role": "user", "content": "hi"}], {"continue_final_message": True}, "Cannot set both"),
        ([{"role": "user", "content": "hi"}], {"lora_request": object()}, "no LoRA adapters"),
        ([{"role": "user", "content": "hi"}], {"chat_template_content_format": "xml"}, "must be one of"),
    ],
)
def test_what_it_refuses_by_name(llm: LLM, messages: list, kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        llm.chat(messages, use_tqdm=False, **kwargs)
