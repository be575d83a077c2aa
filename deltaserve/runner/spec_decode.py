"""Speculative decoding in the runner: verify chunks, the accept step and the per-token GDN state rollback
(docs/speculative-decoding.md).

A verify chunk (ScheduledSeq.num_draft_tokens = k > 0) is a decode of 1 + k tokens: the row's last sampled token
(RequestTable.last_sampled) and its k drafts (SpecDecoder.draft_tokens, written on the device by the drafter after
the row's previous step). Its tokens sit after the plain decode rows and before the prefill chunks, attention runs
them as a varlen causal chunk, and the GDN layers run the multi-token recurrent kernels that keep the state after
every token in scratch (kernels/gdn_spec.py). Every one of the 1 + k positions gets logits and is sampled by the
ordinary sampler (position j of a row samples as the row's output j: seeds and min_tokens follow); the rejection
rule (sampler/rejection.py) turns those into the accepted tokens, and the state after the last accepted token is
copied into the live slot. All of that stays on the device: the host learns the accepted tokens when it collects
the step, as it learns any sampled token.

The drafter is any object with `propose(DraftInputs) -> [R, k_max]` tokens; it runs after every step that sampled,
so a row has drafts for its next decode whether its last step was a prefill, a decode or a verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from deltaserve.kernels.gdn_spec import spec_state_commit
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.request_table import RequestTable
from deltaserve.sampler import logprobs_to_host
from deltaserve.sampler.rejection import greedy_accept
from deltaserve.sampler.transfer import to_device
from deltaserve.step import ScheduledSeq


@dataclass
class SpecLayout:
    """The host-side description of a step's verify chunks (plan order; they follow the plain decodes)."""

    seq_index: np.ndarray  # [S] indices into plan.seqs
    num_drafts: np.ndarray  # [S]
    state_slots: np.ndarray  # [S] int32 live slots
    token_index: np.ndarray  # [S, W] rows of the verify slice, -1 past 1 + k_s
    num_tokens: int  # rows of the verify slice
    draft_token_index: np.ndarray  # [D] step rows that hold a draft token
    draft_rows: np.ndarray  # [D] their table rows
    draft_cols: np.ndarray  # [D] their draft index (0 .. k_s - 1)
    sample_counts: np.ndarray  # [n sampling seqs] positions each sampling sequence samples (1 + k for a verify)
    sample_offsets: np.ndarray  # [n sampling seqs + 1] where each one's positions start among all of them
    position_offsets: np.ndarray  # [P] index of each sampled position within its sequence's run
    spec_sample_index: np.ndarray  # [S] index of each verify sequence among the sampling sequences


def spec_layout(
    seqs: tuple[ScheduledSeq, ...], query_start_loc: np.ndarray, sample_seqs: np.ndarray, num_decodes: int
) -> SpecLayout | None:
    """The verify chunks of a step, or None when it holds none. Refuses a plan whose verify chunks do not directly
    follow its plain decodes (the layers slice decode, verify and prefill rows as three runs)."""
    seq_index = np.fromiter((i for i, s in enumerate(seqs) if s.num_draft_tokens), dtype=np.int64)
    if not len(seq_index):
        return None
    if not np.array_equal(seq_index, np.arange(num_decodes, num_decodes + len(seq_index))):
        raise ValueError("verify chunks must follow the plain decodes and precede the prefill chunks in a plan")
    num_drafts = np.fromiter((seqs[i].num_draft_tokens for i in seq_index), dtype=np.int64)
    for i in seq_index:
        seq = seqs[i]
        if seq.num_new_tokens != 1 + seq.num_draft_tokens or not seq.needs_sample or seq.read_slot != seq.write_slot:
            raise ValueError(
                f"a verify chunk computes 1 + k tokens from its own slot and samples: got {seq.num_new_tokens} tokens "
                f"for k = {seq.num_draft_tokens}, needs_sample {seq.needs_sample}, slots {seq.read_slot} -> "
                f"{seq.write_slot}"
            )
        if seq.checkpoints:
            raise ValueError("ScheduledSeq.checkpoints on a verify chunk: not implemented")
    width = int(num_drafts.max()) + 1
    base = int(query_start_loc[num_decodes])
    starts = query_start_loc[seq_index] - base  # [S]
    columns = np.arange(width)
    token_index = np.where(columns[None, :] <= num_drafts[:, None], starts[:, None] + columns[None, :], -1)
    draft_cols = np.concatenate([np.arange(k) for k in num_drafts])
    draft_token_index = np.repeat(query_start_loc[seq_index] + 1, num_drafts) + draft_cols
    rows = np.fromiter((seqs[i].row for i in seq_index), dtype=np.int64)
    is_verify = np.zeros(len(seqs), dtype=np.int64)
    is_verify[seq_index] = num_drafts
    sample_counts = 1 + is_verify[sample_seqs]
    sample_offsets = np.zeros(len(sample_seqs) + 1, dtype=np.int64)
    np.cumsum(sample_counts, out=sample_offsets[1:])
    position_offsets = np.arange(int(sample_offsets[-1])) - np.repeat(sample_offsets[:-1], sample_counts)
    return SpecLayout(
        seq_index=seq_index,
        num_drafts=num_drafts,
        state_slots=np.fromiter((seqs[i].write_slot for i in seq_index), dtype=np.int32),
        token_index=token_index,
        num_tokens=int(num_drafts.sum()) + len(seq_index),
        draft_token_index=draft_token_index,
        draft_rows=np.repeat(rows, num_drafts),
        draft_cols=draft_cols,
        sample_counts=sample_counts,
        sample_offsets=sample_offsets,
        position_offsets=position_offsets,
        spec_sample_index=np.searchsorted(sample_seqs, seq_index),
    )


@dataclass
class DraftInputs:
    """What a drafter sees after a step that sampled: per sampling row, the tokens the step emitted."""

    rows: np.ndarray  # [R] table rows (host)
    rows_dev: torch.Tensor  # [R]
    tokens: torch.Tensor  # [R, W] int64: the tokens emitted this step, -1 past num_emitted
    num_emitted: torch.Tensor  # [R] int64: 1 for a plain sample, 1 .. 1 + k for a verify


class Drafter(Protocol):
    def propose(self, inputs: DraftInputs) -> torch.Tensor:
        """[R, k_max] int64 draft tokens for the next decode of each row (on the device)."""
        ...


@dataclass
class SpecHandle:
    """A launched step's verify state: device results, then their host copies (collect reads them)."""

    layout: SpecLayout
    keys: np.ndarray  # [S] the table rows' occupant keys at launch (a row reused since is not counted)
    tokens: torch.Tensor | None = None  # [S, W] accepted tokens, -1 padding
    num_emitted: torch.Tensor | None = None  # [S]


class SpecDecoder:
    """The runner's speculative-decoding state: each row's drafts, the per-token state scratch bound to the GDN
    layers, and the drafter."""

    def __init__(
        self, model: Qwen35Model, max_rows: int, num_speculative_tokens: int, drafter: Drafter, device: torch.device
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_spec_seqs = max_rows
        self.drafter = drafter
        self.model = model
        # one extra row: the request table's dummy row
        self.draft_tokens = torch.zeros(max_rows + 1, num_speculative_tokens, dtype=torch.int64, device=device)
        width = num_speculative_tokens + 1
        for layer in model.layers:
            if layer.is_full_attention:
                continue
            mixer = layer.linear_attn
            conv, ssm = mixer.conv_states, mixer.ssm_states
            mixer.spec_conv_scratch = conv.new_empty(max_rows, width, *conv.shape[1:])
            mixer.spec_ssm_scratch = ssm.new_empty(max_rows, width, *ssm.shape[1:])

    def fill_draft_inputs(self, input_ids: torch.Tensor, layout: SpecLayout) -> None:
        """Writes each verify chunk's drafts into the step's input ids (on the device)."""
        device = input_ids.device
        index = to_device(layout.draft_token_index, torch.int64, device)
        rows = to_device(layout.draft_rows, torch.int64, device)
        cols = to_device(layout.draft_cols, torch.int64, device)
        input_ids.index_copy_(0, index, self.draft_tokens[rows, cols])

    @staticmethod
    def last_positions(handle: SpecHandle, device: torch.device) -> torch.Tensor:
        """[n sampling seqs] the index of each sampling sequence's last sampled position."""
        return to_device(handle.layout.sample_offsets[1:] - 1, torch.int64, device)

    def accept(self, handle: SpecHandle, sampled: torch.Tensor, seq_tokens: torch.Tensor) -> torch.Tensor:
        """sampled [P]: the target's token at every sampled position; seq_tokens [n sampling seqs]: each sampling
        sequence's last position's token. Applies the rejection rule to the verify chunks, commits their GDN states
        and returns seq_tokens with each verify sequence's last accepted token (its next input)."""
        layout = handle.layout
        device = sampled.device
        width = layout.token_index.shape[1]
        columns = np.arange(width)
        is_real = columns[None, :] <= layout.num_drafts[:, None]
        starts = layout.sample_offsets[layout.spec_sample_index]
        positions = to_device(np.where(is_real, starts[:, None] + columns[None, :], 0), torch.int64, device)
        target = sampled[positions]  # [S, W]
        rows = to_device(layout.draft_rows, torch.int64, device)
        drafts = torch.full((len(layout.seq_index), width - 1), -1, dtype=torch.int64, device=device)
        if width > 1:
            spec_of = np.repeat(np.arange(len(layout.seq_index)), layout.num_drafts)
            flat = to_device(spec_of * (width - 1) + layout.draft_cols, torch.int64, device)
            cols = to_device(layout.draft_cols, torch.int64, device)
            drafts.view(-1).index_copy_(0, flat, self.draft_tokens[rows, cols])
        tokens, num_emitted = greedy_accept(target, drafts, to_device(layout.num_drafts, torch.int64, device))
        slots = to_device(layout.state_slots, torch.int32, device)
        for layer in self.model.layers:
            if not layer.is_full_attention:
                mixer = layer.linear_attn
                spec_state_commit(mixer.conv_states, mixer.ssm_states, mixer.spec_conv_scratch,
                                  mixer.spec_ssm_scratch, slots, num_emitted - 1)  # fmt: skip
        handle.tokens, handle.num_emitted = tokens, num_emitted
        last = tokens.gather(1, (num_emitted - 1).unsqueeze(1)).squeeze(1)  # [S]
        seq_tokens = seq_tokens.clone()
        seq_tokens.index_copy_(0, to_device(layout.spec_sample_index, torch.int64, device), last)
        return seq_tokens

    def propose(self, rows: np.ndarray, rows_dev: torch.Tensor, seq_tokens: torch.Tensor, spec: SpecHandle | None):
        """Runs the drafter after a step that sampled: each sampling row's drafts for its next decode."""
        tokens = seq_tokens.unsqueeze(1)  # [R, 1]
        num_emitted = torch.ones(len(rows), dtype=torch.int64, device=seq_tokens.device)
        if spec is not None and spec.tokens is not None:
            width = spec.tokens.shape[1]
            tokens = torch.full((len(rows), width), -1, dtype=torch.int64, device=seq_tokens.device)
            tokens[:, 0] = seq_tokens
            index = to_device(spec.layout.spec_sample_index, torch.int64, seq_tokens.device)
            tokens.index_copy_(0, index, spec.tokens)
            num_emitted.index_copy_(0, index, spec.num_emitted)
        drafts = self.drafter.propose(DraftInputs(rows, rows_dev, tokens, num_emitted))
        self.draft_tokens.index_copy_(0, rows_dev, drafts[:, : self.num_speculative_tokens].to(torch.int64))

    @staticmethod
    def to_host(handle: SpecHandle) -> None:
        """Starts the host copies of the accepted tokens (the caller's event marks their end)."""
        for name in ("tokens", "num_emitted"):
            value = getattr(handle, name)
            if value.is_cuda:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                setattr(handle, name, host.copy_(value, non_blocking=True))


def collect_tokens(handle, table: RequestTable, vocab_size: int, token_ids: list, logprobs: list) -> None:
    """Fills a collected step's per-sequence tokens (and logprobs) from its host copies: a verify chunk's accepted
    tokens, one token for the others. The table's output counts gain the accepted drafts (record_sampled counted
    one token per sequence at launch)."""
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
