"""Step inputs: a StepPlan + the RequestTable -> input ids, 3-D positions and the ForwardContext, on the device.

Everything per token is computed with numpy over the whole step (no Python loop over tokens or decodes): token
rows and positions by repeat/cumsum, KV slots by indexing the host block table. The host arrays are packed into
one int64 and one int32 buffer (each field on a 16-byte boundary, the alignment Triton specializes on), copied
through pinned memory without blocking, and the fields are views of the device copy. Input tokens the host does not
know (the token a row sampled last step, still on the device under async scheduling) are gathered on the device
from RequestTable.last_sampled. Only prefill chunks copy prompt slices, one slice per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.model.context import ForwardContext
from deltaserve.runner import spec_chain
from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_layout import SpecLayout, spec_layout
from deltaserve.runner.step_checkpoints import InnerSave, inner_fields, split_checkpoints
from deltaserve.step import StepPlan

_ALIGN_BYTES = 16


def pack(fields: dict[str, np.ndarray], dtype: type, device: torch.device) -> dict[str, torch.Tensor]:
    """Host arrays -> one device buffer (one pinned, non-blocking copy) -> a view per field, each 16-byte aligned."""
    step = _ALIGN_BYTES // np.dtype(dtype).itemsize
    offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
    size = 0
    for name, array in fields.items():
        offsets[name] = (size, array.shape)
        size += -(-array.size // step) * step
    host = np.zeros(max(size, step), dtype=dtype)
    for name, array in fields.items():
        start, _ = offsets[name]
        host[start : start + array.size] = array.reshape(-1)
    buffer = torch.from_numpy(host)
    if is_cuda(device):
        buffer = buffer.pin_memory().to(device, non_blocking=True)
    return {name: buffer[start : start + int(np.prod(shape))].view(shape) for name, (start, shape) in offsets.items()}


@dataclass
class StepLayout:
    """The host-side description of a step, shared by the eager and the CUDA-graph paths."""

    num_tokens: int
    rows: np.ndarray  # [B] table rows, plan order
    starts: np.ndarray  # [B] tokens computed before the step
    num_new: np.ndarray  # [B]
    query_start_loc: np.ndarray  # [B+1]
    token_rows: np.ndarray  # [T]
    positions: np.ndarray  # [3, T]
    slot_mapping: np.ndarray  # [T]
    input_ids: np.ndarray  # [T], 0 where the token comes from the device
    device_token_index: np.ndarray  # [D] positions in T whose token is the row's last sample
    sample_seqs: np.ndarray  # [S] indices into plan.seqs of the sequences that sample
    sample_token_index: np.ndarray  # [P] the tokens (rows of hidden) sampled: one a sequence, 1 + k a verify chunk
    state_slots: np.ndarray  # [B] int32 write slots
    has_initial_state: np.ndarray  # [B] int32: 1 where the sequence starts from its read slot's state
    state_copies: list[tuple[int, int]]  # (read slot, write slot) pairs to copy before the forward
    state_saves: list[tuple[int, int]]  # (write slot, checkpoint slot) pairs to copy after the forward
    inner_saves: list[InnerSave]  # checkpoints saved inside the forward (runner/step_checkpoints.py)
    has_mrope: bool
    chained: np.ndarray  # [B] bool: the chunk was planned behind its sequence's verify in flight (runner/spec_chain.py)
    spec: SpecLayout | None = None  # the verify chunks (speculative decoding), None when the step has none


def layout_step(plan: StepPlan, table: RequestTable, block_size: int) -> StepLayout:
    seqs = plan.seqs
    rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=len(seqs))
    starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    num_new = np.fromiter((s.num_new_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    token_rows = np.repeat(rows, num_new)
    token_pos = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], num_new)
    num_prompt = table.num_prompt[rows]
    is_device_token = token_pos >= np.repeat(num_prompt, num_new)
    input_ids = np.zeros(num_tokens, dtype=np.int64)
    for i in np.nonzero(starts < num_prompt)[0]:  # chunks with prompt tokens: one slice each
        lo, hi = int(starts[i]), int(min(starts[i] + num_new[i], num_prompt[i]))
        base = int(query_start_loc[i])
        input_ids[base : base + hi - lo] = table.prompts[rows[i]][lo:hi]
    needs_sample = np.fromiter((s.needs_sample for s in seqs), dtype=np.bool_, count=len(seqs))
    sample_seqs = np.nonzero(needs_sample)[0]
    spec = spec_layout(seqs, query_start_loc, sample_seqs, plan.num_decodes)
    if spec is not None:
        is_device_token[spec.draft_token_index] = False  # drafts come from the drafter's record
    device_token_index = np.nonzero(is_device_token)[0]
    # a token past the prompt is the row's last sample: only a decode's single token (or a verify chunk's first)
    # can be one
    if len(device_token_index):
        chunk = np.searchsorted(query_start_loc, device_token_index, "right") - 1
        is_verify = np.zeros(len(seqs), dtype=np.bool_)
        if spec is not None:
            is_verify[spec.seq_index] = True
        is_allowed = (num_new[chunk] == 1) | (is_verify[chunk] & (query_start_loc[chunk] == device_token_index))
        if not is_allowed.all():
            raise ValueError("a multi-token chunk reaches past the tokens the runner knows (only verify chunks may)")
    block_index = token_pos // block_size
    slot_mapping = (
        table.block_table_host[token_rows, block_index].astype(np.int64) * block_size + token_pos % block_size
    )
    positions = np.broadcast_to(token_pos, (3, num_tokens))
    has_mrope = False
    mrope_seqs = [i for i, row in enumerate(rows) if table.mrope[row] is not None]
    if mrope_seqs:
        positions = positions.copy()
        has_mrope = True
        seqs_mm = np.asarray(mrope_seqs)
        table_lens = np.fromiter((table.mrope[rows[i]].shape[1] for i in mrope_seqs), np.int64, len(mrope_seqs))
        is_past = starts[seqs_mm] >= table_lens
        if is_past.any():
            # spans wholly past their prompt's table (every decode row): the text position plus the row's delta,
            # all such sequences at once (one at a time cost ~15 us each per step: 0.5 ms at 32 image requests)
            past = seqs_mm[is_past]
            counts = num_new[past]
            first = np.repeat(query_start_loc[past] - (np.cumsum(counts) - counts), counts)
            tokens = first + np.arange(int(counts.sum()))
            positions[:, tokens] = token_pos[tokens] + np.repeat(table.mrope_delta[rows[past]], counts)
        for i in seqs_mm[~is_past].tolist():
            row, base, lo, n = rows[i], int(query_start_loc[i]), int(starts[i]), int(num_new[i])
            prompt_positions = table.mrope[row]  # [3, P]
            span = np.arange(lo, lo + n)
            in_prompt = span < prompt_positions.shape[1]
            positions[:, base : base + n] = np.where(
                in_prompt,
                prompt_positions[:, np.minimum(span, prompt_positions.shape[1] - 1)],
                span + table.mrope_delta[row],
            )
    sample_token_index = query_start_loc[1:][sample_seqs] - 1
    if spec is not None:
        counts = spec.sample_counts
        sample_token_index = np.repeat(sample_token_index + 1 - counts, counts) + spec.position_offsets
    state_copies: list[tuple[int, int]] = []
    state_saves: list[tuple[int, int]] = []
    inner_saves: list[InnerSave] = []
    for i, s in enumerate(seqs):
        if s.read_slot is not None and s.read_slot != s.write_slot:
            state_copies.append((s.read_slot, s.write_slot))
        if s.checkpoints:
            copies, inner = split_checkpoints(i, s)
            state_saves += copies
            if inner is not None:
                inner_saves.append(inner)
    state_slots = np.fromiter((s.write_slot for s in seqs), dtype=np.int32, count=len(seqs))
    has_initial_state = np.fromiter((s.read_slot is not None for s in seqs), dtype=np.int32, count=len(seqs))
    return StepLayout(
        num_tokens=num_tokens,
        rows=rows,
        starts=starts,
        num_new=num_new,
        query_start_loc=query_start_loc,
        token_rows=token_rows,
        positions=positions,
        slot_mapping=slot_mapping,
        input_ids=input_ids,
        device_token_index=device_token_index,
        sample_seqs=sample_seqs,
        sample_token_index=sample_token_index,
        state_slots=state_slots,
        has_initial_state=has_initial_state,
        state_copies=state_copies,
        state_saves=state_saves,
        inner_saves=inner_saves,
        has_mrope=has_mrope,
        chained=np.fromiter((s.is_chained for s in seqs), dtype=np.bool_, count=len(seqs)),
        spec=spec,
    )


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [3, T] int64
    ctx: ForwardContext
    sample_token_index: torch.Tensor | None  # [S] rows of hidden that sample; None when all T rows sample
    sample_rows_dev: torch.Tensor  # [S] table rows of the sampling sequences
    position_rows_dev: torch.Tensor | None = None  # [P] table row of each sampled position (verify steps)
    # [B] int64: how far each chained chunk was moved back from its planned start (runner/spec_chain.py); None: the
    # step holds no chained chunk
    start_shift: torch.Tensor | None = None


def build_eager_inputs(
    plan: StepPlan, layout: StepLayout, table: RequestTable, block_size: int, device: torch.device
) -> StepInputs:
    """Device inputs of an eager (not graph-captured) forward: decodes first, then prefill chunks."""
    num_decodes = plan.num_decodes
    spec = layout.spec
    num_spec_seqs = 0 if spec is None else len(spec.seq_index)
    num_spec_tokens = 0 if spec is None else spec.num_tokens
    first_prefill = num_decodes + num_spec_seqs  # sequences: decodes, verify chunks, prefill chunks
    seq_lens = layout.starts + layout.num_new
    width = max(1, int(-(-seq_lens.max() // block_size)))
    has_initial_state = layout.has_initial_state
    state_indices = layout.state_slots
    sample_rows = layout.rows[layout.sample_seqs]
    spec_fields = {}
    short_ckpt, long_ckpt = {}, {}
    if layout.inner_saves:  # in-step checkpoints (runner/step_checkpoints.py)
        short_ckpt, long_ckpt = inner_fields(layout.inner_saves, layout.starts, layout.query_start_loc, first_prefill)
    if spec is not None:
        spec_fields = {
            "position_rows": np.repeat(sample_rows, spec.sample_counts),
            "spec_token_index": spec.token_index,
        }
    long = pack(
        {
            **spec_fields,
            **long_ckpt,
            "input_ids": layout.input_ids,
            "positions": np.ascontiguousarray(layout.positions),
            "slot_mapping": layout.slot_mapping,
            "sample_token_index": layout.sample_token_index,
            "device_token_index": layout.device_token_index,
            "device_token_rows": layout.token_rows[layout.device_token_index],
            "sample_rows": sample_rows,
            "rows": layout.rows,
        },
        np.int64,
        device,
    )
    qsl = layout.query_start_loc
    short = pack(
        {
            "query_start_loc": qsl,
            "seq_lens": seq_lens,
            "state_indices": state_indices,
            "has_initial_state": has_initial_state,
            "prefill_query_start_loc": qsl[first_prefill:] - qsl[first_prefill],
            "prefill_state_indices": state_indices[first_prefill:],
            "prefill_has_initial_state": has_initial_state[first_prefill:],
            "spec_state_indices": state_indices[num_decodes:first_prefill],
            **short_ckpt,
        },
        np.int32,
        device,
    )
    shift = None
    if layout.chained.any():  # chunks planned behind their verify in flight start where it really ended
        shift = spec_chain.start_shift(layout, table, device)
        spec_chain.shift_inputs(layout, table, block_size, shift, long["positions"], long["slot_mapping"],
                                short["seq_lens"])  # fmt: skip
    input_ids = long["input_ids"]
    if len(layout.device_token_index):
        input_ids.index_copy_(
            0, long["device_token_index"], table.last_sampled.index_select(0, long["device_token_rows"])
        )
    ctx = ForwardContext(
        num_decode_tokens=num_decodes,
        num_prefill_tokens=layout.num_tokens - num_decodes - num_spec_tokens,
        query_start_loc=short["query_start_loc"],
        seq_lens=short["seq_lens"],
        block_tables=table.block_table[:, :width].index_select(0, long["rows"]),
        slot_mapping=long["slot_mapping"],
        max_query_len=int(layout.num_new.max()),
        max_seq_len=int(seq_lens.max()),
        state_indices=short["state_indices"],
        has_initial_state=short["has_initial_state"],
        has_mrope_positions=layout.has_mrope,
        prefill_query_start_loc=short["prefill_query_start_loc"],
        prefill_state_indices=short["prefill_state_indices"],
        prefill_has_initial_state=short["prefill_has_initial_state"],
        num_spec_tokens=num_spec_tokens,
        spec_state_indices=short["spec_state_indices"] if spec is not None else None,
        spec_token_index=long.get("spec_token_index"),
        prefill_checkpoint_chunks=short.get("prefill_checkpoint_chunks"),
        prefill_checkpoint_slots=short.get("prefill_checkpoint_slots"),
        checkpoint_rows=long.get("checkpoint_rows"),
        checkpoint_slots=long.get("checkpoint_slots"),
    )
    is_all_sampled = len(layout.sample_token_index) == layout.num_tokens
    return StepInputs(
        input_ids=input_ids,
        positions=long["positions"],
        ctx=ctx,
        sample_token_index=None if is_all_sampled else long["sample_token_index"],
        sample_rows_dev=long["sample_rows"],
        position_rows_dev=long.get("position_rows"),
        start_shift=shift,
    )
