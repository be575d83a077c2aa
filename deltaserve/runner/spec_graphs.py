"""Verify CUDA graphs: a speculative decoding step's target forward and, after its accept step, the GDN commit and
the MTP drafter, captured per batch-size bucket and replayed over static buffers
(docs/speculative-decoding.md#cuda-graphs).

A step qualifies when it holds a verify chunk and every sequence is a verify chunk or a plain decode (no prefill
token, no multimodal span, no returned logits, no prefix-cache checkpoint save). It runs as B rows of W = 1 + k
tokens, k the configured num_speculative_tokens, at a uniform stride (query_start_loc = arange(B + 1)·W). A row
with k_s < k drafts (near max_tokens or max_model_len, the k policy's k_step, or a plain decode with k_s = 0) is
padded to W: its padded positions store no KV (slot -1), their spec_token_index entries are -1 (the verify kernels
leave the GDN state as it is there and write no output row for them) and nothing samples them. Attention declares
each row's query length W and its context start + W, so real query j still sees keys <= start + j (causal): the
padded keys sit after every real query and get weight 0; the KV cache is zero-initialised and only real tokens
write it, so a padded key is always finite and adds exactly 0. tests/runner/test_spec_graphs.py checks that claim
in fp32.

Rows past B up to the bucket read the request table's empty dummy row, store no KV, and carry state slot -1 with
all spec_token_index entries -1: the verify kernels skip such a sequence (no slot read, no scratch written, zero
output rows) and the commit writes no slot for it. The buckets are vLLM 0.26's capture sizes for uniform batches of
at most 512 tokens (max_cudagraph_capture_size): B·W <= 512 and B <= max_num_seqs and the verify scratch's rows; a
larger step runs eager. Every bucket writes its hidden states and fp32 logits into one shared static buffer each
[bucket·W, ...]; sampling and the rejection rule stay outside the graphs and read only the real positions,
gathered back into the eager token order, so the accept step is the eager one.

Each bucket has a second, post-sampling graph that follows the accept step: the GDN state commit of every layer,
the MTP layer's slot hidden rows and the MTP drafter (its pass over the bucket's W-token rows, then the k - 1
chained single-row passes, argmax each, into SpecDecoder.draft_tokens). Its only inputs from the accept step are
the emitted tokens and their counts, copied into static buffers on the device (draft()); the drafter's KV limit per
row and max_seq_len = max_model_len (a host bound) are fixed at fill time. A step launched with deferred sampling
(grammars) commits and drafts eagerly from the gathered copies instead: another step may replay the shared
buffers before its sample() runs. A plain decode row runs through the verify kernels as a chunk of one token
padded to W, so its slots are written only by the post-sampling graph's commit (conv entry num_emitted - 1 = 0, and
its one token replayed on the recurrent state): without that graph (another drafter, or a deferred step) a step
with plain decode rows runs eager.

With a k policy, a post-sampling graph is captured per draft count a plan may ask for (StepPlan.num_drafts_next,
0 .. k): its chained passes stop there, and at 0 the MTP layer's first pass runs alone.

Width 1 (a second instance, `width=1`): the all-decode steps without verify chunks that a k policy's k_step = 0
leaves. B rows of one token (not padded to 1 + k) run the plain decode context, so the GDN layers' decode kernels
update the live slots in place as without MTP (no scratch); the post-sampling graph then has no commit, only the
MTP slot hidden rows, the MTP first pass and the chained passes the plan asks for. Its buckets go up to
max_num_seqs (no scratch row caps them).

`capture=False` runs the same code on the same static buffers without capturing (replay = the call), so the CPU
proves everything but the capture itself.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import numpy as np
import torch

from deltaserve.kernels.gdn import write_slots
from deltaserve.model.context import ForwardContext, forward_context
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.cuda_graph import buckets
from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.inputs import StepInputs, StepLayout
from deltaserve.runner.mtp_drafter import chain_drafts
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_commit import GdnStacks, commit_gdn_states
from deltaserve.step import StepPlan

logger = logging.getLogger(__name__)

MAX_CAPTURE_TOKENS = 512  # vLLM 0.26's default max_cudagraph_capture_size


def max_verify_batch(num_speculative_tokens: int, max_num_seqs: int, max_spec_seqs: int) -> int:
    """The largest bucket: B·(1 + k) <= 512 tokens, B <= max_num_seqs and the verify scratch's rows."""
    return min(MAX_CAPTURE_TOKENS // (1 + num_speculative_tokens), max_num_seqs, max_spec_seqs)


def verify_static_bytes(
    max_batch: int, width: int, vocab_size: int, hidden_size: int, dtype: torch.dtype, has_drafter: bool
) -> int:
    """Device memory the verify graphs keep beyond the cache for the largest bucket, max_batch rows of width tokens:
    the shared fp32 logits buffer, the lm_head output in the model dtype (the graph pool holds it) and the static
    hidden states of every token; with the drafter's post-sampling graph, its draft logits (fp32 and the lm_head's
    output) over the bucket's rows, which the pool holds too."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows = max_batch * width + (max_batch if has_drafter else 0)
    return rows * vocab_size * (4 + itemsize) + max_batch * width * hidden_size * itemsize


class VerifyGraphs:
    def __init__(
        self,
        model: Qwen35Model,
        max_batch: int,
        num_speculative_tokens: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        vocab_size: int,
        device: torch.device,
        block_size: int,
        draft_tokens: torch.Tensor | None = None,
        capture: bool = True,
        draft_counts: tuple[int, ...] | None = None,
        width: int | None = None,
        pool: object = None,
        stacks: GdnStacks | None = None,
    ) -> None:
        """max_batch: the largest bucket (max_verify_batch); draft_tokens: SpecDecoder.draft_tokens [rows + 1, k]
        when the MTP layer drafts (then each bucket gets a post-sampling graph per entry of draft_counts as well;
        None: the caller commits and drafts eagerly); capture=False: replay runs the same code eagerly on the static
        buffers (the CPU's way to prove the path); draft_counts: the drafts a step may ask the drafter for
        (StepPlan.num_drafts_next: k alone without the k policy, 0 .. k with it; default (k,)); width: tokens a row
        (default 1 + k; 1: the all-decode steps without verify chunks, see the module docstring); pool: the memory
        pool of graphs captured before (None: the first capture makes one); stacks: the SpecDecoder's gdn_stacks
        over the verify scratch these graphs commit from (None: the per-layer commit)."""
        width = 1 + num_speculative_tokens if width is None else width
        if max_batch < 1:
            raise ValueError(f"no verify bucket fits: k = {num_speculative_tokens} needs {width} tokens a row, the "
                             f"capture limit is {MAX_CAPTURE_TOKENS}")  # fmt: skip
        self.model = model
        self.gdn_stacks = stacks
        self.width = width
        self.is_decode = width == 1  # plain decode rows alone: the decode kernels write the live slots
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_counts = (num_speculative_tokens,) if draft_counts is None else tuple(sorted(set(draft_counts)))
        self.max_seq_len = max_seq_len
        self.device = device
        self.is_captured = capture
        self.sizes, self.max_batch, self.capacity = buckets(max_batch)
        cap = self.capacity
        tokens = cap * width
        self.max_tokens = tokens
        self.block_size = block_size
        # int64 regions: positions [3, N] | slot_mapping [N] | token_index [cap, W] | table rows [cap] | gather [N] |
        # sampled [N] | KV limit [cap] | starts [cap]; int32: seq_lens [cap] | state slots [cap]   (N = cap·W)
        self._long_sizes = (3 * tokens, tokens, tokens, cap, tokens, tokens, cap, cap)
        self.long = torch.zeros(sum(self._long_sizes), dtype=torch.int64, device=device)
        positions, slots, token_index, rows, gather, sampled, limit, starts = self.long.split(self._long_sizes)
        self.positions = positions.view(3, tokens)
        self.slot_mapping = slots
        self.token_index = token_index.view(cap, width)
        self.rows = rows
        self.gather = gather  # [N] eager token t's row in the padded layout (first T entries)
        self.sampled = sampled  # [N] the sampled positions' rows in the padded layout (first P entries)
        self.kv_limit = limit  # [cap] tokens each row's KV blocks cover (the drafter's chained passes stop there)
        self.starts = starts  # [cap] tokens each row had computed before the step
        self.kv_limit.fill_(1)
        self.short = torch.zeros(2 * cap, dtype=torch.int32, device=device)
        self.seq_lens, self.state_indices = self.short.split((cap, cap))
        self.slot_mapping.fill_(-1)
        self.token_index.fill_(-1)
        self.seq_lens.fill_(width)
        self.state_indices.fill_(-1)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(cap, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = (torch.arange(cap + 1, dtype=torch.int32) * width).to(device)
        self.has_initial_state = torch.ones(cap, dtype=torch.int32, device=device)
        self.no_prefill = torch.zeros(4, dtype=torch.int32, device=device)  # empty prefill fields, aligned
        self.hidden = torch.empty(tokens, model.config.hidden_size, dtype=model.embed_tokens.dtype, device=device)
        self.logits = torch.empty(tokens, vocab_size, dtype=torch.float32, device=device)
        # the post-sampling inputs, filled on the device from the accept step, and the drafts
        self.draft_tokens = draft_tokens
        if draft_tokens is not None:  # until a step fills them, every row is the dummy row (the capture drafts)
            self.rows.fill_(draft_tokens.shape[0] - 1)
        self.emitted = torch.full((cap, width), -1, dtype=torch.int64, device=device)  # [cap, W] -1 past num_emitted
        self.num_emitted = torch.ones(cap, dtype=torch.int64, device=device)  # [cap]
        self.drafts = torch.zeros(cap, num_speculative_tokens, dtype=torch.int64, device=device)
        self.row_qsl = torch.arange(cap + 1, dtype=torch.int32, device=device)  # one query a row (chained passes)
        self.row_base = torch.arange(cap, dtype=torch.int64, device=device) * width  # [cap] each row's first token
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.post_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bucket, drafts proposed)
        self.pool = pool
        self.size = 0  # the bucket the last run() replayed (draft() replays its post-sampling graph)

    @property
    def has_drafter(self) -> bool:
        return self.draft_tokens is not None

    def _context(self, size: int) -> ForwardContext:
        num_tokens = size * self.width
        # the plain decode path (runner/cuda_graph.py's context): no scratch, no commit
        context = ForwardContext(
            num_decode_tokens=size,
            num_prefill_tokens=0,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:num_tokens],
            max_query_len=self.width,
            max_seq_len=self.max_seq_len,
            state_indices=self.state_indices[:size],
            has_initial_state=self.has_initial_state[:size],
            prefill_query_start_loc=self.no_prefill[:1],
            prefill_state_indices=self.no_prefill[:0],
            prefill_has_initial_state=self.no_prefill[:0],
        )
        if self.is_decode:
            return context
        # verify rows: every token a spec token, the scratch's state indices and token columns
        return dataclasses.replace(
            context,
            num_decode_tokens=0,
            num_spec_tokens=num_tokens,
            spec_state_indices=self.state_indices[:size],
            spec_token_index=self.token_index[:size],
        )

    def _forward(self, size: int) -> None:
        num_tokens = size * self.width
        with forward_context(self._context(size)):
            hidden = self.model(self.input_ids[:num_tokens], self.positions[:, :num_tokens])  # [N, H]
        self.hidden[:num_tokens].copy_(hidden)
        self.model.compute_logits(hidden, out=self.logits[:num_tokens])

    def _after_accept(self, size: int, num_drafts: int) -> None:
        """What follows the accept step, over the bucket's rows: each GDN layer's live slot <- the state after the
        last accepted token (runner/spec_commit.py: the conv window copied, the accepted tokens replayed), the MTP
        layer's slot hidden row <- that token's hidden state, then the MTP drafter (runner/mtp_drafter.py) over the
        padded rows and its chained passes up to num_drafts drafts (0: the first pass alone), into draft_tokens.
        The eager twins are SpecDecoder.commit and SpecDecoder.propose with the MtpDrafter."""
        num_tokens = size * self.width
        model, mtp = self.model, self.model.mtp
        slots = self.state_indices[:size]
        num_emitted = self.num_emitted[:size]
        if not self.is_decode:  # width 1: the decode kernels wrote the live slots
            commit_gdn_states(model, self.gdn_stacks, slots, num_emitted - 1, self.width)  # one launch, all layers
        last = self.row_base[:size] + num_emitted - 1  # [size] each row's last accepted token
        hidden = self.hidden[:num_tokens]
        save_rows(mtp.slot_hidden, slots, hidden.index_select(0, last))
        # the MTP layer pairs each position's hidden state with the token emitted after it (0 past the accepted run:
        # those rows' MTP KV is rewritten by the next step, as in the eager drafter)
        next_ids = self.emitted[:size].clamp(min=0).reshape(-1)  # [N]
        positions = self.positions[:, :num_tokens]
        with forward_context(self._context(size)):
            out = mtp(next_ids, positions, hidden)  # [N, H]; MTP KV at the real positions' slots
        if not num_drafts:  # the next step verifies no drafts: the first pass kept the MTP KV up, that is all
            return
        drafts = self.drafts[:size]
        chain_drafts(model, out.index_select(0, last), positions.index_select(1, last),
                     self.starts[:size] + num_emitted - 1, self.kv_limit[:size], self.block_tables[:size],
                     self.block_size, self.max_seq_len, self.row_qsl[: size + 1], drafts[:, :num_drafts])  # fmt: skip
        # columns past num_drafts carry an older step's values: no verify reads them (the scheduler's cap)
        self.draft_tokens.index_copy_(0, self.rows[:size], drafts)  # the bucket's padded rows: the dummy row

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, sharing one memory pool (capture=False: nothing to do)."""
        if not self.is_captured:
            logger.info("verify graphs: buckets %s of %d tokens a row, run uncaptured", self.sizes, self.width)
            return
        for size in reversed(self.sizes):
            self.graphs[size] = self._capture(self._forward, size)
            for num_drafts in self.draft_counts if self.has_drafter else ():
                post = functools.partial(self._after_accept, num_drafts=num_drafts)
                self.post_graphs[size, num_drafts] = self._capture(post, size)
        torch.cuda.synchronize()
        logger.info(
            "captured %d verify CUDA graphs and %d post-sampling graphs (batch sizes %s, %d tokens a row, %s drafts "
            "proposed: steps of up to %d sequences and %d tokens; larger verify steps run eager)", len(self.graphs),
            len(self.post_graphs), self.sizes, self.width, list(self.draft_counts), self.max_batch,
            self.max_batch * self.width,
        )  # fmt: skip

    def _capture(self, body: Callable[[int], None], size: int) -> torch.cuda.CUDAGraph:
        body(size)  # warm-up outside the graph (Triton compiles, allocator settles); every slot is -1: no state moves
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body(size)
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    def can_run(self, plan: StepPlan, layout: StepLayout, block_size: int, is_deferred: bool) -> bool:
        """Whether this step is a verify step the graphs run (see the module docstring). Plain decode rows ride
        along only when the post-sampling graph commits them (not for a deferred step's eager commit, which
        commits verify chunks alone)."""
        num_seqs = len(layout.rows)
        has_decodes = bool(plan.num_decodes)
        k = self.num_speculative_tokens
        num_drafts = k if plan.num_drafts_next is None else max(0, min(plan.num_drafts_next, k))
        if self.is_decode:  # plain decodes alone, every one sampling its device-side last token
            is_step = layout.spec is None and plan.num_decodes == num_seqs and layout.num_tokens == num_seqs
        else:
            is_step = layout.spec is not None and layout.num_tokens == len(layout.device_token_index) + len(
                layout.spec.draft_token_index
            )
        return (
            is_step
            and (not self.has_drafter or num_drafts in self.draft_counts)  # a post-sampling graph for it
            and (not has_decodes or (self.has_drafter and not is_deferred))
            and num_seqs <= self.max_batch
            and not layout.state_saves
            and len(layout.sample_seqs) == num_seqs
            and len(layout.device_token_index) == num_seqs  # every row's first token is its last sample
            and int(layout.num_new.max()) <= self.width
            and int(-(-(layout.starts.max() + self.width) // block_size)) <= self.block_tables.shape[1]
            and not any(seq.return_logits or seq.mm_spans for seq in plan.seqs)
        )

    def run(
        self, layout: StepLayout, inputs: StepInputs, table: RequestTable, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fills the static buffers from the step's layout and its eager inputs (the input ids: the rows' last
        samples and drafts, already gathered on the device) and replays the step's bucket. Returns the hidden
        states [T, H] and the sampled positions' logits [P, V] in the eager token order."""
        num_seqs = len(layout.rows)
        size = next(s for s in self.sizes if s >= num_seqs)
        width, cap, tokens = self.width, self.capacity, self.max_tokens
        cap_blocks = self.block_tables.shape[1]
        num_new, qsl = layout.num_new, layout.query_start_loc
        columns = np.arange(width)
        is_real = columns[None, :] < num_new[:, None]  # [B, W]
        padded = np.arange(num_seqs)[:, None] * width + columns[None, :]  # [B, W] each position's padded row
        eager = qsl[:-1, None] + columns[None, :]  # [B, W] its eager row where real
        gather = padded[is_real]  # [T] (row-major: the eager token order)
        long = np.zeros(self.long.shape[0], dtype=np.int64)
        regions = np.split(long, np.cumsum(self._long_sizes)[:-1])
        positions, slots, token_index, rows, gather_host, sampled_host, limit, starts = regions
        positions = positions.reshape(3, tokens)
        # padded positions continue the row's positions (any value would do: nothing reads them)
        first = layout.positions[:, qsl[:-1]]  # [3, B]
        row_positions = first[:, :, None] + columns[None, None, :]  # [3, B, W]
        row_positions[:, is_real] = layout.positions[:, eager[is_real]]
        positions[:, : num_seqs * width] = row_positions.reshape(3, -1)
        slots[:] = -1
        slots[gather] = layout.slot_mapping
        token_index.reshape(cap, width)[:] = -1
        token_index.reshape(cap, width)[:num_seqs] = np.where(is_real, padded, -1)
        rows[:num_seqs] = layout.rows
        rows[num_seqs:] = table.dummy_row
        limit[:num_seqs] = table.num_blocks[layout.rows] * block_size
        limit[num_seqs:] = 1  # padded rows: context 1 (the dummy row's zero block), no MTP KV written
        starts[:num_seqs] = layout.starts
        gather_host[: len(gather)] = gather
        sample_index = layout.sample_token_index
        sampled_host[: len(sample_index)] = gather[sample_index]
        short = np.zeros(2 * cap, dtype=np.int32)
        short[:num_seqs] = layout.starts + width
        short[num_seqs:cap] = width
        short[cap : cap + num_seqs] = layout.state_slots
        short[cap + num_seqs :] = -1  # the bucket's padded rows: no state
        if is_cuda(self.device):
            self.long.copy_(torch.from_numpy(long).pin_memory(), non_blocking=True)
            self.short.copy_(torch.from_numpy(short).pin_memory(), non_blocking=True)
        else:
            self.long.copy_(torch.from_numpy(long))
            self.short.copy_(torch.from_numpy(short))
        gather_dev = self.gather[: len(gather)]
        self.input_ids.index_copy_(0, gather_dev, inputs.input_ids)
        shift = inputs.start_shift
        if shift is not None:  # chained chunks (runner/spec_chain.py): the eager inputs moved back, so do these
            self.positions[:, : num_seqs * width] -= shift[:num_seqs].repeat_interleave(width)
            self.slot_mapping.index_copy_(0, gather_dev, inputs.ctx.slot_mapping)
            self.starts[:num_seqs] -= shift
            self.seq_lens[:num_seqs] -= shift.to(torch.int32)
        # the verify reaches start + W; the drafter's chained passes write up to the row's last block (lookahead)
        num_blocks = int(table.num_blocks[layout.rows].max())
        block_width = min(max(int(-(-(layout.starts.max() + width) // block_size)), num_blocks), cap_blocks)
        self.block_tables[:size, :block_width] = table.block_table[:, :block_width].index_select(0, self.rows[:size])
        self.size = size
        if self.is_captured:
            self.graphs[size].replay()
        else:
            self._forward(size)
        hidden = self.hidden.index_select(0, gather_dev)  # [T, H]
        logits = self.logits.index_select(0, self.sampled[: len(sample_index)])  # [P, V]
        return hidden, logits

    def draft(
        self, seq_tokens: torch.Tensor, tokens: torch.Tensor | None, num_emitted: torch.Tensor | None,
        num_decodes: int, num_drafts: int,
    ) -> None:  # fmt: skip
        """After the accept step of the step run() just replayed: each row's emitted tokens into the static
        buffers, then the post-sampling replay (commit, hidden rows, num_drafts drafts a row). seq_tokens [B]: every
        row's next input in plan order (a plain decode's one token); tokens [S, W'] and num_emitted [S]: the verify
        chunks' emitted tokens (-1 past their count), rows num_decodes .. num_decodes + S - 1."""
        self.emitted.fill_(-1)
        self.emitted[: seq_tokens.shape[0], 0].copy_(seq_tokens)  # a plain decode emits its one token
        self.num_emitted.fill_(1)
        if tokens is not None:  # verify chunks (none in a width-1 step)
            num_seqs, width = tokens.shape
            self.emitted[num_decodes : num_decodes + num_seqs, :width].copy_(tokens)
            self.num_emitted[num_decodes : num_decodes + num_seqs].copy_(num_emitted)
        if num_drafts not in self.draft_counts:
            raise ValueError(f"no post-sampling graph proposes {num_drafts} drafts (captured: {self.draft_counts})")
        if self.is_captured:
            self.post_graphs[self.size, num_drafts].replay()
        else:
            self._after_accept(self.size, num_drafts)


def save_rows(buffer: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """buffer[slots[s]] <- values[s] where slots[s] >= 0, without a host sync (kernels/gdn.py write_slots: a padded
    row is aimed at an anchor slot with the value that slot ends with, so duplicate indices carry identical values)."""
    slots = slots.long()
    write_slots(buffer, slots, values, slots >= 0)
