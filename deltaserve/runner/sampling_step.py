"""The sampling half of a runner step: the StepHandle that execute() returns, the sampler call (with the accept
step and the drafter while speculating, runner/spec_step.py), the broadcast of the sampled tokens to the other
tensor-parallel ranks (and what those ranks do instead of sampling), the non-blocking copies of the outputs to
pinned host memory, and collect's turning of a finished handle into the StepResult.

ModelRunner (runner/model_runner.py) owns every piece of state these functions read or write (the request table,
the sampler, the SpecDecoder and the verify graphs); it passes them in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.model.parallel import TensorParallel
from deltaserve.runner import prompt_logprobs as plp
from deltaserve.runner import spec_handle
from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.observer import StepObserver, StepTimings
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_chain import record_next_starts
from deltaserve.runner.spec_decode import SpecDecoder
from deltaserve.runner.spec_handle import SpecHandle, collect_tokens
from deltaserve.runner.spec_ranks import receive_accepted, send_accepted
from deltaserve.runner.spec_step import accept_verified, draft_after_sampling
from deltaserve.sampler import Sampler, SamplerOutput, SamplingBatch, logprobs_to_host
from deltaserve.step import StepPlan, StepResult


@dataclass
class StepHandle:
    """A launched step: what collect() needs to turn it into a StepResult."""

    plan: StepPlan
    sample_seqs: np.ndarray  # [S] indices into plan.seqs
    sampled: SamplerOutput | None  # host copies (pinned) of the sampler's outputs, once the event completes
    num_logprobs: tuple[int, ...] | None
    event: torch.cuda.Event | None
    all_logits: torch.Tensor | None = None  # [T, V] fp32, only when a chunk has return_logits
    # defer_sampling: (logits [S, V], table rows [S], their device copy, the batch) until sample() is called
    pending: tuple[torch.Tensor, np.ndarray, torch.Tensor, SamplingBatch] | None = None
    prompt_logprobs: plp.PromptLogprobsOutput | None = None  # host copies once prompt_event completes
    prompt_event: torch.cuda.Event | None = None
    # host perf_counter() stamps of execute(), taken only while a step observer is registered
    launch_started: float = 0.0
    launched_at: float = 0.0
    spec: SpecHandle | None = None  # the step's verify chunks (speculative decoding)


def sample_step(
    handle: StepHandle, logits: torch.Tensor, rows: np.ndarray, rows_dev: torch.Tensor, batch: SamplingBatch,
    sampler: Sampler, table: RequestTable, tp: TensorParallel, decoder: SpecDecoder | None, block_size: int,
    device: torch.device,
) -> None:  # fmt: skip
    """Rank 0's sampling of a launched step: logits [S, V] of the sampling rows (table rows [S], rows_dev their
    device copy); the accept step and the drafter while speculating; the tokens to the other ranks and into the
    table; the outputs on their way to the host."""
    out = sampler(logits, batch)
    tokens = out.token_ids  # [S]: each sampling sequence's next input
    if handle.spec is not None and handle.spec.layout is not None:
        tokens = accept_verified(decoder, handle.spec, out, batch, sampler, table, rows)
    send_accepted(tp, tokens, handle.spec)  # the other ranks' follow_first
    table.record_sampled(rows, rows_dev, tokens)
    if handle.spec is not None:
        if decoder.tracks_next_start:  # where each row's next chunk really starts (async verify)
            record_next_starts(table, handle.spec, rows_dev)
        draft_after_sampling(decoder, handle.spec, table, block_size, rows, rows_dev, tokens, handle.plan)
        spec_handle.to_host(handle.spec)  # before to_host's event, which collect waits on for these copies too
    handle.sampled, handle.event = to_host(out, device)


def follow_first(
    spec: SpecHandle | None, rows: np.ndarray, rows_dev: torch.Tensor, table: RequestTable, tp: TensorParallel,
    decoder: SpecDecoder | None, block_size: int, device: torch.device,
) -> None:  # fmt: skip
    """A rank other than 0 after a sampling step: rank 0 samples (it alone has the gathered logits) and decides
    the verify chunks' acceptance; this rank receives the tokens (its next inputs) and the accepted counts,
    commits the same GDN states and runs its drafter on the same inputs (runner/spec_ranks.py)."""
    tokens = receive_accepted(tp, len(rows), spec, device)
    if spec is not None and decoder.tracks_next_start:  # from rank 0's accepted counts, as rank 0 does
        record_next_starts(table, spec, rows_dev)
    if spec is not None and spec.is_graphed:  # rank 0 replays its post-sampling graph: so does this rank
        table.record_sampled(rows, rows_dev, tokens)
        # the verify chunks follow the plain decodes; a step without any holds plain decodes alone
        num_decodes = len(rows) if spec.layout is None else int(spec.layout.seq_index[0])
        num_drafts = decoder.num_drafts_after(spec.num_drafts_next)
        spec.graphs.draft(tokens, spec.tokens, spec.num_emitted, num_decodes, num_drafts)
        return
    if spec is not None and spec.layout is not None:
        decoder.commit(spec)
    table.record_sampled(rows, rows_dev, tokens)
    if spec is not None:  # its collectives meet rank 0's drafter's
        decoder.propose(spec, table, block_size, rows, rows_dev, tokens)


def to_host(out: SamplerOutput, device: torch.device) -> tuple[SamplerOutput, torch.cuda.Event | None]:
    """Starts non-blocking copies of the sampler's outputs into pinned memory; the event marks their end."""
    if not is_cuda(device):
        return out, None

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    host = SamplerOutput(
        token_ids=copy(out.token_ids), logprob_rows=out.logprob_rows, sampled_logprobs=copy(out.sampled_logprobs),
        sampled_ranks=copy(out.sampled_ranks), top_ids=copy(out.top_ids), top_logprobs=copy(out.top_logprobs),
    )  # fmt: skip
    event = torch.cuda.Event()
    event.record()
    return host, event


def collect_step(handle: StepHandle, table: RequestTable, vocab_size: int, observer: StepObserver | None) -> StepResult:
    """Waits for a launched step's tokens and returns them in the plan's sequence order; with an observer, calls
    it with the plan, the result and the step's host timings."""
    if observer is None:
        return step_result(handle, table, vocab_size)
    started = time.perf_counter()
    if handle.pending is None:  # (a deferred step's error is step_result's to raise)
        for event in (handle.prompt_event, handle.event):
            if event is not None:
                event.synchronize()
    waited = time.perf_counter()
    result = step_result(handle, table, vocab_size)  # its events are complete: it does not wait again
    done = time.perf_counter()
    if not handle.plan.is_empty and handle.launched_at:
        timings = StepTimings(
            launch_s=handle.launched_at - handle.launch_started, wait_s=waited - started,
            collect_s=done - started, launched_at=handle.launched_at, collected_at=done,
        )  # fmt: skip
        observer(handle.plan, result, timings)
    return result


def step_result(handle: StepHandle, table: RequestTable, vocab_size: int) -> StepResult:
    """The StepResult of a launched step, once its host copies are complete (it waits for them)."""
    plan = handle.plan
    token_ids: list[tuple[int, ...]] = [()] * len(plan.seqs)
    logprobs: list = [None] * len(plan.seqs)
    if handle.pending is not None:
        raise RuntimeError(f"step {plan.step_id} was collected before its deferred sampling ran")
    prompt_logprobs: tuple = ()
    if handle.prompt_logprobs is not None:
        if handle.prompt_event is not None:
            handle.prompt_event.synchronize()
        prompt_logprobs = tuple(plp.to_plain(handle.prompt_logprobs, len(plan.seqs)))
    if handle.sampled is not None and handle.event is not None:
        handle.event.synchronize()
    if handle.sampled is not None and handle.spec is not None and handle.spec.layout is not None:
        collect_tokens(handle, table, vocab_size, token_ids, logprobs)
    elif handle.sampled is not None:  # one token a sampling sequence
        sampled = handle.sampled.token_ids.tolist()
        per_row = None
        if handle.num_logprobs is not None:
            per_row = logprobs_to_host(handle.sampled, sampled, handle.num_logprobs, vocab_size)
        for i, seq_index in enumerate(handle.sample_seqs.tolist()):
            token_ids[seq_index] = (sampled[i],)
            if per_row is not None and per_row[i] is not None:
                logprobs[seq_index] = (per_row[i],)
    has_logprobs = any(entry is not None for entry in logprobs)
    return StepResult(
        plan.step_id,
        tuple(token_ids),
        tuple(logprobs) if has_logprobs else (),
        prompt_logprobs=prompt_logprobs,
        logits=logits_to_host(plan, handle.all_logits),
    )


def logits_to_host(plan: StepPlan, all_logits: torch.Tensor | None) -> tuple[bytes | None, ...]:
    """The logits of each chunk with return_logits, as StepResult carries them (raw fp32 bytes)."""
    if all_logits is None:
        return ()
    host = all_logits.float().cpu().numpy()  # [T, V]
    chunks: list[bytes | None] = []
    start = 0
    for seq in plan.seqs:
        end = start + seq.num_new_tokens
        chunks.append(host[start:end].tobytes() if seq.return_logits else None)
        start = end
    return tuple(chunks)
