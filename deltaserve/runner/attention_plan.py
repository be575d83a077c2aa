"""The runner's side of --attention-backend FLASH_ATTN / FLASHINFER: the library backend, built once at start-up, and
each eager step's plan of its prefill rows, made once per step (not per layer: every full-attention layer of the
step runs the same plan) from the step's host layout, so nothing waits on the device.

Only eager steps with prefill rows are planned; decode-only steps, verify steps and the CUDA-graph steps carry no
plan and run deltaserve's kernel for every row (model/layers/attention.py paged_attention_rows).
"""

from __future__ import annotations

import logging

import torch

from deltaserve.config import ModelConfig
from deltaserve.kernels.attention_fa3 import Fa3Prefill
from deltaserve.kernels.attention_flashinfer import WORKSPACE_BYTES, FlashInferPrefill
from deltaserve.kernels.attention_prefill import PrefillBackend, PrefillRows
from deltaserve.model.context import ForwardContext
from deltaserve.model.parallel import TensorParallel
from deltaserve.runner.inputs import StepLayout

logger = logging.getLogger(__name__)


def build_backend(
    name: str, config: ModelConfig, tp: TensorParallel, block_size: int, dtype: torch.dtype, device: torch.device
) -> PrefillBackend | None:
    """The library serving prefill rows for a resolved --attention-backend (None: TRITON_ATTN, ours). Built after
    the engine's memory share is taken and before the warm-up, so FlashInfer's workspace is measured with the
    weights (runner/warmup.py) and never counted in the KV blocks."""
    if name == "TRITON_ATTN":
        return None
    if name == "FLASH_ATTN":
        return Fa3Prefill()
    if name == "FLASHINFER":
        shapes = tp.shapes(config)  # this rank's heads
        backend = FlashInferPrefill(
            shapes.q_heads.size, shapes.kv_heads.size, config.head_dim, block_size, config.head_dim**-0.5, dtype,
            device,
        )  # fmt: skip
        logger.info("attention: FlashInfer workspace %d bytes, taken before the cache is sized", WORKSPACE_BYTES)
        return backend
    raise ValueError(f"--attention-backend {name}: not implemented in deltaserve")


def prefill_rows(ctx: ForwardContext, layout: StepLayout) -> PrefillRows:
    """The step's prefill sequences (after its decodes and verify chunks), their device tensors sliced from the
    step's context and their lengths from the host layout. A chunk planned behind a verify in flight
    (runner/spec_chain.py) knows its true start only on the device; such chunks are decodes or verify chunks, and a
    prefill chunk among them is refused rather than planned from a length that may be wrong."""
    first_seq = ctx.num_decodes + ctx.num_spec_seqs
    if layout.chained[first_seq:].any():
        raise RuntimeError("a prefill chunk planned behind a verify in flight: its context length is not on the host")
    starts = layout.query_start_loc[first_seq:]
    return PrefillRows(
        first_row=ctx.num_decode_tokens + ctx.num_spec_tokens,
        query_start_loc=ctx.prefill_query_start_loc,
        seq_lens=ctx.seq_lens[first_seq:],
        block_tables=ctx.block_tables[first_seq:],
        max_query_len=ctx.max_query_len,
        max_seq_len=ctx.max_seq_len,
        query_start_loc_host=starts - starts[0],
        seq_lens_host=(layout.starts + layout.num_new)[first_seq:],
    )


def plan_step(backend: PrefillBackend | None, ctx: ForwardContext, layout: StepLayout) -> None:
    """Sets ctx.prefill_attention for an eager step with prefill rows under a library backend (once per step)."""
    if backend is None or ctx.num_prefill_tokens == 0:
        return
    ctx.prefill_attention = backend.prepare(prefill_rows(ctx, layout))
