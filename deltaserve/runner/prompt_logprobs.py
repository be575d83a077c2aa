"""Prompt logprobs, computed in the prefill: for the chunks of rows whose request asked, the logits of the chunk's
own positions (each predicts the next prompt token), in slices, so a step never holds [T, V] logits for prompts
that did not ask and at most SLICE_ROWS x V for those that did.

Position p of the original prompt predicts prompt token p + 1; a chunk covering [start, end) contributes targets
start + 1 .. min(end, P - 1) (P: the original prompt's length; the last prompt position predicts the first output
token, which the sampler reports). Per target: its logprob and rank (vLLM's: how many tokens have a logprob >= its
own), and the top-N. Results stay on the device until collect(), which turns them into plain tuples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.request_table import RequestTable
from deltaserve.sampler.transfer import to_device

SLICE_ROWS = 1024
# (first target position, per target: ((token, logprob, rank), top-1, ..., top-N)) of one sequence's chunk
PromptLogprobs = tuple[int, tuple[tuple[tuple[int, float, int], ...], ...]]


@dataclass
class PromptLogprobsWork:
    """One step's prompt-logprob rows: hidden-row indices, their target tokens and how they split per sequence."""

    seq_index: list[int]  # plan sequence index of each chunk that asked
    first_target: list[int]  # the prompt position of each chunk's first target
    counts: list[int]  # targets per chunk
    num_top: list[int]  # top-N per chunk
    hidden_rows: np.ndarray  # [K] rows of the step's hidden states
    targets: np.ndarray  # [K] the prompt tokens they predict


@dataclass
class PromptLogprobsOutput:
    work: PromptLogprobsWork
    target_logprobs: torch.Tensor  # [K] fp32
    ranks: torch.Tensor  # [K] int64
    top_ids: torch.Tensor | None  # [K, N]
    top_logprobs: torch.Tensor | None  # [K, N]


def plan_prompt_logprobs(
    table: RequestTable, rows: np.ndarray, starts: np.ndarray, num_new: np.ndarray, query_start_loc: np.ndarray
) -> PromptLogprobsWork | None:
    """The step's prompt-logprob rows, or None when no chunk of the step needs any."""
    asked = table.num_prompt_logprobs[rows]
    if not (asked >= 0).any():
        return None
    work = PromptLogprobsWork([], [], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64))
    hidden_rows, targets = [], []
    for i in np.nonzero(asked >= 0)[0].tolist():
        row = int(rows[i])
        start, end = int(starts[i]), int(starts[i] + num_new[i])
        last = min(end, int(table.num_original_prompt[row]) - 1)  # positions [start, last) have a prompt target
        if last <= start:
            continue
        work.seq_index.append(i)
        work.first_target.append(start + 1)
        work.counts.append(last - start)
        work.num_top.append(int(asked[i]))
        base = int(query_start_loc[i])
        hidden_rows.append(np.arange(base, base + last - start, dtype=np.int64))
        targets.append(table.prompts[row][start + 1 : last + 1])
    if not work.seq_index:
        return None
    work.hidden_rows = np.concatenate(hidden_rows)
    work.targets = np.concatenate(targets).astype(np.int64)
    return work


def compute_prompt_logprobs(
    work: PromptLogprobsWork,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    vocab_size: int,
) -> PromptLogprobsOutput | None:
    """Logprobs of the targets (and the top-N) from hidden [T, H], SLICE_ROWS rows of logits at a time; None
    where compute_logits returns None (tensor-parallel ranks other than 0)."""
    device = hidden.device
    index = to_device(work.hidden_rows, torch.int64, device)  # pinned: no wait for the stream
    targets = to_device(work.targets, torch.int64, device)
    max_top = min(max(n if n >= 0 else vocab_size for n in work.num_top), vocab_size)
    target_lp, ranks, top_ids, top_lp = [], [], [], []
    for lo in range(0, len(work.hidden_rows), SLICE_ROWS):
        logits = compute_logits(hidden.index_select(0, index[lo : lo + SLICE_ROWS]))  # [k, V]
        if logits is None:
            continue  # a tensor-parallel rank other than 0: the gather went to rank 0
        logprobs = logits.log_softmax(dim=-1)  # [k, V]
        chosen = logprobs.gather(1, targets[lo : lo + SLICE_ROWS].unsqueeze(1))  # [k, 1]
        target_lp.append(chosen.squeeze(1))
        ranks.append((logprobs >= chosen).sum(dim=-1))
        if max_top > 0:
            values, ids = logprobs.topk(max_top, dim=-1)
            top_lp.append(values)
            top_ids.append(ids)
    if not target_lp:
        return None
    return PromptLogprobsOutput(
        work, torch.cat(target_lp), torch.cat(ranks),
        torch.cat(top_ids) if top_ids else None, torch.cat(top_lp) if top_lp else None,
    )  # fmt: skip


def to_host(out: PromptLogprobsOutput) -> PromptLogprobsOutput:
    """Non-blocking copies into pinned memory on CUDA (the caller waits on an event before reading them)."""
    if not is_cuda(out.target_logprobs.device):
        return out

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    return PromptLogprobsOutput(out.work, copy(out.target_logprobs), copy(out.ranks), copy(out.top_ids),
                                copy(out.top_logprobs))  # fmt: skip


def to_plain(out: PromptLogprobsOutput, num_seqs: int) -> list[PromptLogprobs | None]:
    """Per plan sequence: (first target position, entries) or None. Read after the copies finished."""
    result: list[PromptLogprobs | None] = [None] * num_seqs
    work = out.work
    target_lp = out.target_logprobs.tolist()
    ranks = out.ranks.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    targets = work.targets.tolist()
    offset = 0
    for seq_index, first, count, num_top in zip(
        work.seq_index, work.first_target, work.counts, work.num_top, strict=True
    ):
        entries = []
        for k in range(offset, offset + count):
            entry = [(targets[k], target_lp[k], int(ranks[k]))]
            if top_ids is not None:
                limit = len(top_ids[k]) if num_top < 0 else min(num_top, len(top_ids[k]))
                entry += [(int(top_ids[k][j]), top_lp[k][j], j + 1) for j in range(limit)]
            entries.append(tuple(entry))
        result[seq_index] = (first, tuple(entries))
        offset += count
    return result
