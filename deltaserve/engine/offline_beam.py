"""The offline LLM.beam_search, as vLLM 0.26's BeamSearchOfflineMixin runs it, on top of LLM.generate.

Each step is ONE generate call over every live beam of every prompt of the batch (max_tokens 1, logprobs
2 * beam_width, the params' temperature), so the engine batches them (and its prefix cache serves the shared
prefixes); the rules of a step and of the final choice are engine/beam_search.py's, which the server shares.
Prompts run in batches of concurrency_limit (None: all at once), each batch for max_tokens steps or until no beam
is left. Where vLLM's offline search differs from its server, this follows it: a completed sequence keeps its eos
(include_stop_str_in_output changes nothing), text decodes the prompt and the beam together, and finish_reason /
stop_reason stay None.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from deltaserve.engine.beam_search import Beam, BeamSearchOutput, BeamSearchSequence, best_beams, expand_beams
from deltaserve.engine.request import RequestOutput
from deltaserve.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

# LLM.generate(prompts, params, use_tqdm=...) as the search calls it
Generate = Callable[..., list[RequestOutput]]


@dataclass
class _Instance:
    """One prompt's search: its prompt as vLLM's token input, its live beams and the completed ones."""

    orig_prompt: dict[str, Any]
    live: list[Beam]
    finished: list[Beam] = field(default_factory=list)


def check_beam_search_params(params: BeamSearchParams) -> None:
    """Refuses what LLM.beam_search cannot run, by name (vLLM's BeamSearchParams has no checks of its own)."""
    if params.structured_outputs is not None:
        raise ValueError("structured_outputs: deltaserve's beam search does not constrain its beams")
    if isinstance(params.beam_width, bool) or not isinstance(params.beam_width, int) or params.beam_width < 1:
        raise ValueError(f"beam_width must be a positive integer, got {params.beam_width!r}")
    if isinstance(params.max_tokens, bool) or not isinstance(params.max_tokens, int) or params.max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative integer, got {params.max_tokens!r}")


def beam_search(
    generate: Generate,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[dict[str, Any]],
    params: BeamSearchParams,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """One BeamSearchOutput per prompt, in order. prompts: vLLM's token inputs ({"type": "token",
    "prompt_token_ids": [...], optional "prompt" and "cache_salt"}). A beam's step prompt carries its prompt's
    cache_salt. The width's 2 * width logprobs are bounded by LLM's max_logprobs, which generate enforces."""
    check_beam_search_params(params)
    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be at least 1, got {concurrency_limit}")
    if use_tqdm and concurrency_limit is not None:
        logger.warning("Progress bar is not supported when using concurrency_limit. Disabling progress bar.")
        use_tqdm = False
    width = params.beam_width
    score_eos = tokenizer.eos_token_id
    eos = None if params.ignore_eos else score_eos
    step_params = SamplingParams(n=1, temperature=params.temperature, max_tokens=1, logprobs=2 * width)
    instances = [_Instance(prompt, [Beam(list(prompt["prompt_token_ids"]))]) for prompt in prompts]
    limit = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), limit):
        batch = instances[start : start + limit]
        steps = range(params.max_tokens)
        for _ in tqdm(steps, desc="Beam search", unit="token", disable=not use_tqdm):
            if not any(instance.live for instance in batch):
                break
            step_prompts = [_step_prompt(instance.orig_prompt, beam) for instance in batch for beam in instance.live]
            outputs = iter(generate(step_prompts, step_params, use_tqdm=False))
            for instance in batch:
                step_logprobs = [_candidates(next(outputs)) for _ in instance.live]
                instance.live, completed = expand_beams(instance.live, step_logprobs, width, eos, True, score_eos,
                                                        params.length_penalty)  # fmt: skip
                instance.finished += completed
    results = []
    for instance in instances:
        best = best_beams(instance.finished, instance.live, width, score_eos, params.length_penalty)
        sequences = [
            BeamSearchSequence(
                instance.orig_prompt,
                beam.tokens,
                beam.logprobs,
                cum_logprob=beam.cumulative_logprob,
                text=tokenizer.decode(beam.tokens),
            )  # fmt: skip
            for beam in best
        ]
        results.append(BeamSearchOutput(sequences))
    return results


def _step_prompt(orig_prompt: dict[str, Any], beam: Beam) -> dict[str, Any]:
    step = {"prompt_token_ids": beam.tokens}
    if orig_prompt.get("cache_salt") is not None:
        step["cache_salt"] = orig_prompt["cache_salt"]
    return step


def _candidates(output: RequestOutput) -> dict:
    logprobs = output.outputs[0].logprobs
    assert logprobs, f"beam step {output.request_id} returned no logprobs"
    return logprobs[0]
