"""Where a ModelRunner runs, decided once at construction: the device and dtype named by the engine config ("auto"
resolved as vLLM does), the GPU of a tensor-parallel rank, the CPU thread count, the GDN prefill kernel
(--gdn-prefill-backend), the attention kernel of prefill rows (--attention-backend), and the share of the GPU this
engine may size its caches from (runner/warmup.py spends it)."""

from __future__ import annotations

import logging
import os

import torch

from deltaserve import env
from deltaserve.config import ModelConfig
from deltaserve.engine_config import EngineConfig
from deltaserve.kernels import attention_fa3, attention_flashinfer, gdn, gdn_flashinfer
from deltaserve.kernels.flashinfer_import import flashinfer_version
from deltaserve.model.parallel import TensorParallel
from deltaserve.runner.cache import requested_bytes

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def is_cuda(device: torch.device) -> bool:
    """Whether `device` is a GPU: the one test of the runner's CUDA-only start-up and serving paths (the cache budget
    from the GPU's memory, the warm-up's peak, the CUDA graphs, pinned host copies), so that
    tests/runner/test_cuda_paths_on_cpu.py can run them on the CPU by patching this alone."""
    return device.type == "cuda"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def rank_device(name: str, tp: TensorParallel) -> torch.device:
    """The device named `name`; under tensor parallelism on CUDA, the rank's own GPU of this host (made current)."""
    device = resolve_device(name)
    if device.type == "cuda" and tp.is_parallel:
        device = torch.device("cuda", tp.local_rank)  # one GPU per rank of this host
        torch.cuda.set_device(device)
    return device


def set_cpu_threads(device: torch.device, hidden_size: int, tp: TensorParallel) -> None:
    """On the CPU, the thread count env.cpu_threads_for picks for the model's size; ranks of one host share its
    cores."""
    if device.type != "cpu":
        return
    threads = env.cpu_threads_for(hidden_size)
    if threads is None and tp.is_parallel:
        threads = max(1, (os.cpu_count() or 1) // tp.size)  # the ranks share the host's cores
    if threads:
        torch.set_num_threads(threads)


def engine_share(device: torch.device, utilization: float) -> tuple[int, int]:
    """(the bytes this engine may use, the bytes allocated before it built anything); (0, 0) off CUDA.

    vLLM 0.26's per-instance share: utilization x total is this engine's, and must be free at start-up (what other
    processes hold is not subtracted from it, so two engines at 0.45 share one GPU as under vLLM)."""
    if not is_cuda(device):
        return 0, 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # this process's cached but unused blocks are free for this engine
    free, total = torch.cuda.mem_get_info(device)
    return requested_bytes(total, free, utilization), torch.cuda.memory_allocated(device)


def gdn_prefill_backend(
    engine_config: EngineConfig, device: torch.device, dtype: torch.dtype, config: ModelConfig
) -> str:
    """engine_config.gdn_prefill_backend (--gdn-prefill-backend) resolved for the GDN layers (kernels/gdn.py
    PREFILL_BACKENDS). "triton", deltaserve's own kernel, for triton. The default (vLLM's auto, which picks FlashInfer
    on SM90): "flashinfer-large" where FlashInfer's kernel can run (the calls of kernels/gdn.py
    FLASHINFER_MIN_TOKENS rows or more take it, smaller ones ours: each kernel where it measured faster), else
    "triton", with the reason logged. "flashinfer" (every call without an in-step checkpoint) when asked and usable,
    else a ValueError naming the reason: where vLLM 0.26 falls back to its Triton kernel in silence, an explicit
    request deltaserve cannot honour is refused."""
    requested = engine_config.gdn_prefill_backend
    if requested == "triton":
        return "triton"
    if requested not in (None, "flashinfer"):
        raise ValueError(f"--gdn-prefill-backend {requested}: not served (flashinfer or triton)")
    reason = gdn_flashinfer.unusable_reason(device, dtype, config.linear_key_head_dim, config.linear_value_head_dim)
    if requested is None:
        if reason is not None:
            logger.info("GDN prefill: deltaserve's kernel (FlashInfer's cannot run here: %s)", reason)
            return "triton"
        logger.info("GDN prefill: FlashInfer's chunk_gated_delta_rule (flashinfer %s) for calls of %d rows or more, "
                    "deltaserve's kernel for smaller ones and in-step prefix-cache checkpoints (--gdn-prefill-backend "
                    "triton: deltaserve's kernel for all)",
                    flashinfer_version(), gdn.FLASHINFER_MIN_TOKENS)  # fmt: skip
        return "flashinfer-large"
    if reason is not None:
        raise ValueError(
            f"--gdn-prefill-backend flashinfer: FlashInfer's GDN prefill cannot run here: {reason}. vLLM 0.26 would "
            "fall back to its Triton kernel without saying so; deltaserve refuses the explicit request instead: "
            "leave the flag out, or pass triton, to serve deltaserve's own GDN prefill kernel"
        )
    logger.info("GDN prefill: FlashInfer's chunk_gated_delta_rule (flashinfer %s), as vLLM calls it on SM90; in-step "
                "prefix-cache checkpoints take deltaserve's kernel", flashinfer_version())  # fmt: skip
    return "flashinfer"


def attention_backend(
    engine_config: EngineConfig, device: torch.device, dtype: torch.dtype, config: ModelConfig, block_size: int
) -> str:
    """engine_config.attention_backend (--attention-backend, vLLM's names) resolved for the full-attention layers:
    "TRITON_ATTN", deltaserve's own kernel, for TRITON_ATTN; the default (vLLM's auto) is "FLASH_ATTN" where vLLM's
    FlashAttention 3 can run, as vLLM picks on SM90, else "TRITON_ATTN" with the reason logged
    (docs/attention-backends.md); "FLASH_ATTN" / "FLASHINFER" when asked and usable, else a ValueError naming the
    reason. VLLM_ATTENTION_BACKEND is not read (vLLM 0.26 does not read it either): a warning says so."""
    if env.vllm_attention_backend() is not None:
        logger.warning("VLLM_ATTENTION_BACKEND=%s is ignored, as vLLM 0.26 ignores it: pass --attention-backend",
                       env.vllm_attention_backend())  # fmt: skip
    requested = engine_config.attention_backend
    if requested == "TRITON_ATTN":
        return "TRITON_ATTN"
    if requested is None:  # vLLM's auto: FlashAttention on SM90, where it can run; ours elsewhere
        reason = attention_fa3.unusable_reason(device, dtype, config.head_dim, block_size)
        if reason is not None:
            logger.info("attention: deltaserve's kernel for every row (vLLM's FlashAttention 3 cannot run here: %s)",
                        reason)  # fmt: skip
            return "TRITON_ATTN"
        logger.info("attention: prefill rows through vLLM's FlashAttention 3 (vllm %s), vLLM's own choice on SM90; "
                    "decode and verify rows through deltaserve's kernel (--attention-backend TRITON_ATTN: ours for "
                    "all)", attention_fa3.vllm_version())  # fmt: skip
        return "FLASH_ATTN"
    if requested == "FLASH_ATTN":
        library = "vLLM's FlashAttention 3"
        reason = attention_fa3.unusable_reason(device, dtype, config.head_dim, block_size)
    elif requested == "FLASHINFER":
        library = "FlashInfer's paged prefill"
        reason = attention_flashinfer.unusable_reason(device, dtype, config.head_dim)
    else:
        raise ValueError(f"--attention-backend {requested}: not implemented in deltaserve")
    if reason is not None:
        raise ValueError(
            f"--attention-backend {requested}: {library} cannot run here: {reason}. Leave the flag out, or pass "
            "TRITON_ATTN, to serve deltaserve's own attention kernel"
        )
    version = attention_fa3.vllm_version() if requested == "FLASH_ATTN" else flashinfer_version()
    logger.info("attention: prefill rows through %s (%s), decode and verify rows through deltaserve's kernel",
                library, version)  # fmt: skip
    return requested
