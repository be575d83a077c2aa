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
from deltaserve.engine.prompts import PromptType, multimodal, prompt_to_seq, salt_of, to_token_ids
from deltaserve.engine.request import RequestOutput
from deltaserve.sampling_params import SamplingParams, logprobs_cap_error

# vLLM's use_tqdm: a bool, or a callable that makes the bar (e.g. functools.partial(tqdm, leave=False))
UseTqdm = bool | Callable[..., Any]


def progress_bar(use_tqdm: UseTqdm, iterable: Any = None, **kwargs: Any) -> Any:
    """tqdm(iterable, **kwargs), disabled when use_tqdm is false; the caller's own bar factory when it is callable."""
    if callable(use_tqdm):
        return use_tqdm(iterable, **kwargs)
    return tqdm(iterable, disable=not use_tqdm, **kwargs)


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
                    request_id, token_ids, params, priority=request_priority, prompt_text=text, mm_input=mm_input,
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
                    for output in self.engine.step(by_output_kind=False):  # final outputs are built at the end
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
