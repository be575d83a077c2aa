"""KV cache and GDN state pool: size them from memory, allocate, and bind per-layer views to the model.

One KV block holds block_size tokens of K and V for every full-attention layer (and for the MTP layer when it is
loaded: speculative decoding); one state slot holds the
conv state (model dtype) and the fp32 recurrent state of every linear-attention layer. On a GPU the budget
is gpu_memory_utilization x total (per instance, as vLLM 0.26 counts it: other processes' memory is not
subtracted, but must leave that much free at start-up) minus what this engine's weights, a warm-up forward at
the largest batch and its decode graphs take; on the CPU it is the explicit EngineConfig.cpu_kv_cache_bytes.
With --kv-cache-memory-bytes (EngineConfig.kv_cache_memory_bytes) the budget is that many bytes, on either.
Under tensor parallelism every count is per rank: a block holds the rank's KV heads and a slot the rank's GDN
heads (`shapes`, model/parallel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltaserve.config import ModelConfig
from deltaserve.kernels.gdn import CHUNK_SIZE as GDN_CHUNK_SIZE
from deltaserve.kernels.gdn_spec import verify_row_width
from deltaserve.model.parallel import LocalShapes
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.sampler.transfer import to_device


def ssm_dtype(config: ModelConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        config.ssm_state_dtype, torch.float32
    )


def _local(config: ModelConfig, shapes: LocalShapes | None) -> LocalShapes:
    return shapes if shapes is not None else LocalShapes.of(config)


def local_conv_dim(config: ModelConfig, shapes: LocalShapes) -> int:
    return (2 * shapes.k_heads.size * config.linear_key_head_dim) + shapes.v_heads.size * config.linear_value_head_dim


def num_kv_layers(config: ModelConfig, has_mtp: bool = False) -> int:
    """Attention layers with a KV cache: the target's full-attention layers, plus the MTP layer when it is loaded."""
    return len(config.full_attention_layers) + (1 if has_mtp else 0)


def bytes_per_block(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    shapes: LocalShapes | None = None,
    has_mtp: bool = False,
) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    per_layer = 2 * block_size * _local(config, shapes).kv_heads.size * config.head_dim * element
    return per_layer * num_kv_layers(config, has_mtp)


def state_bytes(config: ModelConfig, dtype: torch.dtype, shapes: LocalShapes | None) -> tuple[int, int]:
    """(conv window bytes, recurrent state bytes) of one sequence in one GDN layer (this rank's heads)."""
    shapes = _local(config, shapes)
    element = torch.tensor([], dtype=dtype).element_size()
    state_element = torch.tensor([], dtype=ssm_dtype(config)).element_size()
    conv = (config.linear_conv_kernel_dim - 1) * local_conv_dim(config, shapes) * element
    ssm = shapes.v_heads.size * config.linear_key_head_dim * config.linear_value_head_dim * state_element
    return conv, ssm


def bytes_per_slot(
    config: ModelConfig, dtype: torch.dtype, shapes: LocalShapes | None = None, has_mtp: bool = False
) -> int:
    """A state slot's bytes: the GDN layers' conv and recurrent states, plus, with the MTP layer, one hidden row."""
    conv, ssm = state_bytes(config, dtype, shapes)
    hidden = config.hidden_size * torch.tensor([], dtype=dtype).element_size() if has_mtp else 0
    return (conv + ssm) * len(config.linear_attention_layers) + hidden


def verify_row_bytes(
    config: ModelConfig, dtype: torch.dtype, num_speculative_tokens: int, shapes: LocalShapes | None = None
) -> int:
    """A verify chunk's scratch bytes (runner/spec_decode.py): the GDN layers' conv window after each of its 1 + k
    tokens and each token's delta-rule inputs (k, v, a, b: kernels/gdn_spec.py), which the commit replays on the
    live state; no recurrent state beside the live slot."""
    conv, _ = state_bytes(config, dtype, shapes)
    local = _local(config, shapes)
    element = torch.tensor([], dtype=dtype).element_size()
    row = verify_row_width(local.k_heads.size, config.linear_key_head_dim, local.v_heads.size,
                           config.linear_value_head_dim) * element  # fmt: skip
    return (num_speculative_tokens + 1) * (conv + row) * len(config.linear_attention_layers)


@dataclass
class CacheLayout:
    num_blocks: int
    block_size: int
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    num_checkpoint_slots: int = 0  # of num_slots, the ones beyond max_num_seqs: prefix-cache checkpoints
    # one pool (runner/one_pool.py): num_blocks pages of bytes_per_block, slot s the pages [s x R, (s + 1) x R);
    # 0: the pool split, num_slots slots beside the blocks
    pages_per_slot: int = 0
    # the GDN chunked prefill's chunk (tokens): the scheduler places prefix-cache checkpoints on its grid
    gdn_chunk_size: int = GDN_CHUNK_SIZE


def requested_bytes(total_bytes: int, free_bytes: int, utilization: float) -> int:
    """What one engine instance may hold on its device, as vLLM 0.26 counts it (v1/worker/utils.request_memory):
    `utilization` x the device's total, per instance (two engines at 0.45 share one GPU), refused at start-up when
    the device's free memory is already less than that."""
    requested = math.ceil(total_bytes * utilization)
    if free_bytes < requested:
        raise ValueError(
            f"Free memory on device ({free_bytes / 2**30:.2f}/{total_bytes / 2**30:.2f} GiB) on startup is less "
            f"than desired GPU memory utilization ({utilization}, {requested / 2**30:.2f} GiB). Decrease GPU memory "
            "utilization or reduce GPU memory used by other processes."
        )
    return requested


def check_one_sequence_fits(
    budget_bytes: int, block_bytes: int, slot_bytes: int, block_size: int, max_model_len: int, name: str, knob: str
) -> int:
    """vLLM's start-up refusal (v1/core/kv_cache_utils.py, _check_enough_kv_cache_memory): the cache budget must
    hold one sequence of max_model_len tokens, here its KV blocks and one GDN state slot. The error names what set
    the budget (`name`) and says which setting raises it (`knob`), and, as vLLM's, the longest sequence the budget
    does hold. Returns the bytes of that sequence's KV blocks."""
    num_blocks = -(-max_model_len // block_size)
    kv_bytes = num_blocks * block_bytes
    needed = kv_bytes + slot_bytes
    if budget_bytes >= needed:
        return kv_bytes
    fits = max(0, budget_bytes - slot_bytes) // max(block_bytes, 1) * block_size
    longest = f" it holds one sequence of at most {fits} tokens;" if fits > 0 else ""
    raise ValueError(
        f"{name} ({budget_bytes} bytes, {budget_bytes / 2**30:.2f} GiB) is not enough for max_model_len "
        f"({max_model_len}): one sequence of that length needs {needed} bytes ({needed / 2**30:.2f} GiB: "
        f"{num_blocks} KV blocks of {block_bytes} bytes and a GDN state slot of {slot_bytes} bytes);{longest} "
        f"raise {knob} or lower max_model_len"
    )


CHECKPOINT_SHARE = 0.1  # the budget share the prefix cache's checkpoint slots take by default


def affordable_slots(budget_bytes: int, slot_bytes: int, share: float = 0.5) -> int:
    """How many GDN state slots fit in `share` of the cache budget (the rest stays KV blocks)."""
    return max(1, int(budget_bytes * share) // max(slot_bytes, 1))


def whole_sequences(budget_bytes: int, per_seq_bytes: int, one_kv_bytes: int, reserved_share: float) -> int:
    """How many sequences the budget serves whole: each with its state bytes (its pool slot, and its verify
    scratch while speculating) and the KV blocks of a max_model_len sequence, beside `reserved_share` of the budget
    (the checkpoint slots' share). Where a sequence's state is large against its longest KV (the 27B's 5 states at
    k = 3 against 4,096 tokens), this exceeds the half-the-budget rule, which would leave KV no sequence can use."""
    return int(budget_bytes * (1 - reserved_share)) // max(per_seq_bytes + one_kv_bytes, 1)


def checkpoint_slots(budget_bytes: int, slot_bytes: int, max_num_seqs: int, share: float = CHECKPOINT_SHARE) -> int:
    """Prefix-cache checkpoint slots sized from memory: what fits in `share` of the cache budget, at least 1 and at
    most one per running sequence (a checkpoint's KV blocks bound the useful count anyway)."""
    return max(1, min(max_num_seqs, int(budget_bytes * share) // max(slot_bytes, 1)))


def plan_cache(
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    budget_bytes: int,
    num_slots: int,
    max_model_len: int,
    shapes: LocalShapes | None = None,
    num_checkpoint_slots: int = 0,
    has_mtp: bool = False,
) -> CacheLayout:
    """Slots first (one per running sequence, plus the prefix cache's checkpoint slots), the rest of the budget as
    KV blocks (per rank: `shapes`). has_mtp: the MTP layer is loaded, and a block holds its K/V too (one more
    attention layer, same block ids)."""
    num_slots += num_checkpoint_slots
    block_bytes = bytes_per_block(config, block_size, dtype, shapes, has_mtp)
    slot_bytes = bytes_per_slot(config, dtype, shapes, has_mtp)
    slots_total = num_slots * slot_bytes
    if slots_total >= budget_bytes:
        affordable = budget_bytes // max(slot_bytes, 1)
        raise ValueError(
            f"the cache budget ({budget_bytes / 2**20:.1f} MiB) cannot hold {num_slots} GDN state slots of "
            f"{slot_bytes / 2**20:.2f} MiB each (it fits {affordable}); lower max_num_seqs or raise the budget"
        )
    num_blocks = (budget_bytes - slots_total) // max(block_bytes, 1)
    min_blocks = -(-max_model_len // block_size)
    if num_blocks < min_blocks:
        raise ValueError(
            f"the KV cache fits {num_blocks} blocks of {block_size} tokens, fewer than one max_model_len "
            f"({max_model_len}) sequence needs ({min_blocks}); lower max_model_len or max_num_seqs"
        )
    return CacheLayout(num_blocks, block_size, num_slots, block_bytes, slot_bytes, num_checkpoint_slots)


def allocate_and_bind(
    model: Qwen35Model, config: ModelConfig, layout: CacheLayout, dtype: torch.dtype, device: torch.device
) -> None:
    """Allocates one cache tensor per layer kind and binds per-layer views (the model's own per-rank heads). The MTP
    layer, when the model has one, gets the last KV view: its own K/V, indexed by the target's block ids. In one pool
    (layout.pages_per_slot) a single buffer holds them all (runner/one_pool.py)."""
    if layout.pages_per_slot:
        from deltaserve.runner.one_pool import bind_one_pool  # it builds on this module's sizes: imported here

        bind_one_pool(model, config, layout, dtype, device)
        return
    shapes = model.shapes
    mtp = getattr(model, "mtp", None)
    num_attn = num_kv_layers(config, mtp is not None)
    num_gdn = len(config.linear_attention_layers)
    kv = torch.zeros(
        num_attn, 2, layout.num_blocks, layout.block_size, shapes.kv_heads.size, config.head_dim,
        dtype=dtype, device=device,
    )  # fmt: skip
    conv_dim = local_conv_dim(config, shapes)
    conv = torch.zeros(
        num_gdn, layout.num_slots, config.linear_conv_kernel_dim - 1, conv_dim, dtype=dtype, device=device
    )
    ssm = torch.zeros(
        num_gdn, layout.num_slots, shapes.v_heads.size, config.linear_key_head_dim,
        config.linear_value_head_dim, dtype=ssm_dtype(config), device=device,
    )  # fmt: skip
    attn_index = gdn_index = 0
    for layer in model.layers:
        if layer.is_full_attention:
            layer.self_attn.k_cache = kv[attn_index, 0]
            layer.self_attn.v_cache = kv[attn_index, 1]
            attn_index += 1
        else:
            layer.linear_attn.conv_states = conv[gdn_index]
            layer.linear_attn.ssm_states = ssm[gdn_index]
            gdn_index += 1
    if mtp is not None:
        mtp.attention.k_cache = kv[attn_index, 0]
        mtp.attention.v_cache = kv[attn_index, 1]
        # beside each slot's GDN state, the target's hidden at its last consumed token (runner/mtp_resume.py)
        mtp.slot_hidden = torch.zeros(layout.num_slots, config.hidden_size, dtype=dtype, device=device)


def copy_state_slots(model: Qwen35Model, pairs: list[tuple[int, int]]) -> None:
    """Copies every GDN layer's conv and recurrent state (and, with the MTP layer, the slot's hidden row) from slot
    src to slot dst, for (src, dst) pairs: a step that reads one slot and writes another (a restored prefix-cache
    checkpoint) starts from a copy."""
    if not pairs:
        return
    device = next(iter(model.parameters())).device
    # through pinned memory: a copy from pageable host memory would wait for the stream (a host sync in the launch
    # of every step that restores a prefix-cache hit, ending async scheduling's overlap there)
    src = to_device([p[0] for p in pairs], torch.int64, device)
    dst = to_device([p[1] for p in pairs], torch.int64, device)
    for layer in model.layers:
        if not layer.is_full_attention:
            mixer = layer.linear_attn
            mixer.conv_states.index_copy_(0, dst, mixer.conv_states.index_select(0, src))
            mixer.ssm_states.index_copy_(0, dst, mixer.ssm_states.index_select(0, src))
    mtp = getattr(model, "mtp", None)
    if mtp is not None:  # the slot's hidden row travels with its state (runner/mtp_resume.py)
        mtp.slot_hidden.index_copy_(0, dst, mtp.slot_hidden.index_select(0, src))


def copy_kv_blocks(model: Qwen35Model, pairs: tuple[tuple[int, int], ...]) -> None:
    """Copies KV block src to block dst in every full-attention layer (and the MTP layer, when loaded), K and V, for
    (src, dst) pairs: a prefix-cache hit inside a block continues in its own copy of the checkpoint's partial block."""
    if not pairs:
        return
    device = next(iter(model.parameters())).device
    src = to_device([p[0] for p in pairs], torch.int64, device)  # pinned: no host sync (copy_state_slots)
    dst = to_device([p[1] for p in pairs], torch.int64, device)
    attentions = [layer.self_attn for layer in model.layers if layer.is_full_attention]
    mtp = getattr(model, "mtp", None)
    if mtp is not None:  # the MTP layer's K/V lives in the same blocks: its drafts read the copied rows too
        attentions.append(mtp.attention)
    for attn in attentions:
        for cache in (attn.k_cache, attn.v_cache):  # [num_blocks, block_size, kv_heads, head_dim]
            cache.index_copy_(0, dst, cache.index_select(0, src))
