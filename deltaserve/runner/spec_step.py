"""The speculative-decoding glue of a runner step (docs/speculative-decoding.md): building the SpecDecoder's verify
graphs, the step's SpecHandle, the sampling batch of a step's verify positions, the accept step after the sampler,
and the drafter's call after every step (the post-sampling graph replay, or eager). runner/spec_decode.py holds
the verify chunks' own logic and runner/spec_graphs.py the graphs; ModelRunner (runner/model_runner.py) owns the
SpecDecoder and the graphs, and passes them in.
"""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.inputs import StepInputs, StepLayout
from deltaserve.runner.mtp_drafter import MtpDrafter
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_decode import SpecDecoder
from deltaserve.runner.spec_graphs import VerifyGraphs, max_verify_batch
from deltaserve.runner.spec_handle import SpecHandle, to_host
from deltaserve.sampler import Sampler, SamplerOutput, SamplingBatch
from deltaserve.sampler.sampler import SAMPLING_EPS
from deltaserve.speculative_config import SpeculativeConfig
from deltaserve.step import StepPlan


def spec_draft_counts(config: SpeculativeConfig | None) -> tuple[int, ...] | None:
    """The drafts a plan may ask the runner to propose after a step (StepPlan.num_drafts_next): 0 .. k where the
    scheduler runs a k policy (the deltaserve-only k_policy, or vLLM's num_speculative_tokens_per_batch_size), else
    None (k alone: vLLM's fixed k, or speculation off)."""
    if config is None or (config.k_policy is None and config.num_speculative_tokens_per_batch_size is None):
        return None
    return tuple(range(config.num_speculative_tokens + 1))


def build_verify_graphs(
    model: Qwen35Model, spec: SpecDecoder, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
    vocab_size: int, device: torch.device, block_size: int, capture: bool, draft_counts: tuple[int, ...] | None,
    width: int | None = None, pool: object = None,
) -> VerifyGraphs:  # fmt: skip
    """The verify graphs (runner/spec_graphs.py) over spec's scratch, captured; capture=False (tests, the CPU) runs
    their static-buffer code uncaptured. A drafter other than the MTP layer keeps its drafting (and the commit)
    eager. draft_counts: the drafts a plan may ask to propose (None: k alone, vLLM's fixed k). width: 1 builds the
    graphs of the all-decode steps without verify chunks (B rows of one token, the decode kernels, no scratch);
    None: the verify graphs, 1 + k tokens a row. pool: a captured graphs' memory pool to share (None: a new one)."""
    k = spec.num_speculative_tokens
    width = 1 + k if width is None else width
    max_batch = max_verify_batch(width - 1, max_num_seqs, spec.max_spec_seqs if width > 1 else max_num_seqs)
    drafts = spec.draft_tokens if isinstance(spec.drafter, MtpDrafter) else None  # else drafting stays eager
    graphs = VerifyGraphs(model, max_batch, k, max_blocks_per_seq, max_model_len, vocab_size, device, block_size,
                          drafts, capture, draft_counts, width, pool, spec.gdn_stacks)  # fmt: skip
    graphs.capture()
    return graphs


def step_spec_handle(
    layout: StepLayout, table: RequestTable, inputs: StepInputs, hidden: torch.Tensor, graphs: VerifyGraphs | None,
    is_verify_graphed: bool, defer_sampling: bool, num_drafts_next: int | None,
) -> SpecHandle:  # fmt: skip
    """The SpecHandle of an eager (or verify-graphed) step while speculating: its verify chunks' sampling keys and
    random flags, whether the post-sampling graph replays after sample(), and the drafts to propose after it (the
    plan's num_drafts_next)."""
    keys = is_random = None
    if layout.spec is not None:
        verify_rows = layout.rows[layout.sample_seqs][layout.spec.spec_sample_index]
        keys = table.keys[verify_rows]
        is_random = table.params_host[verify_rows, 0] >= SAMPLING_EPS
    spec = SpecHandle(layout.spec, keys, is_random, inputs, layout, hidden, num_drafts_next=num_drafts_next)
    # the post-sampling replay reads the static buffers: not when another step may replay before sample()
    spec.is_graphed = is_verify_graphed and graphs.has_drafter and not defer_sampling
    spec.graphs = graphs if spec.is_graphed else None
    return spec


def draft_without_sampling(
    decoder: SpecDecoder, spec: SpecHandle, table: RequestTable, block_size: int, layout: StepLayout,
    inputs: StepInputs,
) -> None:  # fmt: skip
    """A step that samples nothing still runs the drafter: its own KV follows the target's over every forward."""
    empty = layout.rows[:0]
    decoder.propose(spec, table, block_size, empty, inputs.sample_rows_dev[:0], inputs.input_ids[:0])
    to_host(spec)


def verify_sampling_batch(
    decoder: SpecDecoder, spec: SpecHandle, table: RequestTable, layout: StepLayout, inputs: StepInputs,
    rows: np.ndarray,
) -> SamplingBatch:  # fmt: skip
    """The sampling batch of a step with verify chunks: every position of a verify chunk samples as its row's next
    outputs; rows [n sampling seqs]."""
    counts = layout.spec.sample_counts
    batch = table.sampling_batch(np.repeat(rows, counts), inputs.position_rows_dev, layout.spec.position_offsets)
    # the random rule reads the target's distributions; it and the synthetic one emit drafts whose logprobs come
    # from the raw logprobs
    batch.keep_probs = bool(spec.is_random.any()) or decoder.synthetic_rates is not None
    decoder.add_draft_counts(batch, layout.spec, table, rows)
    return batch


def accept_verified(
    decoder: SpecDecoder, spec: SpecHandle, out: SamplerOutput, batch: SamplingBatch, sampler: Sampler,
    table: RequestTable, rows: np.ndarray,
) -> torch.Tensor:  # fmt: skip
    """The accept step over the sampler's outputs of a step with verify chunks, and the rows' acceptance counters;
    returns each sampling sequence's next input [S]."""
    tokens = out.token_ids
    last = decoder.last_positions(spec, tokens.device)
    shared = sampler._shared_generator(tokens.device)
    tokens = decoder.accept(spec, out, batch, shared, out.token_ids.index_select(0, last))
    decoder.count_accepted(table, spec.layout, rows, spec)
    return tokens


def draft_after_sampling(
    decoder: SpecDecoder, spec: SpecHandle, table: RequestTable, block_size: int, rows: np.ndarray,
    rows_dev: torch.Tensor, tokens: torch.Tensor, plan: StepPlan,
) -> None:  # fmt: skip
    """The drafter after a sampled step: the post-sampling graph (commit, hidden rows and drafts: one replay) where
    the step (plan) was verify-graphed, else the eager drafter."""
    if spec.is_graphed:
        num_drafts = decoder.num_drafts_after(spec.num_drafts_next)
        spec.graphs.draft(tokens, spec.tokens, spec.num_emitted, plan.num_decodes, num_drafts)
    else:
        decoder.propose(spec, table, block_size, rows, rows_dev, tokens)
