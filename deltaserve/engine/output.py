"""The front end's view of each request: its n sequences' text, logprobs and finish, turned into RequestOutputs.

The core applies the token rules (eos, stop_token_ids, max_tokens, max_model_len) and reports new tokens; here they
become text (an incremental detokenizer per sequence), stop strings are found (the core is then told to abort the
sequence, as vLLM's output processor does), and RequestOutputs are produced: deltas (only what is new since the
last report) for streams, cumulative ones for LLM.generate. This runs in the API process (or the caller's), never
on the server's event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deltaserve.engine.detokenizer import IncrementalDetokenizer, TokenIdsOnly
from deltaserve.engine.flat_logprobs import FlatLogprobs, new_logprobs
from deltaserve.engine.protocol import EngineCoreOutput
from deltaserve.engine.request import CompletionOutput, FinishReason, Logprob, RequestOutput
from deltaserve.engine.stats import RequestMetrics
from deltaserve.sampling_params import SamplingParams


def slice_prompt_logprobs(first: int, entries: tuple, num_reported: int) -> tuple:
    """The entries of targets first, first + 1, ... that come after the num_reported already reported (targets
    1..num_reported): a resumed sequence recomputes its prompt and must not report it twice."""
    skip = num_reported + 1 - first
    if skip < 0:
        raise ValueError(f"prompt logprobs start at position {first} but only {num_reported} were reported")
    return tuple(entries[skip:])


@dataclass
class SequenceProgress:
    core_id: str  # the core request this sequence is
    detokenizer: IncrementalDetokenizer | TokenIdsOnly
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
    num_reported_tokens: int = 0  # how many output tokens earlier deltas carried
    has_reported_finish: bool = False
    logprobs: list[dict[int, Logprob]] | FlatLogprobs = field(default_factory=list)  # FlatLogprobs: flat_logprobs
    text: str = ""  # cumulative text handed out so far
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prefix-cache hits at admission, from the sequence's first output
    # prompt tokens its prefill cached, from its first output with a token (vLLM's: with the first token)
    num_cache_creation_tokens: int | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceProgress]
    arrival_time: float = field(default_factory=time.time)
    # [None] + one per prompt token when asked (FlatLogprobs, whose first position reads {}, with flat_logprobs)
    prompt_logprobs: list[dict[int, Logprob] | None] | FlatLogprobs | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = new_logprobs(self.params.flat_logprobs)
            self.prompt_logprobs.append(None)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

    def _add_prompt_logprobs(self, progress: SequenceProgress, entries: tuple) -> None:
        for targets in entries:
            # a split character is rebuilt from the prompt tokens before this one, as vLLM (not the first: its
            # entry is None, and vLLM takes its context from the entries)
            position = len(self.prompt_logprobs)
            context = self.prompt_token_ids[max(1, position - 4) : position]
            entry: dict[int, Logprob] = {}
            for tok, logprob, rank in targets:
                if tok not in entry:
                    entry[tok] = Logprob(logprob, rank, progress.detokenizer.decode_token(tok, context=context))
            self.prompt_logprobs.append(entry)

    def apply(self, index: int, output: EngineCoreOutput) -> bool:
        """Records a core output for sequence `index`. True when a stop string ended the sequence while the core
        still runs it (the caller aborts it there)."""
        progress = self.sequences[index]
        if progress.num_cached_tokens is None:
            progress.num_cached_tokens = output.num_cached_tokens
        if progress.num_cache_creation_tokens is None and (output.new_token_ids or output.finish_reason is not None):
            progress.num_cache_creation_tokens = output.num_cache_creation_tokens
        if output.prompt_logprobs and index == 0 and self.prompt_logprobs is not None:
            # the n sequences share the prompt: the first one's are reported
            self._add_prompt_logprobs(progress, output.prompt_logprobs)
        if progress.is_finished:
            return False
        params = self.params
        num_new = len(output.new_token_ids)
        for i, token_id in enumerate(output.new_token_ids):
            progress.token_ids.append(token_id)
            logprobs = output.new_logprobs[i] if output.new_logprobs is not None else None
            if logprobs:
                progress.cumulative_logprob += logprobs[0][1]
                if params.num_logprobs is not None:
                    # vLLM's dict: the sampled token's key first; a later entry of the same token (a candidate or a
                    # listed id) replaces its value (its rank: the candidate's place) and keeps that first place
                    entry: dict[int, Logprob] = {}
                    for tok, logprob, rank in logprobs:
                        entry[tok] = Logprob(logprob, rank, progress.detokenizer.decode_token(tok))
                    progress.logprobs.append(entry)
            is_last = i == num_new - 1
            # a sequence ending on eos / a stop token id drops that token's text unless include_stop_str_in_output
            is_stop_token = is_last and output.finish_reason == FinishReason.STOP.value
            stop_string = progress.detokenizer.add_tokens([token_id], is_stop_terminated=is_stop_token)
            if stop_string is not None and not is_stop_token:
                progress.finish_reason, progress.stop_reason = FinishReason.STOP.value, stop_string
                progress.metrics = output.metrics
                return output.finish_reason is None
        if output.finish_reason is not None:
            progress.finish_reason, progress.stop_reason = output.finish_reason, output.stop_reason
            progress.metrics = output.metrics
        return False

    def abort(self) -> None:
        for progress in self.sequences:
            if not progress.is_finished:
                progress.finish_reason = FinishReason.ABORT.value

    @property
    def num_cached_tokens(self) -> int:
        """The request's prefix-cache hits: its first sequence's that has reported (the n sequences share the
        prompt), 0 before any output."""
        known = [p.num_cached_tokens for p in self.sequences if p.num_cached_tokens is not None]
        return known[0] if known else 0

    @property
    def num_cache_creation_tokens(self) -> int:
        """The prompt tokens past the hits that the request's prefill left in the prefix cache (the same first
        sequence's), 0 before any output."""
        known = [p.num_cache_creation_tokens for p in self.sequences if p.num_cache_creation_tokens is not None]
        return known[0] if known else 0

    def _metrics(self) -> RequestMetrics | None:
        """The request's engine timestamps once it finished: earliest schedule and token, latest token."""
        parts = [s.metrics for s in self.sequences if s.metrics is not None]
        if not self.is_finished or not parts:
            return None

        def first(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return min(known) if known else None

        last_tokens = [p.last_token_time for p in parts if p.last_token_time is not None]
        return RequestMetrics(
            arrival_time=min(p.arrival_time for p in parts),
            first_scheduled_time=first([p.first_scheduled_time for p in parts]),
            first_token_time=first([p.first_token_time for p in parts]),
            last_token_time=max(last_tokens) if last_tokens else None,
            num_preemptions=sum(p.num_preemptions for p in parts),
        )

    def _cumulative_logprob(self, progress: SequenceProgress) -> float | None:
        """vLLM's: the sum of the sampled tokens' logprobs when logprobs were asked for, else None."""
        return progress.cumulative_logprob if self.params.num_logprobs is not None else None

    def delta_output(self, stream_interval: int = 1) -> RequestOutput:
        """What is new since the last call, for the sequences that progressed or finished. stream_interval (vLLM's):
        an unfinished sequence that reported tokens before waits until that many new ones gathered."""
        outputs = []
        for index, progress in enumerate(self.sequences):
            if progress.has_reported_finish:
                continue
            token_ids = progress.token_ids
            num_new = len(token_ids) - progress.num_reported_tokens
            if not progress.is_finished and (
                num_new == 0 or (progress.num_reported_tokens and num_new < stream_interval)
            ):
                continue
            text = progress.detokenizer.take_delta(progress.is_finished)
            start = progress.num_reported_tokens
            progress.num_reported_tokens = len(token_ids)
            progress.text += text
            progress.has_reported_finish = progress.is_finished
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(token_ids[start:]),
                    cumulative_logprob=self._cumulative_logprob(progress),
                    logprobs=progress.logprobs[start:] if self.params.num_logprobs is not None else None,
                    finish_reason=progress.finish_reason,
                    stop_reason=progress.stop_reason,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.is_finished,
            num_cached_tokens=self.num_cached_tokens,
            num_cache_creation_tokens=self.num_cache_creation_tokens,
            metrics=self._metrics(),
            prompt_logprobs=self.prompt_logprobs,
        )

    def final_output(self) -> RequestOutput:
        """The cumulative result (LLM.generate)."""
        outputs = [
            CompletionOutput(
                index=index,
                text=progress.text,
                token_ids=list(progress.token_ids),
                cumulative_logprob=self._cumulative_logprob(progress),
                logprobs=progress.logprobs if self.params.num_logprobs is not None else None,
                finish_reason=progress.finish_reason,
                stop_reason=progress.stop_reason,
            )
            for index, progress in enumerate(self.sequences)
        ]
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outputs, self.is_finished,
            num_cached_tokens=self.num_cached_tokens, num_cache_creation_tokens=self.num_cache_creation_tokens,
            metrics=self._metrics(), prompt_logprobs=self.prompt_logprobs,
        )  # fmt: skip
