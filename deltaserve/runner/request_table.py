"""RequestTable: the runner's persistent view of the running requests, one row each, patched by every plan.

A plan's `removed` rows are cleared, its `added` requests fill rows, and each scheduled sequence's new block ids are
appended to its row. What lives here, so that a step costs only the diffs:
- host: each row's prompt tokens (resumed outputs included), block table, sampling parameters and counters;
- device: the block table [rows, max_blocks], the per-row sampling parameters [rows, 7], the token each row sampled
  last (the next decode's input under async scheduling, never copied through the host), for rows that use
  penalties, output-token counts and a prompt mask [P, V] updated in place after every sample, and for rows with
  logit_bias / allowed_token_ids / single-token bad_words one static bias row [V] (set once at add).
One extra row (`dummy_row`) stays empty: padded CUDA-graph rows read it.
"""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.sampler.batch import has_penalty, host_flags, min_tokens_keys, params_row, seeded_generators
from deltaserve.sampler.logits_processors import StaticBias, single_token_bad_words, static_bias_row
from deltaserve.sampler.penalties import PenaltyInputs
from deltaserve.sampler.sampler import NUM_PARAMS, SAMPLING_EPS, SamplingBatch
from deltaserve.sampler.transfer import to_device
from deltaserve.step import NewRequest, StepPlan

_EMPTY = np.zeros(0, dtype=np.int64)


class RequestTable:
    def __init__(self, max_rows: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device) -> None:
        num = max_rows + 1
        self.max_rows = max_rows
        self.dummy_row = max_rows
        self.vocab_size = vocab_size
        self.device = device
        self.req_ids: list[str | None] = [None] * num
        self.keys = np.zeros(num, dtype=np.int64)  # the occupant's identity: a new key at every add
        self._next_key = 1
        self.prompts: list[np.ndarray] = [_EMPTY] * num
        self.num_prompt = np.zeros(num, dtype=np.int64)
        self.num_sampled = np.zeros(num, dtype=np.int64)  # outputs produced so far (resumed ones included)
        self.num_blocks = np.zeros(num, dtype=np.int64)
        self.block_table_host = np.zeros((num, max_blocks_per_seq), dtype=np.int32)
        self.block_table = torch.zeros(num, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.last_sampled = torch.zeros(num, dtype=torch.int64, device=device)
        # each row's true next start after its last sampling step, on the device (async verify: runner/spec_chain.py)
        self.next_start = torch.zeros(num, dtype=torch.int64, device=device)
        self.params_host = np.zeros((num, NUM_PARAMS), dtype=np.float32)
        self.params_host[:, 1] = vocab_size  # top_k off
        self.params = torch.from_numpy(self.params_host.copy()).to(device)
        self.seeds: list[int | None] = [None] * num
        self.num_logprobs = np.full(num, -1, dtype=np.int64)
        self.logprob_ids: list[tuple[int, ...] | None] = [None] * num  # logprob_token_ids: these instead of a top-N
        self.min_tokens = np.zeros(num, dtype=np.int64)
        self.stop_ids: list[tuple[int, ...]] = [()] * num
        self.mrope: list[np.ndarray | None] = [None] * num  # [3, num_prompt] where positions are not the index
        self.mrope_delta = np.zeros(num, dtype=np.int64)
        self.mm: list[MultimodalInput | None] = [None] * num
        # per row: encoder outputs [n_i, H] by item index, kept until the item's last placeholder is computed
        self.encoder_outputs: list[dict[int, torch.Tensor]] = [{} for _ in range(num)]
        self.penalty_index = np.full(num, -1, dtype=np.int64)  # row -> row of the penalty tensors
        self.penalty_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)  # [capacity, V]
        self.penalty_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free_penalty: list[int] = []
        self.bias_index = np.full(num, -1, dtype=np.int64)  # row -> row of the static bias pool
        self.bias_pool = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)  # [capacity, V]
        self._free_bias: list[int] = []
        # prompt logprobs: top-N asked (-1: none) and the original prompt's length (a resumed row's prompt holds
        # its earlier outputs too, which get no prompt logprobs)
        self.num_prompt_logprobs = np.full(num, -1, dtype=np.int64)
        self.num_original_prompt = np.zeros(num, dtype=np.int64)
        self._dirty_params: list[int] = []

    @property
    def num_active(self) -> int:
        return sum(1 for r in self.req_ids[: self.max_rows] if r is not None)

    # -- plan diffs -----------------------------------------------------------------------------------

    def apply(self, plan: StepPlan) -> None:
        """Clears removed rows, fills added ones, appends new blocks; device copies are queued, not waited on."""
        for row in plan.removed:
            self._clear(row)
        for request in plan.added:
            self._add(request)
        block_index: list[int] = []
        block_values: list[int] = []
        width = self.block_table_host.shape[1]
        for seq in plan.seqs:
            if not seq.new_block_ids:
                continue
            first = int(self.num_blocks[seq.row])
            count = len(seq.new_block_ids)
            if first + count > width:
                raise ValueError(f"row {seq.row}: {first + count} blocks exceed the table's {width}")
            self.block_table_host[seq.row, first : first + count] = seq.new_block_ids
            self.num_blocks[seq.row] = first + count
            block_index.extend(range(seq.row * width + first, seq.row * width + first + count))
            block_values.extend(seq.new_block_ids)
        if block_index:
            self.block_table.view(-1).index_copy_(
                0, to_device(block_index, torch.int64, self.device), to_device(block_values, torch.int32, self.device)
            )
        if self._dirty_params:
            rows = self._dirty_params
            self.params.index_copy_(
                0,
                to_device(rows, torch.int64, self.device),
                to_device(self.params_host[rows], torch.float32, self.device),
            )
            self._dirty_params = []

    def _clear(self, row: int) -> None:
        self.req_ids[row] = None
        self.prompts[row] = _EMPTY
        self.num_prompt[row] = self.num_sampled[row] = self.num_blocks[row] = 0
        self.mrope[row] = None
        self.mm[row] = None
        self.encoder_outputs[row] = {}
        index = int(self.penalty_index[row])
        if index >= 0:
            self._free_penalty.append(index)
            self.penalty_index[row] = -1
        index = int(self.bias_index[row])
        if index >= 0:
            self._free_bias.append(index)
            self.bias_index[row] = -1
        self.num_prompt_logprobs[row] = -1

    def _add(self, request: NewRequest) -> None:
        row = request.row
        if self.req_ids[row] is not None:
            self._clear(row)  # a row reused without a removal first: the scheduler dropped its old occupant
        params = request.sampling
        self.req_ids[row] = request.req_id
        self.keys[row] = self._next_key
        self._next_key += 1
        self.prompts[row] = np.asarray(request.prompt_token_ids, dtype=np.int64)
        self.num_prompt[row] = len(request.prompt_token_ids)
        self.num_sampled[row] = len(request.output_token_ids)
        self.num_blocks[row] = 0
        self.params_host[row] = params_row(params, self.vocab_size)
        self._dirty_params.append(row)
        self.seeds[row] = params.seed
        self.num_logprobs[row] = -1 if params.num_logprobs is None else params.num_logprobs
        self.logprob_ids[row] = None if params.logprob_token_ids is None else tuple(params.logprob_token_ids)
        self.min_tokens[row] = params.min_tokens
        self.stop_ids[row] = request.stop_token_ids
        self.mrope[row] = None if request.mrope_positions is None else np.asarray(request.mrope_positions, np.int64)
        self.mrope_delta[row] = request.mrope_delta
        self.mm[row] = request.mm_input
        if request.mm_input is not None:
            self.mrope[row] = request.mm_input.mrope_positions
            self.mrope_delta[row] = request.mm_input.mrope_delta
        if has_penalty(params):
            self._init_penalties(row, request)
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.num_original_prompt[row] = len(request.prompt_token_ids) - len(request.output_token_ids)
        bias = static_bias_row(self.vocab_size, params.logit_bias, params.allowed_token_ids,
                               single_token_bad_words(params.bad_words_token_ids))  # fmt: skip
        if bias is not None:
            self._init_bias(row, bias)

    def _init_bias(self, row: int, bias: np.ndarray) -> None:
        if not self._free_bias:
            old = self.bias_pool.shape[0]
            new = max(8, 2 * old)
            self.bias_pool = torch.cat([self.bias_pool, self.bias_pool.new_zeros(new - old, self.vocab_size)])
            self._free_bias.extend(range(old, new))
        index = self._free_bias.pop()
        self.bias_index[row] = index
        self.bias_pool[index].copy_(to_device(bias, torch.float32, self.device))

    def _init_penalties(self, row: int, request: NewRequest) -> None:
        if not self._free_penalty:
            old = self.penalty_counts.shape[0]
            new = max(8, 2 * old)
            self.penalty_counts = torch.cat(
                [self.penalty_counts, self.penalty_counts.new_zeros(new - old, self.vocab_size)]
            )
            self.penalty_prompt = torch.cat(
                [self.penalty_prompt, self.penalty_prompt.new_zeros(new - old, self.vocab_size)]
            )
            self._free_penalty.extend(range(old, new))
        index = self._free_penalty.pop()
        self.penalty_index[row] = index
        num_prompt = len(request.prompt_token_ids) - len(request.output_token_ids)
        prompt = np.asarray(request.prompt_token_ids[:num_prompt], dtype=np.int64)
        outputs = np.asarray(request.output_token_ids, dtype=np.int64)
        prompt = prompt[(prompt >= 0) & (prompt < self.vocab_size)]
        outputs = outputs[(outputs >= 0) & (outputs < self.vocab_size)]
        counts = np.bincount(outputs, minlength=self.vocab_size).astype(np.int32)
        mask = np.zeros(self.vocab_size, dtype=np.bool_)
        mask[prompt] = True
        self.penalty_counts[index].copy_(to_device(counts, torch.int32, self.device))
        self.penalty_prompt[index].copy_(to_device(mask, torch.bool, self.device))

    # -- sampling -------------------------------------------------------------------------------------

    def sampling_batch(
        self, rows: np.ndarray, rows_dev: torch.Tensor, offsets: np.ndarray | None = None
    ) -> SamplingBatch:
        """The SamplingBatch of the sampling rows of a step (rows: table rows, in sampling order). offsets: per
        batch row, how many outputs past the row's next one it samples (a verify chunk's positions 1 .. k; seeds
        and min_tokens follow the output index)."""
        values = self.params_host[rows]
        num_sampled = self.num_sampled[rows] if offsets is None else self.num_sampled[rows] + offsets
        flags = host_flags(values, self.vocab_size)
        generators: dict[int, torch.Generator] = {}
        if flags["num_random"]:
            seeds = [self.seeds[r] for r in rows]
            if any(s is not None for s in seeds):
                is_random = values[:, 0] >= SAMPLING_EPS
                generators = seeded_generators(seeds, num_sampled.tolist(), is_random, self.device)
        penalties = None
        index = self.penalty_index[rows]
        if (index >= 0).any():
            positions = np.nonzero(index >= 0)[0]
            pool_rows = to_device(index[positions], torch.int64, self.device)
            penalties = PenaltyInputs(
                rows=to_device(positions, torch.int64, self.device),
                output_counts=self.penalty_counts.index_select(0, pool_rows),
                prompt_mask=self.penalty_prompt.index_select(0, pool_rows),
            )
        static_bias = None
        index = self.bias_index[rows]
        if (index >= 0).any():
            positions = np.nonzero(index >= 0)[0]
            pool_rows = to_device(index[positions], torch.int64, self.device)
            static_bias = StaticBias(
                rows=to_device(positions, torch.int64, self.device), values=self.bias_pool.index_select(0, pool_rows)
            )
        is_under = num_sampled < self.min_tokens[rows]
        keys = None
        if is_under.any():
            keys = min_tokens_keys([self.stop_ids[r] for r in rows], is_under.tolist(), self.vocab_size, self.device)
        asked = self.num_logprobs[rows]
        any_asked = bool((asked >= 0).any())
        listed = [self.logprob_ids[r] for r in rows] if any_asked else []
        return SamplingBatch(
            params=self.params.index_select(0, rows_dev),
            generators=generators,
            penalties=penalties,
            min_tokens_keys=keys,
            num_logprobs=tuple(asked.tolist()) if any_asked else None,
            logprob_ids=tuple(listed) if any(ids is not None for ids in listed) else None,
            static_bias=static_bias,
            **flags,
        )

    def record_sampled(self, rows: np.ndarray, rows_dev: torch.Tensor, token_ids: torch.Tensor) -> None:
        """After a sample: the device keeps each row's token (the next decode's input) and its penalty counts."""
        self.last_sampled.index_copy_(0, rows_dev, token_ids)
        self.num_sampled[rows] += 1
        index = self.penalty_index[rows]
        if (index >= 0).any():
            positions = np.nonzero(index >= 0)[0]
            tokens = token_ids.index_select(0, to_device(positions, torch.int64, self.device))
            pool_rows = to_device(index[positions], torch.int64, self.device)
            ones = torch.ones(len(positions), dtype=torch.int32, device=self.device)
            self.penalty_counts.index_put_((pool_rows, tokens), ones, accumulate=True)
