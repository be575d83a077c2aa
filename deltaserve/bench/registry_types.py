"""What the oracle registry hands out, and the fixed reasons, notes and settings it writes into them.

`OracleLaunch` is a peer server launch (registry.py's `vllm_launch`), with the exemption text of a text-only
checkpoint and the reason and denominator note of image traffic; `OracleEngine` is an in-process oracle
(registry.py's `vllm_engine`), with the engine arguments and environment every in-process oracle gets beside the
production configuration (they change what it reports or how it shares a GPU, never what it computes).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

TEXT_ONLY_EXEMPTION = "text-only checkpoint: --language-model-only decides nothing"
MEDIA_REASON = (
    "no --language-model-only: image traffic needs the vision tower, which vLLM's production configuration for "
    "media keeps (hence no fused QK-norm + RoPE + gate attention path)"
)
# The denominator note of every image-traffic launch: not a deviation (this is vLLM's production configuration for
# media) but a difference from its text-serving configuration that can move the ratios.
MEDIA_TRAFFIC_NOTE = (
    "vision-tower-kept: image traffic, so vLLM serves in its production configuration for media, without "
    "--language-model-only (that flag drops the vision tower and would refuse every image). Its vision tower is "
    "built (0.84 GiB more weights and 1.0 GiB less KV cache on the 35B-A3B shape, measured on one H200 on "
    "2026-11-29), and its decoder attention runs without the fused QK-norm + RoPE + gate kernel, which vLLM 0.26 "
    "uses only when serving text only (Qwen3NextAttention's text_only); deltaserve's fused preamble applies the "
    "3-D MRoPE positions itself. On text traffic the two vLLM configurations ran at the same speed within noise "
    "(35B-A3B, c1 185.6 vs 184.0 and c32 1507.4 vs 1505.7 output tok/s), so the missing fusion is not expected "
    "to move these ratios much; the vision encoder's own kernels (ViT attention backend at vLLM's choice) are "
    "vLLM's production ones."
)


@dataclass
class OracleLaunch:
    """A peer server launch: argv, environment, and why it looks the way it does."""

    oracle: str
    argv: list[str]
    env: dict[str, str]
    exemption: str | None = None
    reasons: list[str] = field(default_factory=list)
    version_probe: list[str] = field(default_factory=list)
    deviations: list[str] = field(default_factory=list)  # names in DEVIATIONS
    denominator_note: str | None = None

    @property
    def command_line(self) -> str:
        return shlex.join(self.argv)


# Engine arguments that change what an in-process oracle reports, never what it computes.
HARNESS_ENGINE_KWARGS: dict[str, tuple[Any, str]] = {
    "logprobs_mode": ("raw_logits", "per-step logits come back as raw logits (bf16 values), not logprobs"),
}
# An in-process oracle that shares its GPU with other gates (`gate tokens --share-gpu`): cache sizes only. A fixed
# KV cache makes vLLM skip its start-up memory profiling (gpu_worker.determine_available_memory), whose assertion
# fails when another process frees memory meanwhile; the small utilization only passes request_memory's start-up
# check (free >= utilization x total) beside the other gates.
SHARED_GPU_ENGINE_KWARGS: dict[str, tuple[Any, str]] = {
    "gpu_memory_utilization": (0.05, "shares the GPU with other token gates; start-up check only"),
    "kv_cache_memory_bytes": (
        2**30,
        "a fixed 1 GiB KV cache (the gate's 32 prompts of <= 200 tokens need a few MB): no memory profiling beside "
        "other processes; no preemption either way, so no computation changes",
    ),
}
# Environment an in-process oracle needs besides the site's.
IN_PROCESS_ENV: dict[str, tuple[str, str]] = {
    "VLLM_ALLOW_INSECURE_SERIALIZATION": (
        "1",
        "LLM.apply_model pickles the gate's inspection function into the engine process; changes no computation",
    ),
}


@dataclass
class OracleEngine:
    """An in-process oracle: the `vllm.LLM` keyword arguments, the environment, and why they look so."""

    oracle: str
    kwargs: dict[str, Any]
    env: dict[str, str]
    reasons: list[str] = field(default_factory=list)
    deviations: list[str] = field(default_factory=list)
    denominator_note: str | None = None
