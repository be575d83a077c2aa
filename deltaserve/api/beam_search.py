"""Beam search for /v1/completions (`use_beam_search`), as vLLM 0.26 serves it: in the serving layer, on top of the
engine, one one-token engine request per beam per step.

Each step asks the engine for every live beam's next-token logprobs (max_tokens 1, logprobs 2 * width, the
request's temperature; the sampled token is a candidate too, as in vLLM, which only matters above temperature 0).
Every candidate extends its beam by one token and adds its logprob to the beam's cumulative logprob. A candidate
that is the tokenizer's eos (unless ignore_eos) completes its beam: it joins the finished list, with the eos token
kept only under include_stop_str_in_output. The other candidates are ranked by score and the best `width` live on.
After max_tokens steps the live beams join the finished ones and the best `width` of all, by score, are the
choices, best first. vLLM's score (get_beam_search_score) is cumulative_logprob / L ** length_penalty, where L
counts the prompt's tokens and the beam's, less a final eos. There is no early stop: every step runs. These rules
live in engine/beam_search.py, which the offline LLM.beam_search shares; this module runs them over engine streams.

Where this equals transformers' generate(num_beams=width, do_sample=False): when no eos reaches a beam's top
2 * width candidates (ignore_eos, or a model that does not end), both keep the global best `width` extensions at
each step and return the same beams in the same order, whatever length_penalty (all beams are equally long).
With eos they differ by design: vLLM completes every eos among a beam's candidates and scores by prompt + output
length, where transformers keeps an eos only among the step's best `width` and divides by the output length.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from functools import partial

from deltaserve.api.errors import bad_request
from deltaserve.api.serving_common import engine_request_id, engine_stream
from deltaserve.api.settings import ServerState
from deltaserve.engine.beam_search import Beam, beam_width_error, best_beams, expand_beams
from deltaserve.engine.request import CompletionOutput, RequestOutput
from deltaserve.sampling_params import SamplingParams


def check_beam_width(width: int, max_logprobs: int) -> None:
    """Each step asks for 2 * width logprobs, which --max-logprobs bounds (vLLM's check and words; max_logprobs is
    ServerState.max_logprobs, -1 already resolved to the vocabulary)."""
    error = beam_width_error(width, max_logprobs)
    if error is not None:
        raise bad_request(error, "n")


async def _one_step(state: ServerState, tokens: list[int], params: SamplingParams, request_id: str) -> RequestOutput:
    async with contextlib.aclosing(engine_stream(state, tokens, params, request_id, 0.0, is_logged=False)) as stream:
        last = None
        async for output in stream:
            last = output
    assert last is not None and last.outputs[0].logprobs, "a beam step returned no logprobs"
    return last


async def beam_search(
    state: ServerState,
    prompt_token_ids: list[int],
    params: SamplingParams,
    width: int,
    length_penalty: float,
    request_id: str,
) -> RequestOutput:
    """The `width` best beams of prompt_token_ids as one finished RequestOutput (choices best first). params: the
    request's resolved SamplingParams (max_tokens, temperature, ignore_eos, include_stop_str_in_output)."""
    eos = None if params.ignore_eos else state.engine.tokenizer.eos_token_id
    step_params = SamplingParams(n=1, temperature=params.temperature, max_tokens=1, logprobs=2 * width)
    num_prompt = len(prompt_token_ids)

    score_eos = state.engine.tokenizer.eos_token_id
    live = [Beam(list(prompt_token_ids))]
    finished: list[Beam] = []
    for step in range(params.max_tokens or 0):
        outputs = await asyncio.gather(*(
            _one_step(state, beam.tokens, step_params, engine_request_id(request_id, step * width + i))
            for i, beam in enumerate(live)
        ))  # fmt: skip
        step_logprobs = [output.outputs[0].logprobs[0] for output in outputs]
        live, completed = expand_beams(live, step_logprobs, width, eos, params.include_stop_str_in_output,
                                       score_eos, length_penalty)  # fmt: skip
        finished += completed
    best = best_beams(finished, live, width, score_eos, length_penalty)
    choices = []
    for index, beam in enumerate(best):
        token_ids = beam.tokens[num_prompt:]
        shown = token_ids[:-1] if token_ids and token_ids[-1] == eos else token_ids  # vLLM: eos not in the text
        text = state.engine.tokenizer.decode(shown)
        choices.append(
            CompletionOutput(
                index=index,
                text=text,
                token_ids=token_ids,
                cumulative_logprob=beam.cumulative_logprob,
                logprobs=beam.logprobs[: len(token_ids)] if params.logprobs is not None else None,
                finish_reason=beam.finish_reason or "length",
                stop_reason=beam.stop_reason,
            )
        )
    return RequestOutput(request_id, None, list(prompt_token_ids), choices, finished=True)


async def _as_stream(search: Callable[[], Awaitable[RequestOutput]]) -> AsyncGenerator[RequestOutput, None]:
    yield await search()  # the search starts on the stream's first iteration, as an engine stream is submitted


def beam_search_streams(
    state: ServerState,
    prompts: list[list[int]],
    params: list[SamplingParams],
    width: int,
    length_penalty: float,
    response_id: str,
) -> list[AsyncGenerator[RequestOutput, None]]:
    """One engine-like stream per prompt, of one finished output: its `width` beams as choices 0..width-1 (vLLM
    streams a beam search as one chunk per choice, at the end). Refuses a width whose logprobs --max-logprobs
    bounds."""
    check_beam_width(width, state.max_logprobs)
    return [
        _as_stream(
            partial(beam_search, state, token_ids, params[i], width, length_penalty, engine_request_id(response_id, i))
        )
        for i, token_ids in enumerate(prompts)
    ]
