"""Beam search in /v1/completions (`use_beam_search`, n = beam width, `length_penalty`).

Against transformers: the real engine on the tiny dense checkpoint (fp32, CPU) returns the same beams in the same
order as transformers' generate(num_beams=n, do_sample=False) on the same weights, where no eos ends a beam
(ignore_eos): every length_penalty and early_stopping gives the same beams then, as all are equally long.
With eos, vLLM's own rules (api/beam_search.py) are checked on a scripted model: every eos among a beam's
candidates completes it, and the score divides by the prompt's and the beam's length.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from deltaserve.api import beam_search as beam_module
from deltaserve.engine.request import RequestOutput
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams

from ..model._hf_tiny import load_reference
from ..support.beam_script import EOS, TOKENIZER, scripted_output
from .server_thread import ServerThread, serve

PROMPTS = [[5, 17, 99, 300, 41], [1000, 3, 3, 3, 7, 8, 250, 12]]


@pytest.fixture(scope="module")
def beam_server(tiny_dense: Path) -> Iterator[ServerThread]:
    from deltaserve.engine.async_engine import AsyncEngine

    server = serve(AsyncEngine.from_config(EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=256)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tiny_dense: Path) -> torch.nn.Module:
    model = load_reference(tiny_dense)
    model.generation_config.eos_token_id = None  # no beam ends early: deltaserve's side runs with ignore_eos
    return model


def hf_beams(model: torch.nn.Module, prompt: list[int], width: int, max_tokens: int, **options: Any) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0, **options,
        )  # fmt: skip
    return [row[len(prompt) :].tolist() for row in out]


def beam_body(prompt: Any, width: int, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "n": width, "max_tokens": max_tokens, "use_beam_search": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **fields}  # fmt: skip


@pytest.mark.parametrize(
    ("width", "max_tokens", "length_penalty", "early_stopping"),
    [(2, 6, 1.0, False), (3, 8, 0.5, True), (4, 5, 2.0, "never")],
)
def test_equals_transformers_beam_search(
    beam_server: ServerThread,
    reference: torch.nn.Module,
    width: int,
    max_tokens: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> None:
    body = beam_body(PROMPTS, width, max_tokens, length_penalty=length_penalty)
    response = httpx.post(beam_server.base_url + "/v1/completions", json=body, timeout=60).json()
    choices = response["choices"]
    assert [choice["index"] for choice in choices] == list(range(2 * width))
    for i, prompt in enumerate(PROMPTS):
        expected = hf_beams(reference, prompt, width, max_tokens, length_penalty=length_penalty,
                            early_stopping=early_stopping)  # fmt: skip
        ours = choices[i * width : (i + 1) * width]
        assert [choice["token_ids"] for choice in ours] == expected
        assert all(choice["finish_reason"] == "length" for choice in ours)
    assert response["usage"]["completion_tokens"] == 2 * width * max_tokens


def test_streamed_beam_search_is_one_chunk_per_choice(beam_server: ServerThread) -> None:
    body = beam_body("Once upon a time", 3, 4)
    whole = httpx.post(beam_server.base_url + "/v1/completions", json=body, timeout=60).json()
    with httpx.stream("POST", beam_server.base_url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:  # fmt: skip
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in chunks] == [
        (c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]
    ]
    assert len({c["text"] for c in whole["choices"]}) == 3


@pytest.mark.parametrize("length_penalty", [1e308, -1e308])
def test_extreme_length_penalties_are_served(beam_server: ServerThread, length_penalty: float) -> None:
    """length ** length_penalty overflows (1e308) or underflows to 0 (-1e308) in the score, where Python's float
    raised: a 400 naming nothing and a 500. The score is the quotient's limit: -0.0 and -inf."""
    body = beam_body("Once upon a time", 2, 3, length_penalty=length_penalty)
    response = httpx.post(beam_server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert [choice["index"] for choice in response.json()["choices"]] == [0, 1]


# -- vLLM's rules with eos, on a scripted model -------------------------------------------------------------------


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    asked: list[SamplingParams] = []

    async def one_step(state: Any, tokens: list[int], params: SamplingParams, request_id: str) -> RequestOutput:
        asked.append(params)
        return scripted_output(tokens, request_id)

    monkeypatch.setattr(beam_module, "_one_step", one_step)
    return asked


def run_beams(length_penalty: float, **params: Any) -> list[tuple[list[int], str, str]]:
    state = SimpleNamespace(engine=SimpleNamespace(tokenizer=TOKENIZER))
    sampling = SamplingParams(max_tokens=3, temperature=0.0, **params)
    output = asyncio.run(beam_module.beam_search(state, [1, 2], sampling, 2, length_penalty, "r"))  # type: ignore[arg-type]
    return [(choice.token_ids, choice.text, choice.finish_reason) for choice in output.outputs]


def test_vllm_rules_with_eos(scripted: list[SamplingParams]) -> None:
    # Completed: [] (-0.5, length 2), [3] (-0.4, 3), [4] (-5.0, 3), [3, 6] (-1.6, 4), [4, 6] (-2.4, 4); live at
    # the end: [3, 6, 6] (-1.3, 5), [3, 6, 7] (-1.45, 5). Lengths count the 2 prompt tokens.
    assert run_beams(1.0) == [([3], "3", "stop"), ([], "", "stop")]  # -0.133, -0.25 (then -0.26 for [3, 6, 6])
    assert run_beams(2.0) == [([3], "3", "stop"), ([3, 6, 6], "3,6,6", "length")]  # -0.044, -0.052
    assert all(p.max_tokens == 1 and p.logprobs == 4 and p.temperature == 0.0 for p in scripted)
    # the eos stays in token_ids (not in the text) under include_stop_str_in_output; the scores do not change
    assert run_beams(2.0, include_stop_str_in_output=True) == [([3, EOS], "3", "stop"),
                                                               ([3, 6, 6], "3,6,6", "length")]  # fmt: skip
    # ignore_eos: eos is a token like another, kept in the text: [3, 9] (-0.4) lives on and ends second
    assert run_beams(1.0, ignore_eos=True) == [([3, 6, 6], "3,6,6", "length"), ([3, EOS, 6], "3,9,6", "length")]
