"""Speculative decoding in the runner: verify chunks, the accept step and the per-token GDN state rollback
(docs/speculative-decoding.md).

A verify chunk (ScheduledSeq.num_draft_tokens = k > 0) is a decode of 1 + k tokens: the row's last sampled token
(RequestTable.last_sampled) and its k drafts (SpecDecoder.draft_tokens, written on the device by the drafter after
the row's previous step). Its tokens sit after the plain decode rows and before the prefill chunks, attention runs
them as a varlen causal chunk, and the GDN layers run the multi-token recurrent kernels that read the live state,
keep each token's conv window and delta-rule inputs in scratch and write no state (kernels/gdn_spec.py). Every one
of the 1 + k positions gets logits and is sampled by the ordinary sampler (position j of a row samples as the row's
output j: seeds and min_tokens follow); the rejection rule (sampler/rejection.py) turns those into the accepted
tokens, and the commit moves the live slot to the state after the last accepted token (the conv window copied, the
accepted tokens replayed on the recurrent state). All of that stays on the device: the host learns the accepted
tokens when it collects the step, as it learns any sampled token.

The drafter is any object with `propose(DraftInputs) -> [R, k_max]` tokens; it runs after every forward (the MTP
drafter keeps its own KV on every step's tokens), so a row has drafts for its next decode whether its last step was
a prefill, a decode or a verify.

A step's verify-chunk layout and the sizing of speculation live in runner/spec_layout.py, the drafter's interface
(what it sees after a step) in runner/drafter.py, and a launched step's SpecHandle with its host copies in
runner/spec_handle.py.
"""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.kernels.gdn_spec import verify_row_width
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.drafter import Drafter, DraftInputs, target_step
from deltaserve.runner.mtp_resume import save_accepted_hidden
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_commit import commit_gdn_states, gdn_stacks
from deltaserve.runner.spec_handle import SpecHandle
from deltaserve.runner.spec_layout import SpecLayout
from deltaserve.sampler.rejection import greedy_accept, random_accept, synthetic_accept
from deltaserve.sampler.sampler import SamplerOutput, SamplingBatch
from deltaserve.sampler.transfer import to_device


class SpecDecoder:
    """The runner's speculative-decoding state: each row's drafts, the per-token state scratch bound to the GDN
    layers, and the drafter."""

    def __init__(
        self, model: Qwen35Model, max_rows: int, num_speculative_tokens: int, drafter: Drafter, device: torch.device,
        synthetic_rates: tuple[float, ...] | None = None, max_spec_seqs: int | None = None,
    ) -> None:  # fmt: skip
        """max_rows: the request table's rows; synthetic_rates: vLLM's synthetic acceptance (benchmarks): the accept
        decision pinned by these unconditional per-position rates instead of the drafts' agreement; max_spec_seqs:
        the verify chunks a step may hold (the scratch's rows; default max_rows)."""
        self.num_speculative_tokens = num_speculative_tokens
        self.synthetic_rates = None  # [k] on the device, copied once
        if synthetic_rates is not None:
            self.synthetic_rates = torch.tensor(synthetic_rates, dtype=torch.float32).to(device)
        self.max_spec_seqs = max_spec_seqs or max_rows
        # async verify (runner/spec_chain.py): each sampling step records its rows' true next starts, which chained
        # chunks need; without it that is per-step work nothing reads (ModelRunner.enable_speculation sets it)
        self.tracks_next_start = False
        self.drafter = drafter
        self.model = model
        # one extra row: the request table's dummy row
        self.draft_tokens = torch.zeros(max_rows + 1, num_speculative_tokens, dtype=torch.int64, device=device)
        width = num_speculative_tokens + 1
        mixers = [layer.linear_attn for layer in model.layers if not layer.is_full_attention]
        if mixers:
            m = mixers[0]
            # a conv window after each of the 1 + k tokens, and each token's delta-rule inputs (k, v, a, b) for the
            # commit to replay on the live state (kernels/gdn_spec.py): no recurrent state beside the live slot. One
            # tensor per kind over every layer, each layer a view, so the commit runs as one launch over all of them
            # (runner/spec_commit.py)
            conv_scratch = m.conv_states.new_empty(len(mixers), self.max_spec_seqs, width, *m.conv_states.shape[1:])
            row = verify_row_width(m.num_k_heads, m.head_k_dim, m.num_v_heads, m.head_v_dim)
            # in the model dtype, as k, v, a and b come
            row_scratch = m.dt_bias.detach().new_empty(len(mixers), self.max_spec_seqs, width, row)
            for i, mixer in enumerate(mixers):
                mixer.spec_conv_scratch, mixer.spec_row_scratch = conv_scratch[i], row_scratch[i]
        self.gdn_stacks = gdn_stacks(model)  # the commit's [L, ...] views (runner/spec_commit.py)

    def num_drafts_after(self, num_drafts_next: int | None) -> int:
        """The drafts a step proposes: its plan's num_drafts_next (None: k), never above k."""
        k = self.num_speculative_tokens
        return k if num_drafts_next is None else max(0, min(num_drafts_next, k))

    def fill_draft_inputs(self, input_ids: torch.Tensor, layout: SpecLayout) -> None:
        """Writes each verify chunk's drafts into the step's input ids (on the device)."""
        if len(layout.seq_index) > self.max_spec_seqs:
            raise ValueError(f"{len(layout.seq_index)} verify chunks in a step; the scratch holds {self.max_spec_seqs}")
        widest = int(layout.num_drafts.max())
        if widest > self.num_speculative_tokens:
            raise ValueError(f"a verify chunk of {widest} drafts; k is {self.num_speculative_tokens}")
        device = input_ids.device
        index = to_device(layout.draft_token_index, torch.int64, device)
        rows = to_device(layout.draft_rows, torch.int64, device)
        cols = to_device(layout.draft_cols, torch.int64, device)
        input_ids.index_copy_(0, index, self.draft_tokens[rows, cols])

    def add_draft_counts(self, batch: SamplingBatch, layout: SpecLayout, table: RequestTable, rows: np.ndarray) -> None:
        """Penalties at verify position j count the chunk's drafts 0 .. j-1 as outputs, as if they had been
        generated (vLLM's rule): the step's copy of the output counts gains them on the device. rows: the sampling
        sequences' table rows."""
        if batch.penalties is None:
            return
        position_rows = np.repeat(rows, layout.sample_counts)  # [P]
        penalised = np.nonzero(table.penalty_index[position_rows] >= 0)[0]  # batch positions, PenaltyInputs order
        index_of = {int(p): i for i, p in enumerate(penalised)}
        entries, draft_rows, draft_cols = [], [], []
        starts = layout.sample_offsets[layout.spec_sample_index]
        for s, k in enumerate(layout.num_drafts.tolist()):
            row = int(position_rows[starts[s]])
            for j in range(1, k + 1):
                i = index_of.get(int(starts[s]) + j)
                if i is None:
                    break  # a row without penalties
                entries += [i] * j
                draft_rows += [row] * j
                draft_cols += list(range(j))
        if not entries:
            return
        counts = batch.penalties.output_counts  # [Pp, V]: the step's own copy
        device = counts.device
        where = (to_device(draft_rows, torch.int64, device), to_device(draft_cols, torch.int64, device))
        tokens = self.draft_tokens[where]
        ones = torch.ones(len(entries), dtype=counts.dtype, device=device)
        counts.index_put_((to_device(entries, torch.int64, device), tokens), ones, accumulate=True)

    @staticmethod
    def count_accepted(table: RequestTable, layout: SpecLayout, rows: np.ndarray, handle: SpecHandle) -> None:
        """The table's penalty counts gain each verify chunk's accepted tokens but the last (record_sampled counts
        that one), on the device."""
        verify_rows = rows[layout.spec_sample_index]
        pool = table.penalty_index[verify_rows]
        if not (pool >= 0).any():
            return
        device = handle.tokens.device
        keep = np.nonzero(pool >= 0)[0]
        tokens = handle.tokens.index_select(0, to_device(keep, torch.int64, device))  # [Q, W]
        emitted = handle.num_emitted.index_select(0, to_device(keep, torch.int64, device))
        columns = torch.arange(tokens.shape[1], device=device)
        weights = (columns[None, :] < (emitted - 1)[:, None]).to(table.penalty_counts.dtype)
        pool_rows = to_device(pool[keep], torch.int64, device)[:, None].expand_as(tokens)
        table.penalty_counts.index_put_((pool_rows, tokens.clamp(min=0)), weights, accumulate=True)

    @staticmethod
    def last_positions(handle: SpecHandle, device: torch.device) -> torch.Tensor:
        """[n sampling seqs] the index of each sampling sequence's last sampled position."""
        return to_device(handle.layout.sample_offsets[1:] - 1, torch.int64, device)

    def accept(
        self, handle: SpecHandle, out: SamplerOutput, batch: SamplingBatch, shared: torch.Generator,
        seq_tokens: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """out.token_ids [P]: the target's token at every sampled position; seq_tokens [n sampling seqs]: each
        sampling sequence's last position's token. Applies the rejection rule to the verify chunks, commits their GDN
        states and returns seq_tokens with each verify sequence's last accepted token (its next input). `shared`:
        the generator of unseeded rows; batch.generators: the seeded positions' own."""
        layout = handle.layout
        sampled = out.token_ids
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
        num_drafts = to_device(layout.num_drafts, torch.int64, device)
        if self.synthetic_rates is not None:
            uniforms = self._uniforms(layout, batch, shared, starts, width - 1, device)
            tokens, num_emitted = synthetic_accept(target, drafts, num_drafts, self.synthetic_rates, uniforms)
            self._emitted_logprobs(out, layout, positions, tokens, num_emitted)  # accepted drafts are emitted
        elif handle.is_random is not None and handle.is_random.any():
            vocab = out.probs.shape[1]
            probs = out.probs[positions[:, :-1]]  # [S, W-1, V]: the distribution judging each draft
            # seeded rows take the coupled rule (sampler/rejection.py: a draft is judged by the row's own seeded draw),
            # so their tokens do not depend on where drafts stood; the shared generator draws for every row (unseeded
            # rows get the values they always got), the seeded rows' go unused
            shape = (len(layout.seq_index), width - 1)
            uniforms = torch.empty(shape, dtype=torch.float32, device=device).uniform_(generator=shared)
            noise = torch.empty(*shape, vocab, dtype=torch.float32, device=device).exponential_(generator=shared)
            is_seeded = np.array([int(start) in batch.generators for start in starts], dtype=bool)
            is_coupled = to_device(~handle.is_random | is_seeded, torch.bool, device)
            tokens, num_emitted = random_accept(target, drafts, num_drafts, is_coupled, probs, uniforms, noise)
            self._emitted_logprobs(out, layout, positions, tokens, num_emitted)
        else:
            tokens, num_emitted = greedy_accept(target, drafts, num_drafts)
        handle.tokens, handle.num_emitted = tokens, num_emitted
        if not handle.is_graphed:  # else the verify graphs' post-sampling replay commits (runner/spec_graphs.py)
            self.commit(handle)
        last = tokens.gather(1, (num_emitted - 1).unsqueeze(1)).squeeze(1)  # [S]
        seq_tokens = seq_tokens.clone()
        seq_tokens.index_copy_(0, to_device(layout.spec_sample_index, torch.int64, device), last)
        return seq_tokens

    def commit(self, handle: SpecHandle) -> None:
        """Moves each verify chunk's GDN state to its last accepted token: conv scratch entry [s, accepted_s] into
        the live slot, and tokens 0 .. accepted_s replayed on the live recurrent state, every GDN layer
        (handle.num_emitted [S] set by accept, or on a rank other than 0 received from rank 0: runner/spec_ranks.py)."""
        slots = to_device(handle.layout.state_slots, torch.int32, handle.num_emitted.device)
        # the step's widest chunk: the eager forward's columns, or fewer than a verify graph's 1 + k (a deferred
        # step); the replay never runs past it, nor past a chunk's accepted tokens (kernels/gdn_spec.py)
        width = handle.layout.token_index.shape[1]
        commit_gdn_states(self.model, self.gdn_stacks, slots, handle.num_emitted - 1, width)
        if self.model.mtp is not None:  # the live slot's hidden row follows the rollback (runner/mtp_resume.py)
            layout = handle.layout
            first = handle.step_layout.query_start_loc[layout.seq_index]
            save_accepted_hidden(self.model, handle.hidden, first, handle.num_emitted, layout.state_slots)

    @staticmethod
    def _uniforms(
        layout: SpecLayout, batch: SamplingBatch, shared: torch.Generator, starts: np.ndarray, num_columns: int,
        device: torch.device,
    ) -> torch.Tensor:  # fmt: skip
        """[S, num_columns] U[0, 1) for the synthetic accept decisions: a seeded verify position's from its own
        generator (after the sampler's draw there), the others' from the shared one. starts [S]: each verify chunk's
        first sample offset."""
        values = torch.empty(len(layout.seq_index), num_columns, dtype=torch.float32, device=device)
        values.uniform_(generator=shared)
        if batch.generators:
            for s, k in enumerate(layout.num_drafts.tolist()):
                for j in range(k):
                    generator = batch.generators.get(int(starts[s]) + j)
                    if generator is not None:
                        values[s, j].uniform_(generator=generator)
        return values

    @staticmethod
    def _emitted_logprobs(
        out: SamplerOutput, layout: SpecLayout, positions: torch.Tensor, tokens: torch.Tensor, num_emitted: torch.Tensor
    ) -> None:
        """A random row's accepted draft is not the token the sampler drew at its position: the logprobs reported are
        the emitted tokens' (out.token_ids is rewritten at the verify positions, the sampled logprobs recomputed)."""
        if out.raw_logprobs is None or not out.logprob_rows:
            return
        # only the chunks' real positions: a padded entry of `positions` aliases position 0, and a duplicate index
        # in index_copy_ would let it overwrite that position's emitted token
        width = tokens.shape[1]
        columns = np.arange(width)
        real = np.nonzero((columns[None, :] <= layout.num_drafts[:, None]).reshape(-1))[0]
        starts = layout.sample_offsets[layout.spec_sample_index]
        flat = (starts[:, None] + columns[None, :]).reshape(-1)[real]
        real_dev = to_device(real, torch.int64, positions.device)
        flat_dev = to_device(flat, torch.int64, positions.device)
        emitted = tokens.reshape(-1).index_select(0, real_dev)
        emitted = torch.where(emitted >= 0, emitted, out.token_ids.index_select(0, flat_dev))
        out.token_ids = out.token_ids.clone()
        out.token_ids.index_copy_(0, flat_dev, emitted)
        rows = out.logprob_rows
        index = None if len(rows) == out.token_ids.shape[0] else to_device(list(rows), torch.int64, positions.device)
        sampled = out.token_ids if index is None else out.token_ids.index_select(0, index)
        chosen = out.raw_logprobs.gather(1, sampled.unsqueeze(1))  # [L, 1]
        out.sampled_logprobs = chosen.squeeze(1)
        out.sampled_ranks = (out.raw_logprobs >= chosen).sum(dim=-1)

    def propose(self, spec: SpecHandle, table: RequestTable, block_size: int, rows: np.ndarray,
                rows_dev: torch.Tensor, seq_tokens: torch.Tensor) -> None:  # fmt: skip
        """Runs the drafter after a step: each sampling row's drafts for its next decode (rows may be empty)."""
        device = rows_dev.device
        tokens = seq_tokens.unsqueeze(1)  # [R, 1]
        num_emitted = torch.ones(len(rows), dtype=torch.int64, device=device)
        if spec.tokens is not None:
            width = spec.tokens.shape[1]
            tokens = torch.full((len(rows), width), -1, dtype=torch.int64, device=device)
            tokens[:, 0] = seq_tokens
            index = to_device(spec.layout.spec_sample_index, torch.int64, device)
            tokens.index_copy_(0, index, spec.tokens)
            num_emitted.index_copy_(0, index, spec.num_emitted)
        target = None
        if spec.hidden is not None:
            target = target_step(spec, table, block_size, rows, rows_dev, seq_tokens)
        num_drafts = self.num_drafts_after(spec.num_drafts_next)
        drafts = self.drafter.propose(DraftInputs(rows, rows_dev, tokens, num_emitted, target, num_drafts))
        if len(rows) and num_drafts:
            self.draft_tokens.index_copy_(0, rows_dev, drafts[:, : self.num_speculative_tokens].to(torch.int64))
