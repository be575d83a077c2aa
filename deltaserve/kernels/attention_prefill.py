"""The prefill rows of paged attention on a library's kernel (--attention-backend FLASH_ATTN / FLASHINFER): what a
step hands the library, and the backends' common shape.

A step's rows are ordered decodes, verify chunks, prefill chunks (model/context.py); the prefill chunks are the last
sequences of the batch. `PrefillRows` describes them once per step, on the device (the slices of the step's
ForwardContext tensors the library reads) and on the host (what a plan needs without a device -> host sync), and a
backend's `prepare(rows)` returns the `PreparedPrefill` every full-attention layer of that step runs. The backends
are kernels/attention_fa3.py (vLLM's FlashAttention 3) and kernels/attention_flashinfer.py (FlashInfer's paged
prefill); their plain-torch twin is kernels/attention.py paged_attention_ref on the same rows. Design and
measurements: docs/attention-backends.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillRows:
    """A step's prefill sequences: the last P sequences of the batch, whose query rows are the step's last rows."""

    first_row: int  # the first prefill row of the step (decode and verify rows come before it)
    query_start_loc: torch.Tensor  # [P+1] int32, offsets within the prefill rows (0 first)
    seq_lens: torch.Tensor  # [P] int32: each sequence's context after the step
    block_tables: torch.Tensor  # [P, W] int32, rows of the step's block table
    max_query_len: int  # host bounds (the runner's hints, over the whole step)
    max_seq_len: int
    query_start_loc_host: np.ndarray  # [P+1] int64, as query_start_loc
    seq_lens_host: np.ndarray  # [P] int64, as seq_lens

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_host.shape[0])


class PreparedPrefill(Protocol):
    """One step's prefill attention on a library, planned: every full-attention layer of the step runs it."""

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, out: torch.Tensor
    ) -> None:
        """q [R, nq, d] (the prefill rows) over the layer's cache [num_blocks, block_size, nkv, d] -> out [R, nq, d]."""
        ...


class PrefillBackend(Protocol):
    """A library serving the prefill rows, built once at start-up (runner/device_setup.py)."""

    name: str  # the --attention-backend value

    def prepare(self, rows: PrefillRows) -> PreparedPrefill:
        """The step's plan, made once per step on the host from `rows`."""
        ...
