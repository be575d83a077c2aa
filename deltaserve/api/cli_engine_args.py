"""The engine's flags of `deltaserve serve`: model shape and memory, loading, parallelism, kernels, scheduling,
sampling defaults, multimodal inputs, structured outputs, speculative decoding and prefix caching.

Most are vLLM's flags with vLLM's names and defaults; the ones deltaserve adds say "deltaserve only" in their help
(--lone-prefill-tokens, --one-pool, --ignore-unexpected-tensors, --device, and the GDN state checkpoints' knobs of
prefix caching). cli_args.py's add_arguments adds them after MODEL, in this order, which is the order of `--help`.
"""

from __future__ import annotations

from typing import Any

from deltaserve.api.cli_values import (
    SWITCH,
    human_int,
    json_object,
    kv_cache_bytes,
    limit_mm_per_prompt,
    optional_int,
    optional_value,
    reasoning_config,
    speculative_config,
    structured_outputs_config,
)
from deltaserve.api.settings import MAX_LOGPROBS
from deltaserve.engine_config import GDN_PREFILL_BACKENDS, EngineConfig

# vLLM's --prefix-caching-hash-algo values (its CacheConfig.prefix_caching_hash_algo); any other is refused
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_CHECKPOINT_INTERVAL = EngineConfig.__dataclass_fields__["prefix_cache_checkpoint_interval"].default


def add_engine_arguments(add: Any) -> None:
    add("--tokenizer", default=None, help="tokenizer folder or id (default: MODEL)")
    add("--max-model-len", type=human_int, default=None, help="context length, e.g. 32768 or 32k (default: model)")
    add(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences in one batch (default: vLLM's, 1024 on an H200, capped by the GDN state memory)",
    )
    add(
        "--max-num-batched-tokens",
        type=human_int,
        default=None,
        help="token budget of one engine step (default: on a GPU 2048-8192 by the model's active parameters per token, "
        "2048 for the 27B shape and 8192 for 35B-A3B; 2048 on the CPU)",
    )
    add(
        "--lone-prefill-tokens",
        type=human_int,
        default=None,
        metavar="N",
        help="deltaserve only: token budget of a step whose only work is one prompt's prefill (nothing decoding, "
        "nothing else waiting); at least --max-num-batched-tokens, 0: off (default: 8192 on a GPU when "
        "--max-num-batched-tokens is not given, else off)",
    )
    add(
        "--one-pool",
        action="store_true",
        help="deltaserve only, experimental: KV blocks and GDN state slots in one pool of pages, a slot taken only "
        "while its sequence runs (docs/ARCHITECTURE.md, 'One pool'); default: the cache budget split between them at "
        "start-up",
    )
    add("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory for weights + caches")
    add(
        "--kv-cache-memory-bytes",
        type=kv_cache_bytes,
        default=None,
        metavar="BYTES",
        help="the KV cache budget per GPU in bytes, e.g. 8G (binary) or 8.5g (decimal): attention KV blocks and GDN "
        "state slots, sized from it instead of --gpu-memory-utilization (which it overrides, as in vLLM); also the "
        "budget on the CPU",
    )
    add(
        "--num-gpu-blocks-override",
        type=optional_int,
        default=None,
        metavar="N",
        help="this many KV cache blocks whatever the memory budget computes (as vLLM: for testing preemption); "
        "the GDN state slots are sized as without it",
    )
    add("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "half", "float32", "float"))
    add(
        "--load-format",
        default="auto",
        choices=("auto", "safetensors", "fastsafetensors", "instanttensor", "dummy"),
        help="dummy: seeded random weights of the right shapes (fastsafetensors and instanttensor, vLLM's faster "
        "readers of the same safetensors files, read as safetensors)",
    )
    add(
        "--quantization",
        "-q",
        type=optional_value,
        default=None,
        metavar="METHOD",
        help="fp8: accepted on a checkpoint whose config declares block FP8 (the config decides, as in vLLM); "
        "online quantization of an unquantized checkpoint and every other method are refused by name",
    )
    add("--block-size", type=int, default=16, help="tokens per KV-cache block")
    _add_prefix_caching_arguments(add)
    add(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over N GPUs, one worker process each (several hosts: start every rank with torchrun)",
    )
    add(
        "--distributed-executor-backend",
        default=None,
        metavar="BACKEND",
        help="mp (the default: worker processes, or ranks started by torchrun); uni at -tp 1; others are refused",
    )
    add(
        "--enable-expert-parallel",
        "-ep",
        action=SWITCH,
        default=False,
        help="MoE: split the experts whole across the tensor-parallel ranks instead of each expert's width",
    )
    add(
        "--gdn-prefill-backend",
        default=None,
        choices=GDN_PREFILL_BACKENDS,
        help="the Gated DeltaNet prefill kernel: triton: deltaserve's own (also the default); flashinfer: "
        "FlashInfer's chunk_gated_delta_rule as vLLM calls it, refused at start-up off an SM90 GPU, in float32 or "
        "without flashinfer; cutedsl: refused (Blackwell-only in vLLM)",
    )
    add(
        "--attention-backend",
        default=None,
        help="vLLM's attention backend name: TRITON_ATTN (deltaserve's own paged attention, also the default or "
        "auto); FLASH_ATTN: vLLM's FlashAttention 3 for the prefill rows (needs vLLM, an SM90+ GPU, bf16/fp16); "
        "FLASHINFER: FlashInfer's paged prefill for the prefill rows (needs flashinfer); decode and verify rows "
        "stay deltaserve's; vLLM's other values are refused",
    )
    add(
        "--attention-config",
        "-ac",
        type=json_object,
        default=None,
        help='vLLM\'s AttentionConfig as JSON: its "backend" is --attention-backend (the two are mutually '
        "exclusive, as in vLLM); its other keys are logged, not used (deltaserve picks its own attention kernels)",
    )
    add("--seed", type=int, default=0)
    add(
        "--stream-interval",
        type=int,
        default=1,
        help="stream a sequence's tokens once this many gathered (its first and last at once); 1: every step's",
    )
    add("--enforce-eager", action=SWITCH, default=False, help="no CUDA graphs")
    add(
        "--async-scheduling",
        action=SWITCH,
        default=True,
        help="plan the next engine step while the current one runs (default on, as in vLLM)",
    )
    add(
        "--scheduling-policy",
        default="fcfs",
        choices=("fcfs", "priority"),
        help="fcfs: first come, first served; priority: by each request's `priority` (lower first, ties by arrival; "
        "preemption takes the highest value); under fcfs a request priority other than 0 is refused",
    )
    add(
        "--ignore-unexpected-tensors",
        action=SWITCH,
        default=False,
        help="deltaserve only: load a checkpoint whose tensors include ones no parameter or skip rule explains "
        "(they are listed in the log); without it such a checkpoint is refused",
    )
    add(
        "--device",
        default=None,
        choices=("auto", "cuda", "cpu"),
        help="deltaserve only (default: cuda when available; cpu for the built-in tiny checkpoint)",
    )
    add(
        "--generation-config",
        default="auto",
        help="auto: sampling defaults from the checkpoint's generation_config.json; vllm: none; or a folder",
    )
    add(
        "--override-generation-config",
        type=json_object,
        default=None,
        help="JSON merged over the sampling defaults, e.g. '{\"temperature\": 0.6}'",
    )
    add(
        "--language-model-only",
        action=SWITCH,
        default=False,
        help="serve a multimodal checkpoint as text only: no vision tower is built or loaded (as vLLM's flag)",
    )
    add("--allowed-local-media-path", default=None, help="images and videos may be read from files under this folder")
    add(
        "--limit-mm-per-prompt",
        type=limit_mm_per_prompt,
        default=None,
        help='most images / videos per prompt, vLLM\'s JSON form, e.g. \'{"image": 2, "video": 1}\'',
    )
    add("--mm-processor-kwargs", type=json_object, default=None, help="image/video processor overrides (JSON)")
    add("--max-logprobs", type=int, default=MAX_LOGPROBS,
        help="most logprobs a request may ask for per position; -1: no cap but the vocabulary (vLLM: 20)")  # fmt: skip
    add(
        "--structured-outputs-config",
        type=structured_outputs_config,
        default=None,
        help='structured outputs, vLLM\'s JSON: {"backend": "xgrammar" | "auto", "disable_any_whitespace": ...}',
    )
    add(
        "--reasoning-config",
        type=reasoning_config,
        default=None,
        help='thinking-token budgets\' markers, vLLM\'s JSON: {"reasoning_start_str": "<think>", "reasoning_end_str": '
        '"</think>"} (default: --reasoning-parser\'s)',
    )
    add(
        "--speculative-config",
        "-sc",
        type=speculative_config,
        default=None,
        help='speculative decoding with the checkpoint\'s MTP layer, vLLM\'s JSON: {"method": "mtp", '
        '"num_speculative_tokens": k} (plus vLLM\'s rejection_sample_method / synthetic_acceptance_* keys)',
    )
    # vLLM's shorthand for three keys of --speculative-config (merged by cli_values.merge_spec_aliases)
    add("--spec-method", default=None, help="--speculative-config's method (e.g. mtp)")
    add("--spec-model", default=None, help="--speculative-config's model (a draft model: refused, MTP only)")
    add("--spec-tokens", type=int, default=None, help="--speculative-config's num_speculative_tokens")


def _add_prefix_caching_arguments(add: Any) -> None:
    """vLLM's prefix-caching flags, and deltaserve's own knobs of its GDN state checkpoints (docs/compatibility.md)."""
    add(
        "--enable-prefix-caching",
        action=SWITCH,
        default=True,
        help="reuse the KV blocks and GDN state checkpoints of earlier prompts that share a prefix (default on, as in "
        "vLLM 0.34 for hybrid models); --no-enable-prefix-caching computes every prompt in full",
    )
    add(
        "--prefix-caching-hash-algo",
        default=None,
        choices=PREFIX_CACHING_HASH_ALGOS,
        help="accepted for vLLM's launch lines: deltaserve hashes blocks with its own 128-bit hash whichever is given",
    )
    add(
        "--prefix-cache-checkpoint-interval",
        type=int,
        default=DEFAULT_CHECKPOINT_INTERVAL,
        metavar="N",
        help="deltaserve only: keep a GDN state checkpoint every N tokens of a long prefill (a multiple of the GDN "
        f"chunk size, 64), so a long shared prefix hits on its second sighting; 0: none (default "
        f"{DEFAULT_CHECKPOINT_INTERVAL})",
    )
    add(
        "--num-checkpoint-slots",
        type=int,
        default=None,
        metavar="N",
        help="deltaserve only: GDN state slots kept for prefix-cache checkpoints beside those of running sequences "
        "(default: sized from memory; stated at start-up)",
    )
