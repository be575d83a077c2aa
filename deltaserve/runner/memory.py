"""Memory sizing of the runner at start-up: the warm-up that measures the activation peak on a throw-away cache,
the cache budget that remains of this engine's share of the GPU once the weights, that peak, the CUDA graphs'
static buffers and a fixed headroom are taken out (vLLM 0.26's `gpu_memory_utilization` accounting), and how that
budget is split between the state pool, the verify scratch, the prefix-cache checkpoints and the KV blocks. While
speculating, the warm-up also runs the drafter after its prefills and one verify step (runner/verify_warmup.py).
With --gdn-prefill-backend flashinfer it first compiles FlashInfer's kernels, and the budget keeps that path's state
copies for every sequence a step may hold (kernels/gdn_flashinfer.py).

The functions take the ModelRunner under construction: the warm-up runs real steps through its execute().
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from deltaserve.engine_config import EngineConfig
from deltaserve.kernels import gdn_flashinfer
from deltaserve.kernels.gdn import CHUNK_SIZE as GDN_CHUNK_SIZE
from deltaserve.kernels.gdn import uses_flashinfer
from deltaserve.model.layers.gdn import GatedDeltaNet
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.cache import (
    CHECKPOINT_SHARE,
    CacheLayout,
    affordable_slots,
    allocate_and_bind,
    bytes_per_block,
    bytes_per_slot,
    check_one_sequence_fits,
    checkpoint_slots,
    plan_cache,
    verify_row_bytes,
    whole_sequences,
)
from deltaserve.runner.cuda_graph import buckets, static_bytes
from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.mtp_drafter import MtpDrafter
from deltaserve.runner.one_pool import one_pool_max_num_seqs, plan_one_pool
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_decode import SpecDecoder
from deltaserve.runner.spec_graphs import max_verify_batch, verify_static_bytes
from deltaserve.runner.spec_layout import scratch_rows, speculating_seqs
from deltaserve.runner.verify_warmup import PeakMeter, verify_warmup_rows, warm_up_verify
from deltaserve.sampler import Sampler, build_sampling_batch
from deltaserve.sampler.rejection import random_accept
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import NewRequest, ScheduledSeq, StepPlan

if TYPE_CHECKING:  # runner/model_runner.py imports this module
    from deltaserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GIB = 2**30
# the graph pool's activations beyond the graphs' static buffers, and the libraries' workspaces
HEADROOM_BYTES = 512 * 2**20


def default_max_num_seqs(device: torch.device) -> int:
    """vLLM 0.26's default for its API server: 1024 on GPUs of >= 70 GiB other than the A100, else 256."""
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        if props.total_memory >= 70 * GIB and "a100" not in props.name.lower():
            return 1024
    return 256


def warmup_plan(
    step_id: int, num_tokens: int, max_seq_len: int, block_size: int, vocab_size: int,
    checkpoint_slot: int | None = None,
) -> StepPlan:  # fmt: skip
    """Fresh prefill sequences of at most max_seq_len tokens each, num_tokens in all, on rows 0, 1, ..., disjoint
    blocks and state slots 0, 1, ... of a throw-away cache; they sample nothing. With checkpoint_slot, the first
    sequence, when longer than a GDN chunk, saves an in-step prefix-cache checkpoint at 64 there, so the chunked
    prefill's checkpoint variant compiles before serving (runner/step_checkpoints.py)."""
    added, seqs = [], []
    next_block = 0
    for index, start in enumerate(range(0, num_tokens, max_seq_len)):
        length = min(max_seq_len, num_tokens - start)
        num_blocks = -(-length // block_size)
        tokens = tuple((7 * i + index) % vocab_size for i in range(length))
        added.append(NewRequest(index, f"warmup-{index}", tokens, (), SamplingParams(temperature=0.0), ()))
        blocks = tuple(range(next_block, next_block + num_blocks))
        checkpoints = ((GDN_CHUNK_SIZE, checkpoint_slot),) if index == 0 and checkpoint_slot is not None else ()
        if length <= GDN_CHUNK_SIZE:
            checkpoints = ()
        seqs.append(ScheduledSeq(index, 0, length, index, None, blocks, needs_sample=False, checkpoints=checkpoints))
        next_block += num_blocks
    return StepPlan(step_id, tuple(seqs), tuple(added), removed=tuple(range(len(added))))


def profile_peak_bytes(runner: ModelRunner, num_tokens: int, max_seq_len: int, max_num_seqs: int) -> int:
    """Warm-up on a throw-away cache: prefills of num_tokens (the largest step) and every power of two below
    it, so Triton compiles and autotunes the prefill shapes (the MoE and attention kernels key their configs on
    power-of-two size buckets) before serving, not during it; then the sampler over max_num_seqs rows with
    top-k/top-p (its sort is the largest sampling buffer). While speculating, the MTP drafter runs after each of
    those prefills (its layer over the step's tokens, as after a served prefill), the sampling side of the largest
    verify bucket runs alone (warm_up_verify_sampling), and then one plain decode step and one verify step as large
    as the engine may serve run through execute() on a throw-away cache of their own (runner/verify_warmup.py).
    Returns the activation peak in bytes: the larger of the two phases' (0 off CUDA, where the same steps run
    unmeasured). A step may hold more tokens than one sequence (max_num_batched_tokens > max_model_len), so a size
    above max_seq_len runs as several sequences, as the scheduler would batch them."""
    meter = PeakMeter(runner.device)
    weights = meter.allocated() - runner._allocated_before
    if uses_flashinfer(runner.gdn_prefill_backend):  # both of FlashInfer's kernels compile here, not in a served step
        gdn = first_gdn_layer(runner.model)
        gdn_flashinfer.warm_up(gdn.num_k_heads, gdn.head_k_dim, gdn.A_log, gdn.dt_bias)
    max_seqs = -(-num_tokens // max_seq_len)
    # with the prefix cache, one more slot: the in-step checkpoint of each step's first sequence (warmup_plan)
    checkpoint_slot = max_seqs if runner.engine_config.enable_prefix_caching else None
    num_slots = max_seqs + (checkpoint_slot is not None)
    layout = CacheLayout(-(-num_tokens // runner.block_size) + max_seqs, runner.block_size, num_slots, 0, 0)
    allocate_and_bind(runner.model, runner.model_config, layout, runner.dtype, runner.device)
    saved_table, saved_spec = getattr(runner, "table", None), runner.spec
    runner.table = RequestTable(max_seqs, -(-max_seq_len // runner.block_size), runner.vocab_size, runner.device)
    speculative = runner.engine_config.speculative_config
    runner.spec = None  # the runner's own SpecDecoder (none yet at start-up) is not the warm-up's
    if speculative is not None:  # the drafter after every prefill; one verify chunk of scratch (none runs here)
        k = speculative.num_speculative_tokens
        runner.spec = SpecDecoder(runner.model, max_seqs, k, MtpDrafter(runner.model, k), runner.device,
                                  speculative.synthetic_acceptance_rates, 1)  # fmt: skip
    meter.mark()
    sizes = sorted({num_tokens} | {2**i for i in range(num_tokens.bit_length()) if 2**i < num_tokens}, reverse=True)
    started = time.perf_counter()
    try:
        for step_id, size in enumerate(sizes):
            runner.execute(warmup_plan(step_id, size, max_seq_len, runner.block_size, runner.vocab_size,
                                       checkpoint_slot))  # fmt: skip
            runner.table.apply(StepPlan(-1, (), removed=tuple(range(-(-size // max_seq_len)))))
        params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0)] * max_num_seqs
        batch = build_sampling_batch(params, [[0]] * max_num_seqs, [[]] * max_num_seqs, [()] * max_num_seqs,
                                     runner.vocab_size, runner.device)  # fmt: skip
        runner.sampler(torch.randn(max_num_seqs, runner.vocab_size, device=runner.device), batch)
        verify = ""
        if speculative is not None:  # the largest verify bucket's sampling: 1 + k positions a row, the random rule
            rows = max_verify_batch(k, max_num_seqs, max_num_seqs)
            warm_up_verify_sampling(runner.sampler, rows, k, runner.vocab_size, runner.device)
            verify = f", a verify step's sampling over {rows} rows of {1 + k} positions"
        peak = meter.peak()
    finally:
        runner.table, runner.spec = saved_table, saved_spec
    if speculative is not None:
        # an upper bound of the cache budget (this phase's peak, not yet the verify step's): its verify scratch
        # caps the bucket as it will cap the served one; every rank runs the same step
        budget = given_budget(runner.engine_config, runner.device)
        if budget is None:
            budget = runner._requested_bytes - weights - peak - graph_bytes(runner, max_num_seqs)[1] - HEADROOM_BYTES
        slot_bytes = bytes_per_slot(runner.model_config, runner.dtype, runner.model.shapes)
        row_bytes = verify_row_bytes(runner.model_config, runner.dtype, k, runner.model.shapes)
        is_sized = runner.engine_config.max_num_seqs is None
        has_policy = speculative.k_policy is not None
        rows = verify_warmup_rows(k, max_num_seqs, num_tokens, runner.tp.min_over_ranks(budget), slot_bytes,
                                  row_bytes, is_sized, has_policy)  # fmt: skip
        drop_cache(runner.model)  # the prefill phase's throw-away cache, before the verify step's
        warm_up_verify(runner, rows, meter, len(sizes))
        peak = max(peak, meter.peak())
        verify += f", a plain decode of {rows} rows, a verify step of {rows} rows of {1 + k} tokens with drafts and "
        verify += "the MTP drafter"
    logger.info("warm-up: %d prefill shapes up to %d tokens and the sampler over %d rows%s in %.1f s", len(sizes),
                num_tokens, max_num_seqs, verify, time.perf_counter() - started)  # fmt: skip
    drop_cache(runner.model)  # before the real cache is allocated
    if meter.is_measuring:
        torch.cuda.empty_cache()
    return peak


def drop_cache(model: Qwen35Model) -> None:
    """Unbinds every cache view of the model (KV, GDN states, the verify scratch, the MTP layer's KV and hidden
    rows), so that a throw-away cache's memory is freed before the next one is allocated."""
    for layer in model.layers:
        mixer = layer.mixer
        mixer.k_cache = mixer.v_cache = mixer.conv_states = mixer.ssm_states = None
        mixer.spec_conv_scratch = mixer.spec_row_scratch = None
    if model.mtp is not None:
        model.mtp.attention.k_cache = model.mtp.attention.v_cache = None
        model.mtp.slot_hidden = None


def warm_up_verify_sampling(
    sampler: Sampler, num_seqs: int, num_speculative_tokens: int, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling side of a verify step of num_seqs chunks of 1 + k tokens, every row random with top-k/top-p: the
    sampler over all num_seqs·(1 + k) positions keeping their distributions, then the random rule's [S, k, V]
    gathers and Exp(1) draws (sampler/rejection.py). Returns the rule's (tokens [S, 1 + k], num_emitted [S])."""
    width = 1 + num_speculative_tokens
    positions = num_seqs * width
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * positions
    batch = build_sampling_batch(params, [[0]] * positions, [[]] * positions, [()] * positions, vocab_size, device)
    batch.keep_probs = True
    out = sampler(torch.randn(positions, vocab_size, device=device), batch)
    index = torch.arange(positions, device=device).view(num_seqs, width)
    target = out.token_ids[index]  # [S, W]
    drafts = target[:, 1:].flip(1).contiguous()  # [S, k]: some accepted, some not
    num_drafts = torch.full((num_seqs,), num_speculative_tokens, dtype=torch.int64, device=device)
    is_coupled = torch.zeros(num_seqs, dtype=torch.bool, device=device)  # unseeded rows: the rule's largest work
    probs = out.probs[index[:, :-1]]  # [S, k, V]
    uniforms = torch.rand(num_seqs, num_speculative_tokens, device=device)
    noise = torch.empty(num_seqs, num_speculative_tokens, vocab_size, device=device).exponential_()
    return random_accept(target, drafts, num_drafts, is_coupled, probs, uniforms, noise)


def size_caches(runner: ModelRunner, max_num_batched_tokens: int, max_model_len: int) -> tuple[int, int, CacheLayout]:
    """(max_num_seqs, the verify scratch's rows (0 without speculation), the cache layout) from the cache budget:
    refused unless it holds one max_model_len sequence (as vLLM refuses), then vLLM's default max_num_seqs capped so
    the state pool fits, the verify scratch and the prefix-cache checkpoint slots, and the KV blocks."""
    engine_config, model_config, shapes = runner.engine_config, runner.model_config, runner.model.shapes
    upper = engine_config.max_num_seqs or default_max_num_seqs(runner.device)
    # every rank sizes its cache alike (the plan names the same blocks and slots on all of them): the smallest
    # rank's budget wins
    total = runner.tp.min_over_ranks(cache_budget(runner, max_num_batched_tokens, max_model_len, upper))
    has_mtp = runner.model.mtp is not None
    scratch_bytes = bytes_per_slot(model_config, runner.dtype, shapes)  # one GDN state, all GDN layers
    slot_bytes = bytes_per_slot(model_config, runner.dtype, shapes, has_mtp)  # a pool slot (+ the MTP hidden row)
    one_kv = check_one_sequence_fits(
        total, bytes_per_block(model_config, runner.block_size, runner.dtype, shapes, has_mtp), slot_bytes,
        runner.block_size, max_model_len, *budget_names(engine_config, runner.device),
    )  # fmt: skip
    speculative = engine_config.speculative_config
    if engine_config.one_pool:
        return size_one_pool(runner, total, upper, one_kv, max_model_len, max_num_batched_tokens)
    k = 0 if speculative is None else speculative.num_speculative_tokens
    # while speculating with a fixed k, a running sequence also holds its verify chunk's scratch, 1 + k conv windows
    # and token rows (runner/spec_decode.py); under the k policy the count is sized as without speculation, the
    # scratch apart
    has_policy = speculative is not None and speculative.k_policy is not None
    has_scratch_per_seq = speculative is not None and not has_policy
    row_bytes = verify_row_bytes(model_config, runner.dtype, k, shapes) if speculative is not None else 0
    # FlashInfer's GDN prefill copies a step's start and final states (kernels/gdn_flashinfer.py): room kept for
    # them per sequence a step may hold (the warm-up's steps hold few)
    copy_bytes = flashinfer_copy_bytes(runner)
    per_seq = slot_bytes + (row_bytes if has_scratch_per_seq else 0) + copy_bytes
    beside_one_kv = (total - one_kv) // per_seq  # the sequences the budget holds beside one max_model_len's KV
    max_num_seqs = upper
    if engine_config.max_num_seqs is None:
        # vLLM's default count, sized to memory: the state pool (with the scratch) takes at most half of the cache
        # budget, and leaves one max_model_len sequence its KV blocks (which binds only where the half would leave
        # too few to start)
        if has_scratch_per_seq:
            by_share = speculating_seqs(total, scratch_bytes, row_bytes, upper)
        else:
            by_share = affordable_slots(total, scratch_bytes)
        # or, where more, as many as the budget serves whole at max_model_len (docs/ARCHITECTURE.md#cache-budget)
        reserved = CHECKPOINT_SHARE if engine_config.enable_prefix_caching else 0.0
        by_whole = whole_sequences(total, per_seq, one_kv, reserved)
        max_num_seqs = min(upper, max(by_share, by_whole), beside_one_kv)
        if max_num_seqs < upper:
            logger.info(
                "max_num_seqs %d (vLLM's default %d capped: %d GDN state slots of %.1f MiB%s would take %.1f GiB "
                "of the %.1f GiB cache budget; %s)", max_num_seqs, upper, upper, scratch_bytes / 2**20,
                f" with a {row_bytes / 2**20:.1f} MiB verify scratch each" if has_scratch_per_seq else "",
                upper * per_seq / GIB,
                total / GIB,
                f"{by_whole} served whole at max_model_len {max_model_len}" if by_whole > by_share
                else "the states in half of it",
            )  # fmt: skip
    elif has_scratch_per_seq and beside_one_kv < max_num_seqs:
        # a count the user set, past what the budget holds with each sequence's scratch: vLLM's hybrid cache then
        # runs as many as its blocks hold and the rest wait; here likewise (a step past the scratch would run eager)
        max_num_seqs = max(1, beside_one_kv)
        logger.warning(
            "max_num_seqs %d while speculating: the cache budget (%.2f GiB) holds %d sequences with their state slot "
            "(%.1f MiB) and verify scratch (%.1f MiB: k = %d) beside one max_model_len sequence's KV; %d run at a time",
            upper, total / GIB, max_num_seqs, scratch_bytes / 2**20, row_bytes / 2**20, k, max_num_seqs,
        )  # fmt: skip
    num_slots = engine_config.num_state_slots or max_num_seqs
    spec_rows = 0
    copy_reserve = copy_bytes * min(max_num_seqs, max_num_batched_tokens)  # 0 with deltaserve's GDN prefill
    budget = total - copy_reserve
    if speculative is not None:  # the verify scratch comes out of the cache budget (a chunk a sequence at fixed k)
        spec_rows = max_num_seqs if has_scratch_per_seq else scratch_rows(total, row_bytes, max_num_seqs)
        budget -= spec_rows * row_bytes
    if given_budget(engine_config, runner.device) is None:
        # the measured budget kept the graphs' buffers for the default count; a smaller count's graphs need less, and
        # the rest goes to the cache (the count itself stays as sized: the give-back only adds blocks and slots)
        kind, reserved = graph_bytes(runner, upper)
        needed = graph_bytes(runner, max_num_seqs, spec_rows or None)[1]
        if reserved > needed:
            logger.info(
                "%s graphs %.2f GiB at max_num_seqs %d (%.2f GiB kept for %d): %.2f GiB more cache budget", kind,
                needed / GIB, max_num_seqs, reserved / GIB, upper, (reserved - needed) / GIB,
            )  # fmt: skip
            budget += reserved - needed
            total += reserved - needed
    num_checkpoints = 0
    if engine_config.enable_prefix_caching:
        num_checkpoints = engine_config.num_checkpoint_slots
        if num_checkpoints is None:  # a tenth of the budget, short of taking one max_model_len sequence's blocks
            spare = (budget - one_kv - num_slots * slot_bytes) // slot_bytes
            num_checkpoints = min(checkpoint_slots(budget, scratch_bytes, max_num_seqs), max(0, spare))
    layout = plan_cache(
        model_config, runner.dtype, runner.block_size, budget, num_slots, max_model_len, shapes, num_checkpoints,
        has_mtp=has_mtp,
    )  # fmt: skip
    layout = override_blocks(layout, engine_config.num_gpu_blocks_override, max_model_len)
    used = layout.num_blocks * layout.bytes_per_block + layout.num_slots * layout.bytes_per_slot
    logger.info(
        "cache budget %d bytes (%.2f GiB, %s): %d KV blocks of %d bytes (%d tokens), %d GDN state slots of %d bytes "
        "(%d of them prefix-cache checkpoints), a verify scratch of %d rows (%d bytes); %d bytes left over", total,
        total / GIB, budget_names(engine_config, runner.device)[0], layout.num_blocks, layout.bytes_per_block,
        layout.num_blocks * layout.block_size, layout.num_slots, layout.bytes_per_slot, layout.num_checkpoint_slots,
        spec_rows, spec_rows * row_bytes, budget - used,
    )  # fmt: skip
    if copy_reserve:
        logger.info("GDN prefill through FlashInfer: %d bytes of the cache budget kept for its state copies",
                    copy_reserve)  # fmt: skip
    return max_num_seqs, spec_rows, layout


def size_one_pool(
    runner: ModelRunner, total: int, upper: int, one_kv: int, max_model_len: int, max_num_batched_tokens: int
) -> tuple[int, int, CacheLayout]:
    """size_caches for one pool (docs/ARCHITECTURE.md, "One pool"): the budget, less FlashInfer's state copies and
    the verify scratch for the sequences it sizes, is pages, and a slot takes a run of them only while its sequence
    runs, so no share of memory caps max_num_seqs (runner/one_pool.py one_pool_max_num_seqs). While speculating with a
    fixed k every running sequence has its verify chunk (as size_caches gives it); under the k policy the chunks are
    sized apart (scratch_rows). one_kv: the bytes of one max_model_len sequence's blocks (check_one_sequence_fits)."""
    engine_config, model_config, shapes = runner.engine_config, runner.model_config, runner.model.shapes
    for name in ("num_gpu_blocks_override", "num_state_slots"):  # counts of the split pool's two parts
        if getattr(engine_config, name) is not None:
            raise ValueError(f"{name} sets a count of the split pool; one_pool has pages and runs: drop one of them")
    speculative = engine_config.speculative_config
    has_mtp = runner.model.mtp is not None
    cap = engine_config.max_num_seqs or upper
    layout = plan_one_pool(model_config, runner.dtype, runner.block_size, total, max_model_len, shapes, has_mtp)
    pending = 0
    if engine_config.enable_prefix_caching:  # slots beyond max_num_seqs bound the checkpoints not yet written
        pending = engine_config.num_checkpoint_slots or checkpoint_slots(total, layout.bytes_per_slot, upper)
    max_num_seqs = one_pool_max_num_seqs(layout, max_model_len, cap, pending)
    budget = total - flashinfer_copy_bytes(runner) * min(max_num_seqs, max_num_batched_tokens)
    spec_rows = row_bytes = 0
    if speculative is not None:
        row_bytes = verify_row_bytes(model_config, runner.dtype, speculative.num_speculative_tokens, shapes)
        has_policy = speculative.k_policy is not None
        if not has_policy:  # each running sequence's chunk: as many as fit beside one max_model_len sequence's blocks
            max_num_seqs = max(1, min(max_num_seqs, (budget - one_kv) // (layout.bytes_per_slot + row_bytes)))
        spec_rows = scratch_rows(total, row_bytes, max_num_seqs) if has_policy else max_num_seqs
        budget -= spec_rows * row_bytes
    if given_budget(engine_config, runner.device) is None:
        # as size_caches: the graphs' buffers kept for the default count, beyond what this count's need, become pages
        reserved, needed = graph_bytes(runner, upper)[1], graph_bytes(runner, max_num_seqs, spec_rows or None)[1]
        total, budget = total + max(0, reserved - needed), budget + max(0, reserved - needed)
    layout = plan_one_pool(model_config, runner.dtype, runner.block_size, budget, max_model_len, shapes, has_mtp)
    max_num_seqs = min(max_num_seqs, one_pool_max_num_seqs(layout, max_model_len, cap, pending))
    layout = dataclasses.replace(layout, num_checkpoint_slots=min(pending, layout.num_slots - max_num_seqs))
    logger.info(
        "cache budget %d bytes (%.2f GiB, %s) as one pool: %d pages of %d bytes (%d tokens of KV when no sequence "
        "runs), a state slot a run of %d pages (%d runs), a verify scratch of %d rows (%d bytes); max_num_seqs %d",
        total, total / GIB, budget_names(engine_config, runner.device)[0], layout.num_blocks, layout.bytes_per_block,
        layout.num_blocks * layout.block_size, layout.pages_per_slot, layout.num_slots, spec_rows,
        spec_rows * row_bytes, max_num_seqs,
    )  # fmt: skip
    return max_num_seqs, spec_rows, layout


def first_gdn_layer(model: Qwen35Model) -> GatedDeltaNet:
    return next(layer.linear_attn for layer in model.layers if not layer.is_full_attention)


def flashinfer_copy_bytes(runner: ModelRunner) -> int:
    """Per sequence of a step, what FlashInfer's GDN prefill copies of its states (0 with deltaserve's kernel)."""
    if not uses_flashinfer(runner.gdn_prefill_backend):
        return 0
    gdn = first_gdn_layer(runner.model)
    return gdn_flashinfer.state_copy_bytes(gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)


def override_blocks(layout: CacheLayout, override: int | None, max_model_len: int) -> CacheLayout:
    """The layout with num_gpu_blocks_override KV blocks where given, logged as vLLM logs it (kv_cache_utils: the
    computed count is replaced, more or fewer, and the memory follows the count). Refused by name when it cannot
    hold one max_model_len sequence: such a request could never be scheduled."""
    if override is None:
        return layout
    needed = -(-max_model_len // layout.block_size)
    if override < needed:
        raise ValueError(
            f"num_gpu_blocks_override ({override}) holds {override * layout.block_size} tokens, fewer than one "
            f"max_model_len ({max_model_len}) sequence needs ({needed} blocks of {layout.block_size}); raise "
            "num_gpu_blocks_override or lower max_model_len"
        )
    logger.info("Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d", layout.num_blocks, override)
    return dataclasses.replace(layout, num_blocks=override)


def given_budget(engine_config: EngineConfig, device: torch.device) -> int | None:
    """The cache budget the configuration fixes: kv_cache_memory_bytes where given (on a GPU whatever
    gpu_memory_utilization says, as in vLLM), else on the CPU cpu_kv_cache_bytes; None: a GPU's, measured."""
    if engine_config.kv_cache_memory_bytes is not None:
        return engine_config.kv_cache_memory_bytes
    return None if is_cuda(device) else engine_config.cpu_kv_cache_bytes


def budget_names(engine_config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """(what set the cache budget, the setting that raises it), for the start-up log and refusals."""
    if engine_config.kv_cache_memory_bytes is not None:
        return "kv_cache_memory_bytes", "kv_cache_memory_bytes"
    if is_cuda(device):
        return "the cache budget gpu_memory_utilization leaves", "gpu_memory_utilization (or set kv_cache_memory_bytes)"
    return "cpu_kv_cache_bytes", "kv_cache_memory_bytes"


def cache_budget(runner: ModelRunner, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> int:
    """The bytes for the KV cache, the state pool and the verify scratch: kv_cache_memory_bytes where given (the
    warm-up still runs on a GPU: it compiles and autotunes the prefill shapes, as vLLM's profile run does then too),
    else on the CPU cpu_kv_cache_bytes, else what this engine's share of the GPU leaves."""
    given = given_budget(runner.engine_config, runner.device)
    if not is_cuda(runner.device):
        return given
    peak = profile_peak_bytes(runner, max_num_batched_tokens, max_model_len, max_num_seqs)
    free, total = torch.cuda.mem_get_info(runner.device)
    weights = torch.cuda.memory_allocated(runner.device) - runner._allocated_before
    # the graphs' static buffers (decode graphs, or verify graphs while speculating), plus a fixed headroom for the
    # graph pool's other activations and library workspaces
    kind, graphs = graph_bytes(runner, max_num_seqs)
    headroom = HEADROOM_BYTES
    if given is not None:
        logger.info(
            "memory: %.1f GiB total, %.2f GiB free, weights %.2f GiB, warm-up peak %.2f GiB, %s graphs %.2f GiB + "
            "%.2f GiB headroom; cache budget %.2f GiB as kv_cache_memory_bytes gives it (gpu_memory_utilization %s "
            "does not size it; weights, activations and graphs are outside it)", total / GIB, free / GIB,
            weights / GIB, peak / GIB, kind, graphs / GIB, headroom / GIB, given / GIB,
            runner.engine_config.gpu_memory_utilization,
        )  # fmt: skip
        return given
    budget = runner._requested_bytes - weights - peak - graphs
    budget -= headroom
    logger.info(
        "memory: %.1f GiB total, weights %.2f GiB, warm-up peak %.2f GiB, %s graphs %.2f GiB + %.2f GiB "
        "headroom, cache budget %.2f GiB", total / GIB, weights / GIB, peak / GIB, kind, graphs / GIB,
        headroom / GIB, budget / GIB,
    )  # fmt: skip
    return budget


def graph_bytes(runner: ModelRunner, max_num_seqs: int, spec_rows: int | None = None) -> tuple[str, int]:
    """(which graphs, the bytes of their static buffers) as the graphs will allocate them for max_num_seqs: the
    decode graphs' shared logits and the largest bucket's lm_head output (the largest capture size, at most 512
    rows, rounded up to 8: DecodeGraphs' capacity); while speculating, the verify graphs' logits, lm_head output and
    hidden states over their largest bucket's tokens and the MTP drafter's logits over its rows
    (runner/spec_graphs.py), the bucket capped by the verify scratch's spec_rows where given; with a k policy, also
    the width-1 graphs' (all-decode steps without verify chunks: one token a row, up to max_num_seqs rows)."""
    if runner.is_graphed:
        return "decode", static_bytes(buckets(max_num_seqs)[2], runner.vocab_size)
    if runner.is_spec_graphed:
        k = runner.engine_config.speculative_config.num_speculative_tokens
        limit = max_num_seqs if spec_rows is None else spec_rows
        rows = -(-max_verify_batch(k, max_num_seqs, limit) // 8) * 8  # VerifyGraphs.capacity
        hidden_size = runner.model_config.hidden_size
        total = verify_static_bytes(rows, 1 + k, runner.vocab_size, hidden_size, runner.dtype, True)
        if runner.spec_draft_counts is None:
            return "verify", total
        rows = -(-max_verify_batch(0, max_num_seqs, max_num_seqs) // 8) * 8
        total += verify_static_bytes(rows, 1, runner.vocab_size, hidden_size, runner.dtype, True)
        return "verify and width-1", total
    return "no", 0
