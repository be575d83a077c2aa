"""The start-up warm-up's verify step: while speculating, one eager verify step as large as the engine may serve,
run on a throw-away cache through the runner's own execute() (the target forward over B rows of 1 + k tokens with
their drafts, the sampler and the accept rule over every position, the state commit, and the MTP drafter's pass and
chained passes), so its activations join the measured peak (runner/warmup.py) instead of coming out of the fixed
headroom (docs/speculative-decoding.md#memory).

The plans are plain data built by verify_warmup_plans: B fresh one-token prompts that sample (the drafter drafts k
tokens for each after that step), then one plain decode a row (no drafts: the eager decode path a served step takes
when a row may not draft, near max_tokens or max_model_len, so its kernels compile here and not while serving:
docs/kernels.md#compiles-while-serving), then a verify chunk of 1 + k tokens on each row, then the rows' removal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deltaserve.runner.cache import CacheLayout, allocate_and_bind
from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.mtp_drafter import MtpDrafter
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_decode import SpecDecoder
from deltaserve.runner.spec_layout import STATE_SHARE, scratch_rows, speculating_seqs
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import NewRequest, ScheduledSeq, StepPlan, StepResult

if TYPE_CHECKING:  # runner/model_runner.py imports runner/memory.py, which imports runner/warmup.py, which imports
    # this module
    from deltaserve.runner.model_runner import ModelRunner

PROMPT_LEN = 1  # each warm-up row's prompt: its verify chunk then covers positions 1 .. 1 + k


class PeakMeter:
    """The peak of allocated device memory since mark(), in bytes; 0 off CUDA (the CPU runs the same steps
    unmeasured: its cache is sized by kv_cache_memory_bytes or cpu_kv_cache_bytes)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    @property
    def is_measuring(self) -> bool:
        return is_cuda(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.is_measuring else 0

    def mark(self) -> None:
        if self.is_measuring:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        if not self.is_measuring:
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


def verify_warmup_rows(
    num_speculative_tokens: int, max_num_seqs: int, max_num_batched_tokens: int, budget_bytes: int, slot_bytes: int,
    row_bytes: int, is_sized: bool = False, has_policy: bool = False,
) -> int:  # fmt: skip
    """The verify chunks of the warm-up's verify step: the most a served step may hold, as the scheduler caps them:
    at most max_num_seqs, at most the sequences whose verify scratch budget_bytes affords (runner/spec_layout.py
    speculating_seqs: in half of it for vLLM's default count sized to memory, is_sized; in all of it beside a
    count the user set; under the k policy, has_policy, scratch_rows' quarter; the scheduler's
    SpecSchedule.max_verifies), and as many chunks of 1 + k tokens as the step's token budget holds. Not the
    largest verify-graph bucket (512 tokens): a larger verify step runs eager, and eager activations are what the
    warm-up measures. Given an upper bound of the cache budget (the budget before the verify step's own peak is
    taken out), this is at least the largest verify step the engine will serve, and its throw-away scratch fits
    where the served one will."""
    k = num_speculative_tokens
    by_tokens = max(1, max_num_batched_tokens // (1 + k))
    by_memory = speculating_seqs(budget_bytes, slot_bytes, row_bytes, max_num_seqs, STATE_SHARE if is_sized else 1.0)
    if has_policy:
        by_memory = scratch_rows(budget_bytes, row_bytes, max_num_seqs)
    return min(max_num_seqs, by_memory, by_tokens)


def verify_warmup_plans(
    first_step_id: int, num_seqs: int, num_speculative_tokens: int, block_size: int, vocab_size: int
) -> tuple[StepPlan, StepPlan, StepPlan, StepPlan]:
    """(the prefill, the plain decode step, the verify step, the removal) of num_seqs rows 0, 1, ... with state
    slots 0, 1, ... and disjoint KV blocks (verify_warmup_blocks each) of a throw-away cache. Every row samples at
    random with top-k / top-p (the random accept rule: the sampler keeps the target's distributions, the [S, k, V]
    draws)."""
    k = num_speculative_tokens
    blocks = verify_warmup_blocks(k, block_size)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    added = tuple(
        NewRequest(row, f"warmup-verify-{row}", ((7 * row + 1) % vocab_size,) * PROMPT_LEN, (), params, ())
        for row in range(num_seqs)
    )
    prefill = tuple(
        ScheduledSeq(row, 0, PROMPT_LEN, row, None, tuple(range(row * blocks, (row + 1) * blocks)), True)
        for row in range(num_seqs)
    )
    # the row's sampled token alone, as a row that may not draft decodes it
    decode = tuple(ScheduledSeq(row, PROMPT_LEN, 1, row, row, (), True) for row in range(num_seqs))
    # the decode's sampled token, then the k drafts the drafter proposed after that step
    verify = tuple(
        ScheduledSeq(row, PROMPT_LEN + 1, 1 + k, row, row, (), True, num_draft_tokens=k) for row in range(num_seqs)
    )
    rows = tuple(range(num_seqs))
    return (
        StepPlan(first_step_id, prefill, added, removed=rows),
        StepPlan(first_step_id + 1, decode),
        StepPlan(first_step_id + 2, verify),
        StepPlan(first_step_id + 3, (), removed=rows),
    )


def verify_warmup_blocks(num_speculative_tokens: int, block_size: int) -> int:
    """KV blocks a warm-up row holds: its prompt, the plain decode's token, the verify chunk's 1 + k tokens and the
    k - 1 positions past them that the MTP drafter's chained passes write (the scheduler's lookahead)."""
    return -(-(PROMPT_LEN + 1 + 2 * num_speculative_tokens) // block_size)


def warm_up_verify(runner: ModelRunner, num_seqs: int, meter: PeakMeter, first_step_id: int = 0) -> StepResult:
    """Runs the verify warm-up's plans through runner.run on a throw-away cache of num_seqs rows: KV blocks, state
    slots, a request table and a SpecDecoder (its verify scratch, the MTP drafter) of their own, allocated before
    meter.mark() so that only the steps' activations count. Leaves the throw-away cache bound (the caller drops it)
    and the runner's own table and SpecDecoder as they were. Returns the verify step's result (rank 0's)."""
    speculative = runner.engine_config.speculative_config
    k = speculative.num_speculative_tokens
    blocks = verify_warmup_blocks(k, runner.block_size)
    layout = CacheLayout(num_seqs * blocks, runner.block_size, num_seqs, 0, 0)
    allocate_and_bind(runner.model, runner.model_config, layout, runner.dtype, runner.device)
    saved_table, saved_spec = runner.table, runner.spec
    runner.table = RequestTable(num_seqs, blocks, runner.vocab_size, runner.device)
    runner.spec = SpecDecoder(runner.model, num_seqs, k, MtpDrafter(runner.model, k), runner.device,
                              speculative.synthetic_acceptance_rates, num_seqs)  # fmt: skip
    try:
        meter.mark()
        prefill, decode, verify, removal = verify_warmup_plans(first_step_id, num_seqs, k, runner.block_size,
                                                               runner.vocab_size)  # fmt: skip
        runner.run(prefill)
        runner.run(decode)
        result = runner.run(verify)
        runner.run(removal)
    finally:
        runner.table, runner.spec = saved_table, saved_spec
    return result
