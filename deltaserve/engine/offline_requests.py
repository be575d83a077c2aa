"""The offline LLM's requests: how a prompt becomes an engine request, and the loop that runs them to the end.

One code path for LLM.generate, LLM.chat, LLM.enqueue and LLM.enqueue_chat, as vLLM 0.26's offline API has one:
`add` checks every prompt and parameter before the first request enters the engine (so a refusal leaves nothing
behind; a request the engine itself refuses part-way aborts the ones this call added), names each request with the
next value of a counter ("0", "1", ... as vLLM's `request_counter`), and keeps its state as pending. `run` steps the
engine until nothing is unfinished and returns every pending request that finished, ordered by its numeric id, as
vLLM's `_run_engine` does: a generate() after enqueue() returns the enqueued requests' outputs too, first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.frontend import check_cache_salt, check_priority
from deltaserve.engine.metrics_snapshot import RequestCounts
from deltaserve.engine.output import RequestState
from deltaserve.engine.request import RequestOutput
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.multimodal.offline import loaded_media
from deltaserve.sampling_params import SamplingParams, logprobs_cap_error

# vLLM's prompt forms: a string, a list of token ids, or a dict ({"prompt": ...} / {"prompt_token_ids": ...})
PromptType = str | list[int] | dict[str, Any]
# vLLM's use_tqdm: a bool, or a callable that makes the bar (e.g. functools.partial(tqdm, leave=False))
UseTqdm = bool | Callable[..., Any]


def progress_bar(use_tqdm: UseTqdm, iterable: Any = None, **kwargs: Any) -> Any:
    """tqdm(iterable, **kwargs), disabled when use_tqdm is false; the caller's own bar factory when it is callable."""
    if callable(use_tqdm):
        return use_tqdm(iterable, **kwargs)
    return tqdm(iterable, disable=not use_tqdm, **kwargs)


def check_no_lora(lora_request: Any) -> None:
    """vLLM's lora_request keyword, as generate, chat and beam_search take it: None (or vLLM's per-prompt list of
    them) runs, anything else is refused."""
    if isinstance(lora_request, list | tuple) and all(item is None for item in lora_request):
        return
    if lora_request is not None:
        raise ValueError("lora_request: deltaserve serves no LoRA adapters")


def check_no_overrides(tokenization_kwargs: dict[str, Any] | None, mm_processor_kwargs: dict[str, Any] | None) -> None:
    """vLLM's tokenization_kwargs and mm_processor_kwargs: None or empty runs, anything else is refused by name."""
    if tokenization_kwargs:
        raise ValueError("tokenization_kwargs: the offline LLM tokenizes a text prompt as the server does")
    if mm_processor_kwargs:
        raise ValueError("mm_processor_kwargs: the offline LLM has no processor overrides")


def salt_of(prompt: PromptType) -> str | None:
    """A prompt's vLLM cache_salt (None for a string prompt or a dict without one)."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


def is_token_list(value: object) -> bool:
    """A non-empty list of ints: vLLM's token-id prompt (parse_dec_only_prompt's list form)."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def prompt_to_seq(prompts: PromptType | SequenceABC[PromptType]) -> SequenceABC[PromptType]:
    """vLLM's prompt_to_seq: a string, a dict or a non-empty list of token ids is one prompt; anything else is
    already a sequence of prompts (so [1, 2, 3] is one prompt, [[1, 2], [3]] two)."""
    if isinstance(prompts, str | dict) or is_token_list(prompts):
        return [prompts]  # type: ignore[list-item]
    return prompts  # type: ignore[return-value]


def to_token_ids(engine: LLMEngine, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(the prompt's text if it has one, its token ids): a string is encoded with special tokens, as the server
    encodes a completion prompt; a list of ints is the token ids themselves (vLLM's TokensPrompt)."""
    if isinstance(prompt, str):
        return prompt, engine.tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list):
        if not all(isinstance(t, int) for t in prompt):
            raise TypeError("Token prompt should be a list of integers")  # vLLM's words
        return None, list(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt.get("prompt"), list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError("Prompt text should be a string")  # vLLM's words
        return to_token_ids(engine, prompt["prompt"])
    raise TypeError(
        f"a prompt is a string, a list of token ids or a dict with prompt_token_ids, got {type(prompt).__name__}"
    )


def multimodal(engine: LLMEngine, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], MultimodalInput | None]:
    """(expanded token ids, the processed images and videos) for a prompt with multi_modal_data."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if not data:
        return token_ids, None
    processor = engine.frontend.mm_processor
    if processor is None:
        raise ValueError("this model serves text only (no vision tower): multi_modal_data is refused")
    media = loaded_media(data, processor.configs.video.fps or 2.0)
    return processor.process_loaded(token_ids, media)


class OfflineRequests:
    """The requests of one offline LLM: their ids, the pending ones' states, and the engine loop."""

    def __init__(self, engine: LLMEngine, max_logprobs: int) -> None:
        self.engine = engine
        self.max_logprobs = max_logprobs
        self._ids = itertools.count()
        self.pending: dict[str, RequestState] = {}  # added, not yet returned by run()
        self.counts = RequestCounts()

    def _checked(
        self,
        prompts: SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams],
        priority: SequenceABC[int] | int | None,
    ) -> tuple[list[SamplingParams], list[int]]:
        """(params, priority) per prompt, after every check that needs no engine state."""
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(
                f"The lengths of prompts ({len(prompts)}) and params ({len(params_list)}) must be the same."
            )
        if priority is None or isinstance(priority, int):
            priorities = [priority or 0] * len(prompts)
        else:
            priorities = list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(
                f"The lengths of prompts ({len(prompts)}) and priority ({len(priorities)}) must be the same."
            )
        for value in priorities:
            check_priority(value, self.engine.config.scheduling_policy)
        for params in params_list:
            error = logprobs_cap_error(params.logprobs, params.prompt_logprobs, self.max_logprobs,
                                       self.engine.frontend.vocab_size)  # fmt: skip
            if error is not None:
                raise ValueError(error[0])
        for prompt in prompts:
            check_cache_salt(salt_of(prompt))
        return params_list, priorities

    def add(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams],
        priority: SequenceABC[int] | int | None = None,
        use_tqdm: UseTqdm = False,
        desc: str = "Adding requests",
    ) -> list[str]:
        """Adds the prompts' requests to the engine (without stepping it); their ids, in prompt order."""
        prompts = prompt_to_seq(prompts)
        params_list, priorities = self._checked(prompts, sampling_params, priority)
        request_ids: list[str] = []
        try:
            for prompt, params, request_priority in progress_bar(
                use_tqdm, list(zip(prompts, params_list, priorities, strict=True)), desc=desc
            ):
                text, token_ids = to_token_ids(self.engine, prompt)
                token_ids, mm_input = multimodal(self.engine, prompt, token_ids)
                request_id = str(next(self._ids))
                self.engine.add_request(
                    request_id, token_ids, params, prompt=text, mm_input=mm_input, priority=request_priority,
                    cache_salt=salt_of(prompt),
                )  # fmt: skip
                request_ids.append(request_id)
                self.pending[request_id] = self.engine.requests[request_id]
        except BaseException:
            # a prompt the engine refused (too long, out of vocabulary, ...): the ones this call added go too, so
            # the call adds all of its prompts or none
            self.abort(request_ids)
            raise
        return request_ids

    def abort(self, request_ids: SequenceABC[str]) -> None:
        """Aborts these requests in the engine and forgets them."""
        for request_id in request_ids:
            self.pending.pop(request_id, None)
            if request_id in self.engine.requests:
                self.engine.abort_request(request_id)

    def run(self, use_tqdm: UseTqdm = True) -> list[RequestOutput]:
        """Steps the engine until every request finished; the pending ones' final outputs by numeric id."""
        with progress_bar(use_tqdm, total=len(self.pending), desc="Processed prompts") as progress:
            try:
                while self.engine.has_unfinished():
                    for output in self.engine.step():
                        if output.finished:
                            progress.update(1)
            except BaseException:
                # a step that raised (a model error, Ctrl-C) leaves its requests scheduled with no step in flight:
                # abort them so they free their blocks and slots and the next call does not wait on them forever
                self.abort(list(self.pending))
                raise
        outputs = [self.pending[request_id].final_output() for request_id in sorted(self.pending, key=int)]
        self.pending.clear()
        for output in outputs:
            self.counts.observe(output)
        return outputs
