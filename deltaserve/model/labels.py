"""Profiler labels: torch.profiler.record_function ranges around each decoder layer and each op of the model, so a
profile (benchmarks/decode_step.py, benchmarks/mixed_step.py) can attribute every GPU kernel to the op that
launched it.

Off by default, and then free of profiler work: `label(name)` returns one shared no-op context manager (no
record_function call, no string built: the layer names are made with the model), so the serving path pays a flag
check and an empty `with` per op, on the host only (a replayed CUDA graph runs no host code at all). On with
DELTASERVE_PROFILE_LABELS=1 (read once, at import) or, in a benchmark, `enable()` / the `enabled()` block; a
decode graph captured while labels are off holds none of them.

A label is PREFIX + one of:
- `layer.{index}.{layer_type}` around a decoder layer (layer_type as the config names it: full_attention,
  linear_attention), the innermost range of whatever the layer runs outside its ops;
- `{kind}.{op}` around one op, kind attn / gdn / mlp for a layer's mixer and MLP, layer for its norms and the
  positions' cos/sin rows, lm for the embedding and the logits: `attn.qkv_proj`, `attn.attn_preamble`,
  `attn.store_kv`, `attn.paged_attention`, `attn.sigmoid_gate_mul`, `attn.o_proj`, `gdn.in_proj_qkvzba`,
  `gdn.causal_conv1d_update`, `gdn.causal_conv1d_prefill`, `gdn.gdn_decode`, `gdn.gdn_prefill`,
  `gdn.gated_rms_norm`, `gdn.out_proj`, `mlp.gate_up`, `mlp.silu_and_mul`, `mlp.down`, `mlp.fused_moe_block`
  (router, routed and shared experts in one op), `layer.rms_norm`, `lm.embed`, `lm.lm_head`, `mtp.fc` (the MTP
  layer's input projection; its decoder layer is `layer.{num_hidden_layers}.full_attention`), ...;
- `lm` around compute_logits (its fp32 upcast and, under tensor parallelism, the gather).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from deltaserve import env

PREFIX = "ds:"


class _NoLabel:
    """The shared no-op context manager `label` returns while labels are off."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LABEL = _NoLabel()
_is_on = env.profile_labels()


_STACK: list[str] = []  # the labels open now, innermost last (kept only while labels are on)


class _Label:
    """A profiler range named PREFIX + name that also keeps `current()` (a profile of kernels the profiler links
    to no host op, Triton's driver launches, attributes them by launch order: benchmarks/profile_prefill.py)."""

    __slots__ = ("name", "range")

    def __init__(self, name: str) -> None:
        self.name = name
        self.range = torch.profiler.record_function(PREFIX + name)

    def __enter__(self) -> object:
        _STACK.append(self.name)
        return self.range.__enter__()

    def __exit__(self, *exc: object) -> None:
        _STACK.pop()
        self.range.__exit__(*exc)


def label(name: str) -> AbstractContextManager[object]:
    """A profiler range named PREFIX + name while labels are on, else the shared no-op."""
    if _is_on:
        return _Label(name)
    return _NO_LABEL


def current() -> str | None:
    """The innermost label open now (None outside every label, or while labels are off)."""
    return _STACK[-1] if _STACK else None


def is_enabled() -> bool:
    return _is_on


def enable(is_on: bool = True) -> None:
    """Turns the labels on (or off) for every model in this process from the next op on."""
    global _is_on
    _is_on = is_on


@contextmanager
def enabled() -> Iterator[None]:
    """Labels on inside the block, as they were after it."""
    was_on = _is_on
    enable(True)
    try:
        yield
    finally:
        enable(was_on)
