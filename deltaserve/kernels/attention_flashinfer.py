"""FlashInfer's paged prefill for the prefill rows of paged attention (--attention-backend FLASHINFER).

`flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")` reads deltaserve's cache as it is (NHD:
[num_blocks, block_size, nkv, d]). Its plan takes the pages as a CSR list, built here once per step from the host
lengths (no device -> host sync: FlashInfer copies qo_indptr, paged_kv_indptr and paged_kv_last_page_len to the host
inside plan, so they are handed over on the host already):
- qo_indptr [P+1]: the prefill rows' query offsets; paged_kv_indptr [P+1]: the cumulative page counts
  ceil(seq_len / block_size); paged_kv_last_page_len [P]: the last page's fill, 1..block_size;
- paged_kv_indices [pages]: each sequence's first pages of its block-table row, in order, gathered on the device
  from the step's block tables with host-computed positions (one pinned copy, no sync).
causal=True aligns the mask to the bottom right (the chunk's queries are the last of the sequence's tokens), as
deltaserve's kernel; sm_scale d^-1/2. One plan serves every full-attention layer of the step (same heads, pages and
lengths; only the cache tensors differ, and they go to run).

Two wrappers take turns, one per step, sharing one 128 MiB float workspace (vLLM's size; stream-ordered, so one
suffices): plan writes its scheduling metadata into the wrapper's page-locked buffer and copies it to the device
without waiting, and under async scheduling the next step's plan may run on the host before the previous step's
copy has left; a wrapper is planned again only two steps later. The twin is kernels/attention.py
paged_attention_ref; design and measurements: docs/attention-backends.md. flashinfer is imported when the backend is
built, so nothing imports it unless FLASHINFER is served.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltaserve.kernels.attention_prefill import PrefillRows
from deltaserve.kernels.flashinfer_import import import_or_reason

WORKSPACE_BYTES = 128 << 20  # vLLM's FlashInfer workspace (the split-KV scratch), FlashInfer's recommended size
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's prefill compiles


def page_list(seq_lens: np.ndarray, block_size: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host CSR page layout of P sequences of these context lengths [P] whose block-table rows are `width` wide ->
    (paged_kv_indptr [P+1], the flat positions of their pages in the [P, width] block table [pages], the last page's
    fill [P]), int64."""
    pages = -(-seq_lens // block_size)  # [P]
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    column = np.arange(width, dtype=np.int64)
    positions = (np.arange(len(seq_lens), dtype=np.int64)[:, None] * width + column[None, :])[
        column[None, :] < pages[:, None]
    ]  # [pages] row-major: sequence by sequence, each one's pages in order
    last = seq_lens - (pages - 1) * block_size  # [P]
    return indptr, positions, last


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 host values on `device`; on CUDA through pinned memory, so the copy does not wait on the stream."""
    host = torch.from_numpy(values.astype(np.int64))
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


@dataclass(frozen=True)
class FlashInferStep:
    """One step's prefill rows, planned on one of the wrappers."""

    wrapper: Any  # BatchPrefillWithPagedKVCacheWrapper

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, out: torch.Tensor
    ) -> None:
        """q [R, nq, d] -> out [R, nq, d], written in place (scale went into the plan; the layers share it)."""
        self.wrapper.run(q, (k_cache, v_cache), out=out)


class FlashInferPrefill:
    """The FLASHINFER backend: the workspace and two wrappers, made once at start-up (the workspace counts in the
    weights the cache plan measures, runner/warmup.py); `prepare` plans one per step."""

    name = "FLASHINFER"

    def __init__(
        self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        wrapper_class = importlib.import_module("flashinfer").BatchPrefillWithPagedKVCacheWrapper
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrappers = [wrapper_class(self.workspace, "NHD") for _ in range(2)]
        self.turn = 0
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.block_size, self.scale, self.dtype, self.device = block_size, scale, dtype, device
        self.plans = 0  # steps planned (the tests count them)

    def prepare(self, rows: PrefillRows) -> FlashInferStep:
        width = rows.block_tables.shape[1]
        indptr, positions, last = page_list(rows.seq_lens_host, self.block_size, width)
        # the pages, gathered on the device: the block table's rows are contiguous, so a flat view indexes them
        indices = rows.block_tables.reshape(-1).index_select(0, _to_device(positions, self.device))
        wrapper = self.wrappers[self.turn]
        self.turn ^= 1
        wrapper.plan(
            torch.from_numpy(rows.query_start_loc_host.astype(np.int32)), torch.from_numpy(indptr.astype(np.int32)),
            indices.to(torch.int32), torch.from_numpy(last.astype(np.int32)), self.num_q_heads, self.num_kv_heads,
            self.head_dim, self.block_size, causal=True, sm_scale=self.scale, q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )  # fmt: skip
        self.plans += 1
        return FlashInferStep(wrapper)


def unusable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashInfer's paged prefill cannot serve this model's prefill rows in `dtype` on `device` (None: it can).
    The cheap checks first; the last one imports flashinfer (as serving it would)."""
    if device.type != "cuda":
        return f"the device is {device.type}, and FlashInfer's paged prefill is a CUDA kernel"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the model dtype is {dtype}, and deltaserve serves FlashInfer's prefill in bfloat16 or float16 only"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"the head size is {head_dim}, and FlashInfer's prefill compiles {FLASHINFER_HEAD_DIMS} only"
    module, reason = import_or_reason("flashinfer")
    if module is None:
        return reason
    if getattr(module, "BatchPrefillWithPagedKVCacheWrapper", None) is None:
        return "flashinfer imports but has no BatchPrefillWithPagedKVCacheWrapper (flashinfer-python 0.6.14 has it)"
    return None
