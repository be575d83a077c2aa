"""RequestState: one request's n sequences as the engine tracks them, and the outputs it reports.

It turns sampled tokens into text (incremental detokenizer per sequence), applies vLLM's stop rules
(eos, stop_token_ids, stop strings, max_tokens, max_model_len, min_tokens) and produces RequestOutputs:
deltas (only what is new since the last report) for streams, cumulative ones for LLM.generate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deltaserve.engine.request import CompletionOutput, FinishReason, Logprob, RequestOutput
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.sequence import Sequence


@dataclass
class SequenceProgress:
    seq: Sequence
    detokenizer: object  # IncrementalDetokenizer
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
    num_reported_tokens: int = 0  # how many output tokens earlier deltas carried
    has_reported_finish: bool = False
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text: str = ""  # cumulative text handed out so far

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    sequences: list[SequenceProgress]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

    def append_token(self, index: int, token_id: int, logprobs: list[tuple[int, float, int]] | None) -> None:
        """Records one sampled token for sequence `index` and decides whether that sequence stops."""
        progress = self.sequences[index]
        seq, params = progress.seq, self.params
        seq.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if logprobs:
            progress.cumulative_logprob += logprobs[0][1]
            if params.logprobs is not None:
                entry: dict[int, Logprob] = {}
                for tok, logprob, rank in logprobs:
                    if tok not in entry:
                        entry[tok] = Logprob(logprob, rank, progress.detokenizer.decode_token(tok))
                progress.logprobs.append(entry)
        num_out = len(seq.output_token_ids)
        may_stop = num_out >= params.min_tokens
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            progress.finish_reason = FinishReason.STOP.value
        elif may_stop and token_id in params.stop_token_ids:
            progress.finish_reason, progress.stop_reason = FinishReason.STOP.value, token_id
        # A sequence ending on eos / a stop token id drops that token's text unless include_stop_str_in_output.
        is_stop_token = progress.finish_reason is not None
        stop_string = progress.detokenizer.add_tokens([token_id], is_stop_terminated=is_stop_token)
        if stop_string is not None and not is_stop_token:
            progress.finish_reason, progress.stop_reason = FinishReason.STOP.value, stop_string
        if progress.finish_reason is None and (num_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            progress.finish_reason = FinishReason.LENGTH.value

    def abort(self) -> None:
        for progress in self.sequences:
            if not progress.is_finished:
                progress.finish_reason = FinishReason.ABORT.value

    def delta_output(self) -> RequestOutput:
        """What is new since the last call, for the sequences that progressed or finished."""
        outputs = []
        for index, progress in enumerate(self.sequences):
            if progress.has_reported_finish:
                continue
            token_ids = progress.seq.output_token_ids
            if len(token_ids) == progress.num_reported_tokens and not progress.is_finished:
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
                    cumulative_logprob=progress.cumulative_logprob,
                    logprobs=progress.logprobs[start:] if self.params.logprobs is not None else None,
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
        )

    def final_output(self) -> RequestOutput:
        """The cumulative result (LLM.generate)."""
        outputs = [
            CompletionOutput(
                index=index,
                text=progress.text,
                token_ids=list(progress.seq.output_token_ids),
                cumulative_logprob=progress.cumulative_logprob,
                logprobs=progress.logprobs if self.params.logprobs is not None else None,
                finish_reason=progress.finish_reason,
                stop_reason=progress.stop_reason,
            )
            for index, progress in enumerate(self.sequences)
        ]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.is_finished)
