"""The offline LLM.beam_search (vLLM's) and LLM(max_logprobs=...).

On the tiny dense checkpoint (fp32, CPU) the offline search returns what the server's /v1/completions
`use_beam_search` returns for the same prompts and params (tokens, order, cumulative logprob), each step one
batched generate. With eos, on a scripted model, both apply the shared rules (engine/beam_search.py) and differ
only where vLLM's offline search does: the eos stays in the tokens and the text decodes the prompt too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from deltaserve import BeamSearchParams
from deltaserve.api import beam_search as server_beam
from deltaserve.engine import offline_beam
from deltaserve.engine.llm import LLM
from deltaserve.engine.request import RequestOutput
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams

from ..api.server_thread import ServerThread, serve
from ..support.beam_script import EOS, TOKENIZER, scripted_output

PROMPTS = [[5, 17, 99, 300, 41], [1000, 3, 3, 3, 7, 8, 250, 12]]  # two lengths


@pytest.fixture(scope="module")
def llm(tiny_dense: Path) -> LLM:
    return LLM(tiny_dense, dtype="float32", device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def beam_server(tiny_dense: Path) -> Iterator[ServerThread]:
    from deltaserve.engine.async_engine import AsyncEngine

    thread = serve(AsyncEngine.from_config(EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=256)))
    yield thread
    thread.stop()


@pytest.mark.parametrize(("width", "max_tokens", "length_penalty"), [(2, 5, 1.0), (3, 4, 0.5)])
def test_equals_server_beam_search(
    llm: LLM, beam_server: ServerThread, width: int, max_tokens: int, length_penalty: float
) -> None:
    body = {"prompt": PROMPTS, "n": width, "max_tokens": max_tokens, "use_beam_search": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 0, "length_penalty": length_penalty}  # fmt: skip
    choices = httpx.post(beam_server.base_url + "/v1/completions", json=body, timeout=60).json()["choices"]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outputs) == len(PROMPTS)
    for i, (prompt, output) in enumerate(zip(PROMPTS, outputs, strict=True)):
        theirs = choices[i * width : (i + 1) * width]
        assert [seq.tokens[: len(prompt)] for seq in output.sequences] == [prompt] * width
        assert [seq.tokens[len(prompt) :] for seq in output.sequences] == [c["token_ids"] for c in theirs]
        # the engine's fp32 logprobs are not bitwise batch-invariant (the server batches its one-beam requests as
        # they arrive, offline batches every beam of a step; prefix-cache hits differ too): ~1e-5 per token
        server_sums = [sum(c["logprobs"]["token_logprobs"]) for c in theirs]
        assert [seq.cum_logprob for seq in output.sequences] == pytest.approx(server_sums, abs=2e-3)
        for seq in output.sequences:
            assert len(seq.logprobs) == max_tokens and all(len(step) >= 2 * width for step in seq.logprobs)
            chosen = [step[token].logprob for step, token in zip(seq.logprobs, seq.tokens[len(prompt) :], strict=True)]
            assert seq.cum_logprob == sum(chosen)  # the offline sum of its own steps, exactly
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)
            assert seq.finish_reason is None and seq.stop_reason is None  # as vLLM's offline search leaves them


def test_text_prompt_and_tokens_prompt_agree(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    text = "Once upon a time"
    ids = llm.get_tokenizer().encode(text)
    by_text, by_ids = llm.beam_search([text, {"prompt_token_ids": ids}], params)
    assert [s.tokens for s in by_text.sequences] == [s.tokens for s in by_ids.sequences]
    assert by_text.sequences[0].orig_prompt == {"type": "token", "prompt_token_ids": ids, "prompt": text}


def test_width_over_the_logprobs_cap_is_refused(llm: LLM, tiny_dense: Path) -> None:
    """Each step asks 2 * width logprobs, bounded by max_logprobs (default 20) as the server's --max-logprobs."""
    with pytest.raises(
        ValueError,
        match=r"^Requested sample logprobs of 22, which is greater than max allowed: 20 "
        r"\(parameter=logprobs, value=22\)$",
    ):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    assert not llm.engine.requests  # nothing left behind
    assert len(llm.beam_search(["hi"], BeamSearchParams(beam_width=10, max_tokens=1))[0].sequences) == 10


@pytest.mark.parametrize(
    ("params", "kwargs", "message"),
    [
        (BeamSearchParams(2, 2, structured_outputs=object()), {}, "^structured_outputs: "),  # type: ignore[arg-type]
        (BeamSearchParams(0, 2), {}, "^beam_width must be a positive integer, got 0$"),
        (BeamSearchParams(2, -1), {}, "^max_tokens must be a non-negative integer, got -1$"),
        (BeamSearchParams(2, 2), {"lora_request": object()}, "^lora_request: "),
        (BeamSearchParams(2, 2), {"concurrency_limit": 0}, "^concurrency_limit must be at least 1, got 0$"),
    ],
)
def test_refused_by_name(llm: LLM, params: BeamSearchParams, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.beam_search(["hi"], params, **kwargs)


# -- eos, batching and concurrency_limit on a scripted model ---------------------------------------------------------


def offline(prompts: list[list[int]], params: BeamSearchParams, calls: list[Any], **options: Any) -> list[Any]:
    def generate(step_prompts: list[dict[str, Any]], step_params: SamplingParams, use_tqdm: bool) -> list[Any]:
        calls.append((step_prompts, step_params))
        return [scripted_output(p["prompt_token_ids"]) for p in step_prompts]

    inputs = [{"type": "token", "prompt_token_ids": p} for p in prompts]
    outputs = offline_beam.beam_search(generate, TOKENIZER, inputs, params, **options)  # type: ignore[arg-type]
    return [[(s.tokens, s.cum_logprob, s.text) for s in output.sequences] for output in outputs]


def scripted_server(
    prompt: list[int], length_penalty: float, monkeypatch: pytest.MonkeyPatch, **params: Any
) -> list[Any]:
    async def one_step(state: Any, tokens: list[int], step: SamplingParams, request_id: str) -> RequestOutput:
        return scripted_output(tokens, request_id)

    monkeypatch.setattr(server_beam, "_one_step", one_step)
    state = SimpleNamespace(engine=SimpleNamespace(tokenizer=TOKENIZER))
    sampling = SamplingParams(temperature=0.0, **params)
    output = asyncio.run(server_beam.beam_search(state, prompt, sampling, 2, length_penalty, "r"))  # type: ignore[arg-type]
    return [(prompt + c.token_ids, c.cumulative_logprob) for c in output.outputs]


@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
def test_eos_rules_equal_the_servers(monkeypatch: pytest.MonkeyPatch, length_penalty: float) -> None:
    calls: list[Any] = []
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=length_penalty)
    ours = offline([[1, 2]], params, calls)[0]
    # the server keeps the eos in token_ids under include_stop_str_in_output; then both give the same beams
    theirs = scripted_server([1, 2], length_penalty, monkeypatch, max_tokens=3, include_stop_str_in_output=True)
    assert [(tokens, cum) for tokens, cum, _ in ours] == theirs
    expected = {1.0: [[1, 2, 3, EOS], [1, 2, EOS]], 2.0: [[1, 2, 3, EOS], [1, 2, 3, 6, 6]]}[length_penalty]
    assert [tokens for tokens, _, _ in ours] == expected  # an eos completes its beam and stays in its tokens
    assert ours[0][2] == "1,2,3,9"  # the text decodes the prompt and the beam, eos included (vLLM's offline)
    # include_stop_str_in_output changes nothing offline (vLLM's offline search ignores it)
    kept = offline([[1, 2]], BeamSearchParams(2, 3, length_penalty=length_penalty, include_stop_str_in_output=True),
                   [])  # fmt: skip
    assert kept[0] == ours


def test_ignore_eos_continues_past_eos() -> None:
    ours = offline([[1, 2]], BeamSearchParams(2, 3, ignore_eos=True), [])[0]
    assert [tokens for tokens, _, _ in ours] == [[1, 2, 3, 6, 6], [1, 2, 3, EOS, 6]]


def test_each_step_is_one_generate_over_every_beam() -> None:
    calls: list[Any] = []
    prompts = [[1, 2], [1, 4, 4], [7]]
    results = offline(prompts, BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.5), calls)
    assert len(calls) == 3  # one generate per step, all prompts' beams in it
    assert [len(step_prompts) for step_prompts, _ in calls] == [3, 6, 6]
    assert all(p.max_tokens == 1 and p.logprobs == 4 and p.temperature == 0.5 for _, p in calls)
    limited_calls: list[Any] = []
    limited = offline(prompts, BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.5), limited_calls,
                      concurrency_limit=2)  # fmt: skip
    assert limited == results  # the same beams, prompts run two at a time
    assert [len(step_prompts) for step_prompts, _ in limited_calls] == [2, 4, 4, 1, 2, 2]


# -- LLM(max_logprobs=...) -------------------------------------------------------------------------------------------


def test_default_max_logprobs_refuses_21(llm: LLM) -> None:
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    with pytest.raises(
        ValueError,
        match=r"^Requested sample logprobs of 21, which is greater than max allowed: 20 "
        r"\(parameter=logprobs, value=21\)$",
    ):
        llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=21), use_tqdm=False)
    with pytest.raises(
        ValueError,
        match=r"^Requested prompt logprobs of 21, which is greater than max allowed: 20 "
        r"\(parameter=prompt_logprobs, value=21\)$",
    ):
        llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=21), use_tqdm=False)
    vocab = llm.engine.frontend.vocab_size
    with pytest.raises(ValueError, match=f"^Requested sample logprobs of {vocab}, which is greater than max allowed"):
        llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)  # -1 is the vocabulary
    assert not llm.engine.requests
    output = llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=20, prompt_logprobs=20), use_tqdm=False)[0]
    assert len(output.outputs[0].logprobs[0]) >= 20


def test_max_logprobs_minus_one_is_the_vocabulary(tiny_dense: Path) -> None:
    with pytest.raises(ValueError, match=r"^max_logprobs must be -1 \(no cap: the vocabulary\) or more, got -2$"):
        LLM(tiny_dense, dtype="float32", device="cpu", max_model_len=64, max_logprobs=-2)
    uncapped = LLM(tiny_dense, dtype="float32", device="cpu", max_model_len=64, max_logprobs=-1)
    vocab = uncapped.engine.frontend.vocab_size
    params = SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=-1)
    output = uncapped.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    assert len(output.outputs[0].logprobs[0]) == vocab
    assert all(len(entry) == vocab for entry in output.prompt_logprobs[1:])
    small = LLM(tiny_dense, dtype="float32", device="cpu", max_model_len=64, max_logprobs=4)
    with pytest.raises(
        ValueError,
        match=r"^Requested sample logprobs of 6, which is greater than max allowed: 4 \(parameter=logprobs, value=6\)$",
    ):
        small.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=3, max_tokens=1))
    assert len(small.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(2, 1))[0].sequences) == 2
