"""A launched step's speculative state (SpecHandle) and its way to the host (docs/speculative-decoding.md).

The runner makes a SpecHandle for every step while speculating: its verify chunks' layout, the target's forward for
the drafter, then the accept step's device results. `to_host` starts the host copies of the accepted tokens (the
step's event marks their end) and drops what the drafter no longer needs; `drafts_to_host` and `drafts_of` carry a
deferred step's drafts to the host for the grammars' masks; `collect_tokens` fills a collected step's
per-sequence tokens (a verify chunk's accepted run) and logprobs from those copies, and counts the accepted drafts
in the request table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_layout import SpecLayout
from deltaserve.sampler import logprobs_to_host
from deltaserve.sampler.transfer import to_device

if TYPE_CHECKING:  # annotations only: runner/spec_graphs.py imports this module (through runner/drafter.py)
    from deltaserve.runner.inputs import StepInputs, StepLayout
    from deltaserve.runner.spec_graphs import VerifyGraphs


@dataclass
class SpecHandle:
    """A launched step's speculative state: its verify chunks (None when it has none) and the target's forward for
    the drafter; then the accept step's device results and their host copies (collect reads them)."""

    layout: SpecLayout | None
    keys: np.ndarray | None  # [S] the verify rows' occupant keys at launch (a row reused since is not counted)
    is_random: np.ndarray | None = None  # [S] the verify rows that sample randomly (host)
    inputs: StepInputs | None = None  # the eager forward's inputs
    step_layout: StepLayout | None = None
    hidden: torch.Tensor | None = None  # [T, H]
    tokens: torch.Tensor | None = None  # [S, W] accepted tokens, -1 padding
    num_emitted: torch.Tensor | None = None  # [S]
    # a deferred step's drafts [S, k] on their way to the host (pinned copy) and the event that ends the copy
    drafts: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
    # the target forward ran as a verify graph whose post-sampling replay commits the GDN states, saves the MTP
    # hidden rows and drafts (runner/spec_graphs.py): accept() leaves those to it
    is_graphed: bool = False
    graphs: VerifyGraphs | None = None  # the graphs whose post-sampling replay that is (is_graphed)
    num_drafts_next: int | None = None  # the plan's StepPlan.num_drafts_next: drafts to propose after the step


def drafts_to_host(draft_tokens: torch.Tensor, layout: SpecLayout) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Starts copying the verify rows' drafts to the host (the grammars of a deferred step need them)."""
    verify_rows = layout.draft_rows[np.cumsum(layout.num_drafts) - 1]  # [S] each chunk's table row
    rows = to_device(verify_rows, torch.int64, draft_tokens.device)
    drafts = draft_tokens.index_select(0, rows)  # [S, k_max]
    if not is_cuda(drafts.device):
        return drafts, None
    host = torch.empty(drafts.shape, dtype=drafts.dtype, pin_memory=True)
    host.copy_(drafts, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def drafts_of(handle: SpecHandle) -> dict[int, list[int]]:
    """The step's verified drafts from their host copy (waiting for it if it has not landed), keyed by the
    verifying sequence's index in the step's plan (plan.seqs)."""
    drafts, event = handle.drafts
    if event is not None:
        event.synchronize()
    layout = handle.layout
    values = drafts.tolist()
    return {int(i): values[s][:k] for s, (i, k) in enumerate(zip(layout.seq_index, layout.num_drafts, strict=True))}


def to_host(handle: SpecHandle) -> None:
    """Starts the host copies of the accepted tokens (the caller's event marks their end); drops the step's
    device tensors the drafter no longer needs."""
    handle.inputs = handle.step_layout = handle.hidden = None
    if handle.tokens is None:
        return
    for name in ("tokens", "num_emitted"):
        value = getattr(handle, name)
        if is_cuda(value.device):
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            setattr(handle, name, host.copy_(value, non_blocking=True))


def collect_tokens(handle: SpecHandle, table: RequestTable, vocab_size: int, token_ids: list, logprobs: list) -> None:
    """Fills a collected step that holds verify chunks (a step without one is collected as any other) with its
    per-sequence tokens (and logprobs) from its host copies: a verify chunk's accepted tokens, one token for the
    others. The table's output counts gain the accepted drafts (record_sampled counted one token per sequence at
    launch)."""
    spec: SpecHandle = handle.spec
    layout = spec.layout
    sampled = handle.sampled.token_ids.tolist()  # [P]
    emitted = spec.tokens.tolist()
    num_emitted = spec.num_emitted.tolist()
    per_position = None
    if handle.num_logprobs is not None:
        per_position = logprobs_to_host(handle.sampled, sampled, handle.num_logprobs, vocab_size)
    offsets = layout.sample_offsets
    verify_of = {int(i): s for s, i in enumerate(layout.spec_sample_index)}
    for i, seq_index in enumerate(handle.sample_seqs.tolist()):
        first = int(offsets[i])
        s = verify_of.get(i)
        if s is None:
            tokens = (sampled[first],)
        else:
            tokens = tuple(emitted[s][: num_emitted[s]])
            row = int(handle.plan.seqs[seq_index].row)
            if table.keys[row] == spec.keys[s]:
                table.num_sampled[row] += num_emitted[s] - 1
        token_ids[seq_index] = tokens
        if per_position is not None and per_position[first] is not None:
            logprobs[seq_index] = tuple(per_position[first : first + len(tokens)])
