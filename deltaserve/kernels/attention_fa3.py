"""vLLM's FlashAttention 3 for the prefill rows of paged attention (--attention-backend FLASH_ATTN).

`vllm.vllm_flash_attn.flash_attn_varlen_func` (vLLM 0.26's wheel) with fa_version=3 reads deltaserve's paged cache
as it is: k_cache, v_cache [num_blocks, block_size, nkv, d] (FA3's paged layout; block sizes a multiple of 16),
block_table = the prefill sequences' rows of the step's block table, seqused_k = their context lengths (on the device,
so chained chunks' moved-back lengths are read as they are), cu_seqlens_q = their query offsets, causal=True: FA3
aligns the causal mask to the bottom right, as deltaserve's kernel (query i of a chunk sees keys up to P + i). GQA
is FA3's own (query head h reads KV head h // (nq / nkv), deltaserve's mapping). It needs no plan: `prepare` only
keeps the step's rows. The twin is kernels/attention.py paged_attention_ref on the same rows; measurements and
design: docs/attention-backends.md. vLLM is imported only when the backend is built, so nothing imports it unless
FLASH_ATTN is served.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.kernels.attention_prefill import PrefillRows

FA3_MODULE = "vllm.vllm_flash_attn"
FA3_HEAD_DIMS = 256  # FA3's largest head size (Qwen3.5's full attention uses 256)
FA3_PAGE_MULTIPLE = 16  # FA3's paged KV takes block sizes that are a multiple of 16


@dataclass(frozen=True)
class Fa3Step:
    """One step's prefill rows on FA3 (no plan: the call takes the rows' tensors as they are)."""

    varlen: Any  # flash_attn_varlen_func
    rows: PrefillRows

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, out: torch.Tensor
    ) -> None:
        """q [R, nq, d] -> out [R, nq, d], written in place."""
        rows = self.rows
        self.varlen(
            q, k_cache, v_cache, rows.max_query_len, rows.query_start_loc, rows.max_seq_len,
            seqused_k=rows.seq_lens, softmax_scale=scale, causal=True, block_table=rows.block_tables, out=out,
            fa_version=3,
        )  # fmt: skip


class Fa3Prefill:
    """The FLASH_ATTN backend: vLLM's flash_attn_varlen_func, imported once at start-up."""

    name = "FLASH_ATTN"

    def __init__(self) -> None:
        self.varlen = importlib.import_module(FA3_MODULE).flash_attn_varlen_func

    def prepare(self, rows: PrefillRows) -> Fa3Step:
        return Fa3Step(self.varlen, rows)


def unusable_reason(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> str | None:
    """Why vLLM's FA3 cannot serve this model's prefill rows in `dtype` on `device` (None: it can). The cheap checks
    first; the last ones import vllm.vllm_flash_attn (as serving it would)."""
    if device.type != "cuda":
        return f"the device is {device.type}, and FlashAttention 3 is a CUDA kernel"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the model dtype is {dtype}, and FlashAttention 3 takes bfloat16 or float16 only"
    if head_dim > FA3_HEAD_DIMS or head_dim % 8:
        # vLLM's FlashAttentionBackend.supports_head_size without FA4: a multiple of 8, at most 256
        return f"the head size is {head_dim}, and FlashAttention 3 takes multiples of 8 up to {FA3_HEAD_DIMS}"
    if block_size % FA3_PAGE_MULTIPLE:
        return f"the block size is {block_size}, and FlashAttention 3 pages hold a multiple of {FA3_PAGE_MULTIPLE}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"the GPU is compute capability {major}.{minor}, and FlashAttention 3 needs SM90 (Hopper) or newer"
    try:
        module = importlib.import_module(FA3_MODULE)
    except Exception as exc:  # a broken install raises more than ImportError (a missing CUDA library, say)
        return f"{FA3_MODULE} does not import ({type(exc).__name__}: {exc}); it ships in vLLM 0.26's wheel"
    reason = module.fa_version_unsupported_reason(3)
    if reason:
        return f"vLLM reports FlashAttention 3 unsupported here: {reason}"
    return None


def vllm_version() -> str:
    """The installed vLLM's version (for the start-up log)."""
    return str(getattr(importlib.import_module("vllm"), "__version__", "unknown"))
