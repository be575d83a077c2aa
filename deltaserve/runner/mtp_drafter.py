"""The MTP drafter: the checkpoint's MTP layer (model/mtp.py) proposes k greedy drafts a row after every step
(docs/speculative-decoding.md#drafting-with-the-mtp-layer).

After a step's target forward, the MTP layer runs once over every row of the step: row t pairs the target's
final-normed hidden state at t with the token at t + 1 (the next prompt token, the sampled token, or for a verify
chunk the emitted token there), at t's position and KV slot, so the MTP layer's own KV cache follows the target's
and holds only true inputs once a position is accepted (a rejected draft's row is overwritten by the next step,
which covers it again). Draft 1 of a sampling row is the argmax of the lm_head at its last accepted row; drafts
2 .. n chain the layer on its own output and draft (vLLM's reuse of its one MTP layer), one decode-like pass each,
writing the MTP KV of the positions past the step, which the next step's first pass rewrites with true inputs.
Those chained positions are written only where the row's KV blocks reach (the scheduler allocates k - 1 blocks of
lookahead for them); past that the pass reads and writes nothing of another row. n is the plan's num_drafts_next
(k without the k policy): the next step verifies no more, so at n = 0 the first pass runs alone (no lm_head, no
chained pass). Everything stays on the device.
Under tensor parallelism every rank runs this on its shard of the MTP layer with the same inputs (rank 0's accepted
tokens: runner/spec_ranks.py) and takes the argmax over the draft logits gathered on every rank, so every rank
writes the same drafts.
"""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.model.context import ForwardContext, forward_context
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.drafter import DraftInputs
from deltaserve.sampler.transfer import to_device


class MtpDrafter:
    def __init__(self, model: Qwen35Model, num_speculative_tokens: int) -> None:
        if model.mtp is None:
            raise ValueError("the MTP drafter needs the model's MTP layer (built with speculative decoding on)")
        self.model = model
        self.mtp = model.mtp
        self.k = num_speculative_tokens

    def propose(self, inputs: DraftInputs) -> torch.Tensor:
        target = inputs.target
        if target is None:
            raise ValueError("the MTP drafter needs the step's target forward (an eager step)")
        with forward_context(target.ctx):
            out = self.mtp(target.next_ids, target.positions, target.hidden)  # [T, H]; MTP KV at the step's slots
        num_rows = len(inputs.rows)
        device = target.hidden.device
        drafts = torch.zeros(num_rows, self.k, dtype=torch.int64, device=device)
        num_drafts = self.k if inputs.num_drafts is None else min(inputs.num_drafts, self.k)
        if not num_rows or not num_drafts:  # the first pass alone: the next step verifies no drafts
            return drafts
        hidden = out.index_select(0, target.draft_rows)  # [R, H]
        positions = target.positions.index_select(1, target.draft_rows)  # [3, R]
        limit = to_device(target.kv_limit, torch.int64, device)  # [R]: pinned, no wait on the stream
        rows = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
        chain_drafts(self.model, hidden, positions, target.draft_index, limit, target.block_tables,
                     target.block_size, int(np.max(target.kv_limit)), rows, drafts[:, :num_drafts])  # fmt: skip
        return drafts


def chain_drafts(
    model: Qwen35Model, hidden: torch.Tensor, positions: torch.Tensor, draft_index: torch.Tensor,
    limit: torch.Tensor, block_tables: torch.Tensor, block_size: int, max_seq_len: int, rows: torch.Tensor,
    drafts: torch.Tensor,
) -> None:  # fmt: skip
    """Draft 1 from the MTP layer's output at each row's last accepted position (hidden [R, H], positions [3, R]),
    then drafts 2 .. n by chaining the layer on its own output, one decode-like pass each, into drafts [R, n] (n:
    the drafts the next step may verify, StepPlan.num_drafts_next; n = 0 computes nothing).
    draft_index [R]: that position's token index; limit [R]: tokens the row's KV blocks cover (past it no MTP KV is
    written); rows: arange(R + 1) int32; max_seq_len: a host bound on the context (the kernels' hint). No host
    sync: the verify graphs (runner/spec_graphs.py) capture it too."""
    num_rows, k = drafts.shape
    if not k:
        return
    token = model.compute_logits(hidden, on_all_ranks=True).argmax(dim=-1)  # [R]: greedy, vLLM's default
    drafts[:, 0] = token
    width = block_tables.shape[1]
    for i in range(1, k):
        index = draft_index + i  # [R] the token index whose MTP input is (hidden, token)
        is_covered = index < limit
        block = block_tables.gather(1, (index // block_size).clamp(max=width - 1).unsqueeze(1))
        slot = block.squeeze(1).long() * block_size + index % block_size
        ctx = ForwardContext(
            num_decode_tokens=num_rows,
            num_prefill_tokens=0,
            query_start_loc=rows,
            seq_lens=torch.minimum(index + 1, limit).to(torch.int32),
            block_tables=block_tables,
            slot_mapping=torch.where(is_covered, slot, -1),
            max_query_len=1,
            max_seq_len=max_seq_len,
            state_indices=rows[:num_rows],  # unused: the MTP layer has no GDN state
            has_initial_state=rows[:num_rows],
        )
        with forward_context(ctx):
            hidden = model.mtp(token, positions + i, hidden)  # [R, H]
        token = model.compute_logits(hidden, on_all_ranks=True).argmax(dim=-1)
        drafts[:, i] = token
