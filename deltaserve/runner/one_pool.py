"""One pool (docs/ARCHITECTURE.md, "One pool"; --one-pool): the KV blocks and the GDN state slots in one buffer of
pages, a slot a run of pages taken only while its sequence runs. Here: the plan (pages of one KV block, R the pages
of a slot's run, the runs), max_num_seqs for it, and the views bound over the buffer; the page table that hands
pages and runs out is the scheduler's (scheduler/block_manager.py PageTable), the sizing of the budget
runner/memory.py size_one_pool.
"""

from __future__ import annotations

import torch

from deltaserve.config import ModelConfig
from deltaserve.model.parallel import LocalShapes
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.cache import CacheLayout, bytes_per_block, local_conv_dim, ssm_dtype, state_bytes

# a GDN state piece's offset in a slot's run, in bytes: a multiple of 16 elements of any dtype, so each view's slot
# stride and start keep the alignment the kernels' specializations assume (docs/ARCHITECTURE.md, "One pool")
STATE_ALIGN = 256


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // STATE_ALIGN) * STATE_ALIGN


def run_bytes(config: ModelConfig, dtype: torch.dtype, shapes: LocalShapes | None = None) -> int:
    """The bytes of a slot's run in one pool: every GDN layer's conv window and recurrent state, each aligned."""
    conv, ssm = state_bytes(config, dtype, shapes)
    return (_aligned(conv) + _aligned(ssm)) * len(config.linear_attention_layers)


def pages_per_slot(config: ModelConfig, dtype: torch.dtype, block_bytes: int, shapes: LocalShapes | None = None) -> int:
    """R: the pages of block_bytes a slot's run takes in one pool."""
    return -(-run_bytes(config, dtype, shapes) // block_bytes)


def bind_one_pool(
    model: Qwen35Model, config: ModelConfig, layout: CacheLayout, dtype: torch.dtype, device: torch.device
) -> None:
    """One buffer of num_blocks pages (docs/ARCHITECTURE.md, "One pool"). Page p holds KV block p of every attention
    layer, layer i's K and V at byte offsets 2i and 2i + 1 times a layer's block; slot s's run (pages s x R on) holds
    every GDN layer's conv window and recurrent state, each at an aligned offset. Every view is strided over the
    buffer: k_cache / v_cache [pages, block_size, heads, dim] with a block stride of a page; conv_states /
    ssm_states [runs, ...] with a slot stride of R pages."""
    shapes = model.shapes
    mtp = getattr(model, "mtp", None)
    page = layout.bytes_per_block
    buffer = torch.zeros(layout.num_blocks * page, dtype=torch.uint8, device=device)
    element = torch.tensor([], dtype=dtype).element_size()
    layer_block = layout.block_size * shapes.kv_heads.size * config.head_dim * element  # one layer's K of a block
    kv_shape = (layout.num_blocks, layout.block_size, shapes.kv_heads.size, config.head_dim)
    kv_stride = (page // element, shapes.kv_heads.size * config.head_dim, config.head_dim, 1)
    as_dtype = buffer.view(dtype)

    def kv_view(offset: int) -> torch.Tensor:
        return torch.as_strided(as_dtype, kv_shape, kv_stride, offset // element)

    attentions = [layer.self_attn for layer in model.layers if layer.is_full_attention]
    if mtp is not None:
        attentions.append(mtp.attention)
    for index, attn in enumerate(attentions):
        attn.k_cache = kv_view(2 * index * layer_block)
        attn.v_cache = kv_view((2 * index + 1) * layer_block)
    conv_bytes, ssm_bytes = state_bytes(config, dtype, shapes)
    state_dtype = ssm_dtype(config)
    state_element = torch.tensor([], dtype=state_dtype).element_size()
    num_runs = layout.num_slots
    conv_dim, window = local_conv_dim(config, shapes), config.linear_conv_kernel_dim - 1
    heads, dk, dv = shapes.v_heads.size, config.linear_key_head_dim, config.linear_value_head_dim
    run = layout.pages_per_slot * page
    as_state = buffer.view(state_dtype)
    offset = 0
    for layer in model.layers:
        if layer.is_full_attention:
            continue
        mixer = layer.linear_attn
        mixer.conv_states = torch.as_strided(
            as_dtype, (num_runs, window, conv_dim), (run // element, conv_dim, 1), offset // element
        )
        offset += _aligned(conv_bytes)
        mixer.ssm_states = torch.as_strided(
            as_state, (num_runs, heads, dk, dv), (run // state_element, dk * dv, dv, 1), offset // state_element
        )
        offset += _aligned(ssm_bytes)
    if offset > run:
        raise ValueError(f"a slot's states take {offset} bytes, more than its run of {run}")
    if mtp is not None:
        mtp.slot_hidden = torch.zeros(num_runs, config.hidden_size, dtype=dtype, device=device)


def plan_one_pool(
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    budget_bytes: int,
    max_model_len: int,
    shapes: LocalShapes | None = None,
    has_mtp: bool = False,
) -> CacheLayout:
    """One pool (docs/ARCHITECTURE.md): the budget as pages of one KV block each, every run of R pages a possible
    state slot; with the MTP layer, a hidden row per run beside the pages. Refused, as plan_cache refuses, when the
    pages cannot hold one max_model_len sequence's blocks beside a slot's run."""
    block_bytes = bytes_per_block(config, block_size, dtype, shapes, has_mtp)
    per_slot = pages_per_slot(config, dtype, block_bytes, shapes)
    hidden = config.hidden_size * torch.tensor([], dtype=dtype).element_size() if has_mtp else 0
    # the hidden rows are one per run: per_slot pages and one row for every run the pages make
    num_pages = budget_bytes * per_slot // (per_slot * block_bytes + hidden)
    min_pages = -(-max_model_len // block_size) + per_slot
    if num_pages < min_pages:
        raise ValueError(
            f"one pool of {num_pages} pages of {block_bytes} bytes cannot hold a max_model_len ({max_model_len}) "
            f"sequence's blocks beside a state slot's run of {per_slot} pages ({min_pages}); lower max_model_len or "
            "raise the cache budget"
        )
    slot_bytes = per_slot * block_bytes + hidden
    return CacheLayout(num_pages, block_size, num_pages // per_slot, block_bytes, slot_bytes, pages_per_slot=per_slot)


def one_pool_max_num_seqs(layout: CacheLayout, max_model_len: int, cap: int, pending: int) -> int:
    """One pool's max_num_seqs: `cap` (vLLM's default, or the user's), at most the runs beside one max_model_len
    sequence's blocks and beside `pending` runs for the prefix cache's checkpoints not yet written."""
    beside_one_kv = (layout.num_blocks - -(-max_model_len // layout.block_size)) // layout.pages_per_slot
    return max(1, min(cap, beside_one_kv, layout.num_slots - pending))
