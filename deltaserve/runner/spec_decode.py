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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from deltaserve.kernels.gdn_spec import verify_row_width
from deltaserve.model.context import ForwardContext
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.mtp_resume import save_accepted_hidden
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_commit import commit_gdn_states, gdn_stacks
from deltaserve.sampler import logprobs_to_host
from deltaserve.sampler.rejection import greedy_accept, random_accept, synthetic_accept
from deltaserve.sampler.sampler import SamplerOutput, SamplingBatch
from deltaserve.sampler.transfer import to_device
from deltaserve.step import ScheduledSeq

if TYPE_CHECKING:  # runner/inputs.py imports this module, and runner/spec_graphs.py runner/inputs.py
    from deltaserve.runner.inputs import StepInputs, StepLayout
    from deltaserve.runner.spec_graphs import VerifyGraphs


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


STATE_SHARE = 0.5  # of the cache budget, at most, for the state pool and the verify scratch (a sized count)
SCRATCH_SHARE = 0.25  # of the cache budget, at most, for the verify scratch under the k policy


def scratch_rows(budget_bytes: int, row_bytes: int, max_num_seqs: int) -> int:
    """The verify chunks under the deltaserve-only k policy, whose count is sized as without speculation: each
    chunk's scratch (row_bytes: runner/cache.py verify_row_bytes) in at most a quarter of the cache budget, at most
    max_num_seqs chunks; a step with more decodes than chunks drafts nothing (scheduler/spec_policy.py), so it
    replays a width-1 graph at the full count instead of running eager. At least one."""
    return max(1, min(max_num_seqs, int(budget_bytes * SCRATCH_SHARE) // max(row_bytes, 1)))


def speculating_seqs(budget_bytes: int, slot_bytes: int, row_bytes: int, upper: int, share: float = STATE_SHARE) -> int:
    """How many sequences may run while speculating: each holds its pool slot and its verify chunk's scratch
    (row_bytes: 1 + k conv windows and token rows, so one recurrent state with the slot, where vLLM's hybrid cache
    gives a speculating request 1 + k state blocks), so every step fits a captured verify graph (a step past the
    scratch would run eager). vLLM's default count (upper) is sized with the pool and the scratch in at most half of
    the cache budget, the rule without speculation; a count the user set is held to what the whole budget holds
    (share 1). At least one (docs/speculative-decoding.md#memory)."""
    per_seq = max(slot_bytes + row_bytes, 1)
    return max(1, min(upper, int(budget_bytes * share) // per_seq))


@dataclass
class TargetStep:
    """The target's forward of a step, as a drafter that reads hidden states needs it (all on the device)."""

    ctx: ForwardContext  # the step's batch metadata (its attention fields index the step's KV slots)
    positions: torch.Tensor  # [3, T]
    hidden: torch.Tensor  # [T, H] final-normed
    next_ids: torch.Tensor  # [T] the token at each row's position + 1 where known (0 where not: a rejected draft's)
    draft_rows: torch.Tensor  # [R] per sampling row, the row of the step its drafts continue from (last accepted)
    draft_index: torch.Tensor  # [R] that row's token index in its sequence
    kv_limit: np.ndarray  # [R] tokens the sampling row's KV blocks cover (host)
    block_tables: torch.Tensor  # [R, max_blocks] int32
    block_size: int


@dataclass
class DraftInputs:
    """What a drafter sees after a step: per sampling row, the tokens the step emitted, and the target's forward."""

    rows: np.ndarray  # [R] table rows (host); empty for a step that sampled nothing
    rows_dev: torch.Tensor  # [R]
    tokens: torch.Tensor  # [R, W] int64: the tokens emitted this step, -1 past num_emitted
    num_emitted: torch.Tensor  # [R] int64: 1 for a plain sample, 1 .. 1 + k for a verify
    target: TargetStep | None = None
    # drafts a row's next verify may use (StepPlan.num_drafts_next, 0 .. k_max): a drafter may leave the columns past
    # it as they are; one with a KV cache of its own still fills that cache over the step's tokens at 0
    num_drafts: int | None = None  # None: k_max


class Drafter(Protocol):
    def propose(self, inputs: DraftInputs) -> torch.Tensor:
        """[R, k_max] int64 draft tokens for the next decode of each row (on the device; the first
        inputs.num_drafts columns are the ones read). Called after every step while speculating, also with R = 0 (a
        drafter with a KV cache of its own fills it then)."""
        ...


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
            target = self._target_step(spec, table, block_size, rows, rows_dev, seq_tokens)
        num_drafts = self.num_drafts_after(spec.num_drafts_next)
        drafts = self.drafter.propose(DraftInputs(rows, rows_dev, tokens, num_emitted, target, num_drafts))
        if len(rows) and num_drafts:
            self.draft_tokens.index_copy_(0, rows_dev, drafts[:, : self.num_speculative_tokens].to(torch.int64))

    @staticmethod
    def _target_step(
        spec: SpecHandle, table: RequestTable, block_size: int, rows: np.ndarray, rows_dev: torch.Tensor,
        seq_tokens: torch.Tensor,
    ) -> TargetStep:  # fmt: skip
        """Each step row's next token (what a drafter that reads hidden states pairs with it) and where each
        sampling row's drafts start."""
        inputs, layout = spec.inputs, spec.step_layout
        device = inputs.input_ids.device
        ids = inputs.input_ids
        next_ids = torch.zeros_like(ids)
        next_ids[:-1] = ids[1:]
        ends = layout.query_start_loc[1:] - 1  # [B] each chunk's last row
        # a chunk that sampled nothing: its next token is the next prompt token (0 past the prompt)
        is_sampling = np.zeros(len(layout.rows), dtype=np.bool_)
        is_sampling[layout.sample_seqs] = True
        quiet = np.nonzero(~is_sampling)[0]
        if len(quiet):
            following = layout.starts[quiet] + layout.num_new[quiet]
            values = [
                int(table.prompts[r][e]) if e < table.num_prompt[r] else 0
                for r, e in zip(layout.rows[quiet].tolist(), following.tolist(), strict=True)
            ]
            next_ids.index_copy_(0, to_device(ends[quiet], torch.int64, device), to_device(values, torch.int64, device))
        sample_ends = to_device(ends[layout.sample_seqs], torch.int64, device)
        if len(rows):
            next_ids.index_copy_(0, sample_ends, seq_tokens)
        draft_rows = sample_ends.clone()
        draft_index = to_device(layout.starts[layout.sample_seqs] + layout.num_new[layout.sample_seqs] - 1,
                                torch.int64, device)  # fmt: skip
        if spec.layout is not None:  # verify chunks: the emitted tokens follow their rows; drafts continue at a_s
            verify = spec.layout
            width = verify.token_index.shape[1]
            first = layout.query_start_loc[verify.seq_index]  # [S]
            columns = np.arange(width)
            is_real = columns[None, :] <= verify.num_drafts[:, None]
            # padding entries go to a spare row past the step's rows (no boolean mask: no host sync)
            flat = np.where(is_real, first[:, None] + columns[None, :], len(ids)).reshape(-1)
            spare = torch.cat([next_ids, next_ids.new_zeros(1)])
            spare.index_copy_(0, to_device(flat, torch.int64, device), spec.tokens.clamp(min=0).reshape(-1))
            next_ids = spare[:-1]
            index = to_device(verify.spec_sample_index, torch.int64, device)
            accepted = spec.num_emitted - 1
            draft_rows.index_copy_(0, index, to_device(first, torch.int64, device) + accepted)
            starts = to_device(layout.starts[verify.seq_index], torch.int64, device)
            draft_index.index_copy_(0, index, starts + accepted)
        if inputs.start_shift is not None:  # chained chunks: their planned starts moved back (runner/spec_chain.py)
            sample_seqs = to_device(layout.sample_seqs, torch.int64, device)
            draft_index = draft_index - inputs.start_shift.index_select(0, sample_seqs)
        return TargetStep(
            ctx=inputs.ctx,
            positions=inputs.positions,
            hidden=spec.hidden,
            next_ids=next_ids,
            draft_rows=draft_rows,
            draft_index=draft_index,
            kv_limit=table.num_blocks[rows] * block_size,
            block_tables=table.block_table.index_select(0, rows_dev),
            block_size=block_size,
        )

    @staticmethod
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

    @staticmethod
    def drafts_of(handle: SpecHandle) -> dict[int, list[int]]:
        drafts, event = handle.drafts
        if event is not None:
            event.synchronize()
        layout = handle.layout
        values = drafts.tolist()
        return {int(i): values[s][:k] for s, (i, k) in enumerate(zip(layout.seq_index, layout.num_drafts, strict=True))}

    @staticmethod
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


def collect_tokens(handle, table: RequestTable, vocab_size: int, token_ids: list, logprobs: list) -> None:
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
