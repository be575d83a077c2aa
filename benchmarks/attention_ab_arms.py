"""The arms of benchmarks/attention_ab.py: deltaserve's paged attention and each field library's paged prefill
attention for the same op, called the way vLLM 0.26 serves it (docs/kernels.md#attention-against-the-libraries).

The op: causal GQA over a paged KV cache, bf16, scale d^-0.5; a batch is varlen, sequence b's queries are the last
q_len of its seq_len cached tokens (a chunk of a chunked prefill attends to the P tokens cached before it and to
itself causally). The cache is deltaserve's: k_cache, v_cache [num_blocks, block_size, nkv, d], block size 16 as
served, int32 block tables [B, max_blocks].

An arm is found by importing its library; one that does not import is kept with its import error, so the record
names every library that was missing and why. `prepare(batch)` builds what the library takes from deltaserve's
batch, once per case and outside the timing (as vLLM builds its metadata once a step); `call(batch, prepared)` is
the timed call. A library arm also runs as `NAME@LABEL` on a copy of the cache repaged to another block size
(benchmarks/attention_ab.py --library-block-sizes; `vllm`: the block size vLLM 0.26 gives these hybrid models), made
once per case outside the timing.
- deltaserve: kernels.paged_attention with the runner's max_query_len / max_seq_len hints (the served call; the
  Triton kernel on CUDA, the torch twin on the CPU).
- vllm-fa3: vLLM 0.26's FlashAttention 3, `vllm.vllm_flash_attn.flash_attn_varlen_func(q, k_cache, v_cache,
  max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=seq_lens, causal=True, block_table=..., fa_version=3)`. Its
  paged cache layout is deltaserve's ([num_blocks, block_size, nkv, d], block sizes a multiple of 16), so the
  conversion is no copy: the same cache tensors, the int32 query offsets, sequence lengths and block table.
  FA3's causal mask is aligned to the bottom right, as deltaserve's: query i of a chunk sees keys up to P + i.
- flashinfer: `BatchPrefillWithPagedKVCacheWrapper(workspace 128 MiB, "NHD")`, planned outside the timing with
  the CSR page list (indptr, the pages of each sequence in order, the last page's fill), causal, sm_scale; `run(q,
  (k_cache, v_cache))` timed. NHD is deltaserve's layout, so again no copy. FlashInfer JIT-builds the kernel on
  its first plan / run (nvcc, under FLASHINFER_WORKSPACE_BASE), inside the check, never inside the timing.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fp8_ab_arms import Importer, _missing, _version  # a library arm missing, and its version: as fp8_ab's arms

FLASHINFER_WORKSPACE = 128 << 20  # the size FlashInfer's docs recommend for the split-KV scratch


@dataclass
class Batch:
    """One attention call's operands in deltaserve's layout (what the runner hands paged_attention)."""

    q: torch.Tensor  # [T, nq, d]
    k_cache: torch.Tensor  # [num_blocks, block_size, nkv, d]
    v_cache: torch.Tensor  # [num_blocks, block_size, nkv, d]
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    scale: float
    max_query_len: int
    max_seq_len: int

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]


@dataclass
class Arm:
    """One implementation of the op. `error` set: the library did not import (or lacks the entry point)."""

    name: str
    library: str
    what: str
    prepare: Callable[[Batch], Any] | None = None
    call: Callable[[Batch, Any], torch.Tensor] | None = None
    error: str | None = None
    pages: str | None = None  # a block-size label: the arm reads a copy of the cache repaged to it; None: ours as is

    @property
    def available(self) -> bool:
        return self.error is None

    def describe(self) -> dict[str, Any]:
        return {"library": self.library, "available": self.available, "error": self.error, "what": self.what,
                "pages": self.pages}  # fmt: skip

    def at_pages(self, label: str) -> Arm:
        """This arm on a copy of the cache repaged to the block size `label` names, as `NAME@LABEL`."""
        return dataclasses.replace(self, name=f"{self.name}@{label}", pages=label)


def attention_arms(importer: Importer = importlib.import_module) -> list[Arm]:
    """deltaserve's paged attention and every library arm, importable or not (in the record's order)."""
    from deltaserve.kernels.attention import paged_attention

    def ours(b: Batch, _: Any) -> torch.Tensor:
        args = (b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.scale)
        return paged_attention(*args, b.max_query_len, b.max_seq_len)

    what = "kernels.paged_attention (the Triton _paged_attn_kernel on CUDA, its torch twin on the CPU)"
    deltaserve = Arm("deltaserve", "deltaserve", what, prepare=lambda b: None, call=ours)
    return [deltaserve, _fa3_arm(importer), _flashinfer_arm(importer)]


def _fa3_arm(importer: Importer) -> Arm:
    arm = Arm("vllm-fa3", f"vllm {_version(importer, 'vllm')}", "vllm.vllm_flash_attn.flash_attn_varlen_func("
              "fa_version=3, causal=True, block_table, seqused_k) on deltaserve's cache as is")  # fmt: skip
    try:
        fa = importer("vllm.vllm_flash_attn")
        varlen = fa.flash_attn_varlen_func
        reason = fa.fa_version_unsupported_reason(3)
    except Exception as exc:
        return _missing(arm, exc)
    if reason:  # imports, but FA3 is not built for this device (vLLM then serves FA2)
        arm.error = f"vLLM reports FlashAttention 3 unsupported here: {reason}"[:300]
        return arm

    def call(b: Batch, _: Any) -> torch.Tensor:
        return varlen(
            b.q, b.k_cache, b.v_cache, b.max_query_len, b.query_start_loc, b.max_seq_len,
            seqused_k=b.seq_lens, softmax_scale=b.scale, causal=True, block_table=b.block_tables, fa_version=3,
        )  # fmt: skip

    arm.prepare, arm.call = (lambda b: None), call
    return arm


def flashinfer_pages(b: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page list from deltaserve's block tables: (indptr [B + 1], the pages of each sequence in
    order [sum of pages], the last page's fill [B]), all int32."""
    pages = (b.seq_lens.long() + b.block_size - 1) // b.block_size  # [B]
    indptr = torch.zeros(pages.numel() + 1, dtype=torch.int32, device=b.q.device)
    indptr[1:] = pages.cumsum(0)
    width = torch.arange(b.block_tables.shape[1], device=b.q.device)
    indices = b.block_tables[width[None, :] < pages[:, None]].to(torch.int32)  # row-major: sequence by sequence
    last = (b.seq_lens.long() - (pages - 1) * b.block_size).to(torch.int32)
    return indptr, indices, last


def _flashinfer_arm(importer: Importer) -> Arm:
    arm = Arm("flashinfer", f"flashinfer {_version(importer, 'flashinfer')}", "BatchPrefillWithPagedKVCacheWrapper"
              "(NHD): plan (causal, sm_scale) outside the timing, run(q, (k_cache, v_cache)) timed")  # fmt: skip
    try:
        wrapper_class = importer("flashinfer").BatchPrefillWithPagedKVCacheWrapper
    except Exception as exc:
        return _missing(arm, exc)

    def prepare(b: Batch) -> Any:
        workspace = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=b.q.device)
        wrapper = wrapper_class(workspace, "NHD")
        indptr, indices, last = (t.cpu() for t in flashinfer_pages(b))  # plan reads its indptrs on the host
        num_q_heads, head_dim = b.q.shape[1:]
        wrapper.plan(
            b.query_start_loc.cpu(), indptr, indices, last, num_q_heads, b.k_cache.shape[2], head_dim, b.block_size,
            causal=True, sm_scale=b.scale, q_data_type=b.q.dtype, kv_data_type=b.k_cache.dtype,
        )  # fmt: skip
        return wrapper

    arm.prepare = prepare
    arm.call = lambda b, wrapper: wrapper.run(b.q, (b.k_cache, b.v_cache))
    return arm
