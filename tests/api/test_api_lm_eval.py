"""lm-eval's loglikelihood requests against the real server (docs/lm-eval.md), without lm-eval: the exact body its
`local-completions` model sends for a multiple-choice question (token-id prompt, echo, logprobs 1, max_tokens 1,
temperature 0, seed), one continuation per request as `--batch_size 1` sends them, on the trained tiny MoE in fp32
(tests/engine/test_prefix_cache_exact.py holds the bf16 GPU twin, without the HTTP layer the H200 host lacks).

Every continuation shares the question's context, so from the second request on the prefix cache has seen the
prefix: the loglikelihoods lm-eval sums from the echoed prompt logprobs must be the same bits with the cache on as
with it off (a request that asks for prompt logprobs reads no cache, and its prefill must not be cut where the cache
would like a checkpoint either).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from deltaserve.api.logprobs import CompletionLogprobs, TokenNamer
from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.request import Logprob
from deltaserve.engine_config import EngineConfig
from deltaserve.tiny.trained import trained_model_dir

from .server_thread import MODEL_NAME, serve

CORPUS = (Path(__file__).parents[2] / "deltaserve" / "tiny" / "corpus.txt").read_text()


def loglikelihood_body(prompt: list[int] | str) -> dict:
    """lm-eval 0.4's LocalCompletionsAPI._create_payload(generate=False), verbatim."""
    return {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}  # fmt: skip


def parse_logprobs(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's parse_logprobs for one choice: the continuation's summed logprob and whether it is greedy (the last
    entry, the token the server drew, is not part of the prompt)."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(token == max(top.values()) for token, top in zip(token_logprobs, top_logprobs, strict=True))
    return sum(token_logprobs), is_greedy


@pytest.fixture(scope="module")
def prompts() -> tuple[list[list[int]], int]:
    """Three continuations of one 150-token context (a few-shot question: nine full blocks are shared)."""
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(trained_model_dir("moe")).encode(CORPUS[:4000])
    context = tokens[:150]
    return [context + tokens[400 + 12 * i : 412 + 12 * i] for i in range(3)], len(context)


def answers(is_on: bool, prompts: list[list[int]], device: str, dtype: str) -> Iterator[dict]:
    config = EngineConfig(model=str(trained_model_dir("moe")), device=device, dtype=dtype, max_model_len=256,
                          max_num_seqs=2, enable_prefix_caching=is_on)  # fmt: skip
    server = serve(AsyncEngine.from_config(config, multiprocess=False))
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            for prompt in prompts:  # one at a time: each request's prefill is the only work of its steps
                response = http.post("/v1/completions", json=loglikelihood_body(prompt))
                assert response.status_code == 200, response.text
                yield response.json()
    finally:
        server.stop()


def check_same_bits(prompts: tuple, device: str, dtype: str) -> None:
    token_prompts, ctxlen = prompts
    off = list(answers(False, token_prompts, device, dtype))
    on = list(answers(True, token_prompts, device, dtype))
    for prompt, body in zip(token_prompts, on, strict=True):
        (choice,) = body["choices"]
        logprobs = choice["logprobs"]
        # what lm-eval reads: every prompt token (the first without a logprob) and the one drawn token after them
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None and all(len(t) in (1, 2) for t in logprobs["top_logprobs"][1:])
        assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 1
    for want, got in zip(off, on, strict=True):
        assert got["choices"][0]["logprobs"]["token_logprobs"] == want["choices"][0]["logprobs"]["token_logprobs"]
        assert parse_logprobs(got["choices"][0], ctxlen) == parse_logprobs(want["choices"][0], ctxlen)


def test_loglikelihoods_are_the_same_bits_with_the_prefix_cache_on_and_off(prompts: tuple) -> None:
    check_same_bits(prompts, "cpu", "float32")


def test_a_shared_top_logprobs_text_holds_the_later_candidate_as_vllm() -> None:
    """Two candidates that decode alike ("" for a partial character) share one top_logprobs key: vLLM's dict puts
    the token first and the best ranked after it, so the best's logprob stays under the key. lm-eval with logprobs 2
    then finds the rank-2 token not greedy; the token's own logprob under the key made it greedy."""
    namer = TokenNamer(SimpleNamespace(decode=lambda ids: "t"), as_token_ids=False)  # decodes the first token
    entry = {7: Logprob(-1.5, 2, ""), 5: Logprob(-0.5, 1, ""), 9: Logprob(-2.0, 3, "x")}
    drawn = {4: Logprob(-0.1, 1, "y")}
    logprobs = CompletionLogprobs(namer, 2).build([3, 7, 4], [None, entry, drawn])
    assert logprobs["top_logprobs"][1] == {"": -0.5} and logprobs["token_logprobs"][1] == -1.5
    assert parse_logprobs({"logprobs": logprobs}, 1) == (-1.5, False)


def test_echoed_split_characters_are_rebuilt_from_the_prompt() -> None:
    """A prompt character split over byte tokens is echoed as vLLM does: the token that completes it shows the
    character (rebuilt from the prompt tokens before it), so tokens join to the echoed text and text_offset points
    into it; every split token showed "" before."""
    from transformers import AutoTokenizer

    text = "caf\u00e9 \u65e5\u672c ok"
    prompt = AutoTokenizer.from_pretrained(trained_model_dir("dense")).encode(text)
    config = EngineConfig(model=str(trained_model_dir("dense")), device="cpu", dtype="float32", max_model_len=64,
                          max_num_seqs=2)  # fmt: skip
    server = serve(AsyncEngine.from_config(config, multiprocess=False))
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            for body in (loglikelihood_body(prompt), loglikelihood_body(prompt) | {"max_tokens": 0}):
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                (choice,) = response.json()["choices"]
                tokens, offsets = choice["logprobs"]["tokens"][: len(prompt)], choice["logprobs"]["text_offset"]
                assert choice["text"].startswith(text) and "".join(tokens) == text, tokens
                assert offsets[: len(prompt)] == [len("".join(tokens[:i])) for i in range(len(prompt))]
                assert "\u65e5" in tokens and "\u65e5" in choice["logprobs"]["top_logprobs"][tokens.index("\u65e5")]
    finally:
        server.stop()
