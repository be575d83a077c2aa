"""Memory sizing of the runner at start-up: how the cache budget is split between the state pool, the verify
scratch, the prefix-cache checkpoints and the KV blocks (or, with one_pool, pages that state slots take runs of),
and the max_num_seqs that follows. The budget itself, and the warm-up that measures the activation peak it leaves
out, are runner/warmup.py's. While speculating with a fixed k every running sequence also holds its verify chunk's
scratch; with --gdn-prefill-backend flashinfer the budget keeps that path's state copies for every sequence a step
may hold (kernels/gdn_flashinfer.py).

The functions take the ModelRunner under construction.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from deltaserve.engine_config import EngineConfig
from deltaserve.kernels import gdn_flashinfer
from deltaserve.kernels.gdn import uses_flashinfer
from deltaserve.runner.cache import (
    CHECKPOINT_SHARE,
    CacheLayout,
    affordable_slots,
    bytes_per_block,
    bytes_per_slot,
    check_one_sequence_fits,
    checkpoint_slots,
    plan_cache,
    verify_row_bytes,
    whole_sequences,
)
from deltaserve.runner.device_setup import is_cuda
from deltaserve.runner.one_pool import one_pool_max_num_seqs, plan_one_pool
from deltaserve.runner.spec_layout import scratch_rows, speculating_seqs
from deltaserve.runner.warmup import GIB, cache_budget, first_gdn_layer, given_budget, graph_bytes

if TYPE_CHECKING:  # runner/model_runner.py imports this module
    from deltaserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def default_max_num_seqs(device: torch.device) -> int:
    """vLLM 0.26's default for its API server: 1024 on GPUs of >= 70 GiB other than the A100, else 256."""
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        if props.total_memory >= 70 * GIB and "a100" not in props.name.lower():
            return 1024
    return 256


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


def budget_names(engine_config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """(what set the cache budget, the setting that raises it), for the start-up log and refusals."""
    if engine_config.kv_cache_memory_bytes is not None:
        return "kv_cache_memory_bytes", "kv_cache_memory_bytes"
    if is_cuda(device):
        return "the cache budget gpu_memory_utilization leaves", "gpu_memory_utilization (or set kv_cache_memory_bytes)"
    return "cpu_kv_cache_bytes", "kv_cache_memory_bytes"
