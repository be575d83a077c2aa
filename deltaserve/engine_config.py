"""EngineConfig: how the engine runs a model (device, dtype, memory, batching limits), as one frozen dataclass.

The CLI flags of `deltaserve serve` / `generate` map one-to-one onto these fields (vLLM's names).
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.reasoning_config import PARSER_STRINGS, parse_reasoning_config
from deltaserve.speculative_config import SpeculativeConfig, parse_speculative_config

# vLLM 0.26's --gdn-prefill-backend choices (EngineArgs.gdn_prefill_backend; None: auto)
GDN_PREFILL_BACKENDS = ("flashinfer", "triton", "cutedsl")
# vLLM 0.26's --attention-backend values deltaserve serves (AttentionBackendEnum names; None: auto, ours):
# TRITON_ATTN deltaserve's own kernel for every row; FLASH_ATTN / FLASHINFER a library's for the prefill rows
# (docs/attention-backends.md)
ATTENTION_BACKENDS = ("TRITON_ATTN", "FLASH_ATTN", "FLASHINFER")
# the other names of vLLM 0.26's AttentionBackendEnum (vllm/v1/attention/backends/registry.py): refused by name, as
# each would run another kernel with other numerics
VLLM_ONLY_ATTENTION_BACKENDS = (
    "FLASH_ATTN_DIFFKV", "TRITON_ATTN_DIFFKV", "ROCM_ATTN", "ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA", "ROCM_AITER_FA",
    "ROCM_AITER_MLA_SPARSE", "XPU_MLA_SPARSE", "TORCH_SDPA", "FLASHINFER_MLA", "TOKENSPEED_MLA",
    "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120", "TRITON_MLA", "CUTLASS_MLA", "FLASHMLA",
    "FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4", "ROCM_FLASHMLA_SPARSE_DSV4",
    "FLASH_ATTN_MLA", "FLASH_ATTN_MLA_SPARSE", "MINIMAX_M3_SPARSE", "NO_ATTENTION", "FLEX_ATTENTION", "HPC_ATTN",
    "ROCM_AITER_UNIFIED_ATTN", "CPU_ATTN", "TURBOQUANT", "CUSTOM",
)  # fmt: skip


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    load_format: str = "auto"  # auto (safetensors) or dummy (vLLM's dummy weights of the right shapes)
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings, capped by memory
    # None: vLLM's default (1024 on GPUs of >= 70 GiB but the A100, else 256), capped so the GDN state slots take
    # at most half of the cache budget
    max_num_seqs: int | None = None
    # None: on a GPU 2048-8192 from the weights one token reads (engine/budget.py), 2048 on the CPU
    max_num_batched_tokens: int | None = None
    # deltaserve only: the tokens a step may take when its only work is one prompt's prefill (nothing decoding,
    # nothing else waiting). None: 8192 on a GPU where max_num_batched_tokens is not given, else
    # max_num_batched_tokens (off); 0: off. The runner and the start-up memory plan are sized for the larger
    lone_prefill_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    # vLLM's --kv-cache-memory-bytes: the cache budget per GPU (per rank) in bytes, taken as given instead of what
    # gpu_memory_utilization leaves; on the CPU it replaces cpu_kv_cache_bytes. It holds the attention KV blocks
    # (the MTP layer's too), the GDN state slots (running sequences and prefix-cache checkpoints) and the verify
    # scratch (runner/memory.py, docs/ARCHITECTURE.md#cache-budget). None, or 0 as vLLM reads it: not set
    kv_cache_memory_bytes: int | None = None
    cpu_kv_cache_bytes: int = 256 * 1024**2  # the cache budget on the CPU when kv_cache_memory_bytes is not set
    # vLLM's --num-gpu-blocks-override: this many attention KV blocks whatever the budget computes (vLLM uses it to
    # test preemption); the GDN state slots are sized as without it. None: the budget decides
    num_gpu_blocks_override: int | None = None
    num_state_slots: int | None = None  # None: sized from memory (at least max_num_seqs)
    # deltaserve only: the KV blocks and the GDN state slots in one pool of pages, a slot a run of pages taken only
    # while its sequence runs (docs/ARCHITECTURE.md, "One pool"); False: the budget split between them at start-up
    one_pool: bool = False
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = True  # plan step N+1 while step N runs (vLLM's default); False: one step at a time
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (a request's priority, lower first, then
    # arrival; preemption takes the highest); a non-zero request priority is refused under "fcfs"
    scheduling_policy: str = "fcfs"
    ignore_unexpected_tensors: bool = False  # load a checkpoint whose extra tensors no rule explains (listed)
    language_model_only: bool = False  # vLLM's flag: a multimodal checkpoint served as text (no vision tower)
    # images and videos (vLLM's flag names): local files may be read only under this folder; per-prompt item
    # limits in vLLM's JSON form ('{"image": 2, "video": 1}'); processor overrides (min_pixels, fps, ...)
    allowed_local_media_path: str | None = None
    limit_mm_per_prompt: str | None = None
    mm_processor_kwargs: dict | None = None
    generation_config: str = "auto"  # auto: the checkpoint's generation_config.json; vllm: built-in defaults
    tokenizer: str | None = None
    # vLLM's --structured-outputs-config JSON ({"backend": "xgrammar", "disable_any_whitespace": ...}); None: defaults
    structured_outputs_config: str | None = None
    # vLLM's --reasoning-parser (the engine's part: the reasoning start / end strings of thinking-token budgets) and
    # --reasoning-config JSON ({"reasoning_start_str": ..., "reasoning_end_str": ...}): engine/thinking_budget.py
    reasoning_parser: str | None = None
    reasoning_config: str | dict | None = None
    # tensor parallelism (vLLM's flags): one worker process per rank; "mp" (multiprocessing, or one process per rank
    # started by torchrun with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) is the only multi-process backend
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: mp; "uni" (vLLM's one-process backend) at TP=1 only
    enable_expert_parallel: bool = False  # MoE experts split whole across the ranks instead of each one's width
    # hybrid prefix caching (docs/prefix-caching.md), on by default as vLLM 0.34 has it for hybrids: a request that
    # shares a prefix with earlier traffic resumes at the deepest GDN state checkpoint of that prefix
    enable_prefix_caching: bool = True
    # a checkpoint every N tokens of a prefill (N a multiple of the GDN chunk size, 64); 0: none. A first guess,
    # to be measured on the H200 (docs/prefix-caching.md)
    prefix_cache_checkpoint_interval: int = 8192
    num_checkpoint_slots: int | None = None  # state slots for checkpoints beside max_num_seqs; None: from memory
    # vLLM's --quantization: None lets the checkpoint's config decide; "fp8" must agree with a checkpoint that
    # declares block FP8 (fp8_format.check_requested_quantization); everything else is refused at start-up
    quantization: str | None = None
    # vLLM's --speculative-config (deltaserve/speculative_config.py): None, or MTP drafting with its k and rule; its
    # JSON text or dict is parsed (and refused by key or method) on construction
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --gdn-prefill-backend: None (vLLM's auto; "auto" offline is read so): FlashInfer's kernel for large
    # calls where it runs, else deltaserve's own; "triton": deltaserve's own GDN prefill kernel; "flashinfer":
    # FlashInfer's (kernels/gdn_flashinfer.py), refused at start-up where it cannot run (runner/device_setup.py);
    # "cutedsl" is refused here (docs/kernels.md#flashinfers-gdn-prefill)
    gdn_prefill_backend: str | None = None
    # vLLM's --attention-backend (AttentionBackendEnum names, any case; "auto" is None): None, vLLM's FlashAttention 3
    # for the prefill rows where it runs, else as "TRITON_ATTN": deltaserve's own paged attention for every row;
    # "FLASH_ATTN" (vLLM's FlashAttention 3) or "FLASHINFER" (FlashInfer's paged prefill) for the prefill rows,
    # refused at start-up where they cannot run (runner/device_setup.py); vLLM's other values are refused here
    # (docs/attention-backends.md)
    attention_backend: str | None = None
    # vLLM's --jit-monitor-mode / --jit-monitor-verbose (runner/jit_monitor.py): a Triton kernel compiled after
    # start-up is logged once ("warn") or fails its step ("error"); verbose logs every compile with its signature
    jit_monitor_mode: str = "warn"
    jit_monitor_verbose: bool = False
    # vLLM's --stream-interval: a streamed sequence's deltas are sent once this many new tokens gathered (its first
    # token and its finish at once); 1: every step's tokens (engine/frontend.py OutputProcessor)
    stream_interval: int = 1

    @property
    def chains_verifies(self) -> bool:
        """Whether chained chunks arise (async verify, scheduler/spec.py can_chain and runner/spec_chain.py): the
        speculative config asks for async_verify, and a step is planned before the last one is collected."""
        return bool(self.speculative_config and self.speculative_config.async_verify and self.async_scheduling)

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        check_gdn_prefill_backend(self.gdn_prefill_backend)
        if (
            isinstance(self.stream_interval, bool)
            or not isinstance(self.stream_interval, int)
            or self.stream_interval < 1
        ):
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        parse_reasoning_config(self.reasoning_config)  # its fields, checked at once (the strings need the tokenizer)
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSER_STRINGS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose from {tuple(PARSER_STRINGS)}")
        check_jit_monitor_mode(self.jit_monitor_mode)
        if self.gdn_prefill_backend == "auto":
            object.__setattr__(self, "gdn_prefill_backend", None)
        object.__setattr__(self, "attention_backend", check_attention_backend(self.attention_backend))
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check_kv_cache_memory_bytes(self.kv_cache_memory_bytes)
        if self.kv_cache_memory_bytes == 0:  # vLLM tests the value for truth: 0 leaves gpu_memory_utilization in charge
            object.__setattr__(self, "kv_cache_memory_bytes", None)
        if self.num_gpu_blocks_override is not None and (
            isinstance(self.num_gpu_blocks_override, bool)
            or not isinstance(self.num_gpu_blocks_override, int)
            or self.num_gpu_blocks_override < 1
        ):
            override = self.num_gpu_blocks_override
            raise ValueError(f"num_gpu_blocks_override must be a positive integer, got {override!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.lone_prefill_tokens is not None and self.lone_prefill_tokens < 0:
            raise ValueError(f"lone_prefill_tokens must be 0 (off) or positive, got {self.lone_prefill_tokens}")
        if self.prefix_cache_checkpoint_interval < 0:
            interval = self.prefix_cache_checkpoint_interval
            raise ValueError(f"prefix_cache_checkpoint_interval must be 0 (none) or positive, got {interval}")
        if self.num_checkpoint_slots is not None and self.num_checkpoint_slots < 0:
            raise ValueError(f"num_checkpoint_slots must be at least 0, got {self.num_checkpoint_slots}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one process: it needs tensor_parallel_size 1 (-tp 1), got "
                f"{self.tensor_parallel_size}; 'mp' runs one worker process per rank"
            )
        if self.distributed_executor_backend not in (None, "mp", "uni"):
            raise ValueError(
                f"distributed_executor_backend {self.distributed_executor_backend!r} is not supported: deltaserve "
                "runs tensor parallelism with 'mp' only (worker processes it starts itself, or one process per rank "
                "started by torchrun with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)"
            )


def check_kv_cache_memory_bytes(value: object) -> None:
    """A byte count: an int (not a bool), at least 0, or None. vLLM's field is an int; a negative one would leave no
    memory for the cache at all, refused here by name rather than at the cache's allocation."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"kv_cache_memory_bytes must be an integer number of bytes, got {value!r}")
    if value < 0:
        raise ValueError(f"kv_cache_memory_bytes must be at least 0 (0: not set), got {value}")


JIT_MONITOR_MODES = ("warn", "error")


def check_jit_monitor_mode(value: object) -> None:
    """vLLM 0.26's modes (ObservabilityConfig.jit_monitor_mode), refused otherwise in its words."""
    if value not in JIT_MONITOR_MODES:
        raise ValueError(f"Unsupported JIT monitor mode: {value!r}")


def check_gdn_prefill_backend(value: object) -> None:
    """One of vLLM's --gdn-prefill-backend values, "auto" or None; cutedsl is refused by name: vLLM 0.26 runs its
    CuTe-DSL GDN prefill on Blackwell only, and deltaserve does not serve it."""
    if value == "cutedsl":
        raise ValueError(
            "--gdn-prefill-backend cutedsl (gdn_prefill_backend='cutedsl'): not served by deltaserve: vLLM 0.26's "
            "CuTe-DSL GDN prefill kernel runs on Blackwell (SM10x) only and deltaserve does not implement it; "
            "choose flashinfer (FlashInfer's kernel, SM90) or triton (deltaserve's own)"
        )
    if value is not None and value not in (*GDN_PREFILL_BACKENDS, "auto"):
        raise ValueError(
            f"gdn_prefill_backend must be one of {', '.join(GDN_PREFILL_BACKENDS)} (None or 'auto': the default), "
            f"got {value!r}"
        )


def check_attention_backend(value: object) -> str | None:
    """vLLM's --attention-backend value, read as vLLM 0.26 reads it (AttentionConfig.validate_backend_before: "auto"
    in any case is None, else the enum name upper-cased), -> one of ATTENTION_BACKENDS or None. vLLM's other names
    are refused by name (another kernel's numerics must not arrive in silence), and unknown names as vLLM refuses
    them."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"attention_backend must be a string (vLLM's AttentionBackendEnum name), got {value!r}")
    if value.lower() == "auto":
        return None
    name = value.upper()
    if name in ATTENTION_BACKENDS:
        return name
    if name in VLLM_ONLY_ATTENTION_BACKENDS:
        raise ValueError(
            f"--attention-backend {name}: not implemented in deltaserve; it serves {', '.join(ATTENTION_BACKENDS)} "
            "(TRITON_ATTN is deltaserve's own kernel; the default takes FLASH_ATTN where it runs; "
            "docs/attention-backends.md)"
        )
    raise ValueError(
        f"Unknown attention backend: '{value}'. Valid options in deltaserve are: {', '.join(ATTENTION_BACKENDS)} "
        "(or auto)"
    )
