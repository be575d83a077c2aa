"""Every `vllm serve` flag of vLLM 0.26 that deltaserve does not implement itself, with what happens when it is given:
the table, read by the server's flags (api/compat.py) and by the offline LLM's keywords of the same names
(check_engine_kwargs).

cli_args.py and cli_engine_args.py implement the flags that shape serving (tensor parallelism among them:
--tensor-parallel-size, --distributed-executor-backend, --enable-expert-parallel); this table covers the rest of
`vllm serve --help`, so that a vLLM launch script parses unchanged, and nothing is dropped in silence:
- log:    accepted and logged at startup; it cannot change a token here (caching, scheduling, kernels, logging,
          distribution, multimodal inputs this text-only server never loads).
- warn:   accepted and logged as a warning: a setting the engine does not honour yet whose absence a user can
          notice: precision (results can differ in the last bits from a vLLM run that honours it), speed
          (speculative decoding), or a route or response field the flag turns on in vLLM.
- refuse: an error naming the flag, unless its value is one listed as allowed: honouring it would change the
          tokens (quantization, LoRA, logits processors, config overrides) or the deployment (multi-GPU/-node).
Boolean flags take vLLM's --X / --no-X pair. Values are parsed as strings; a refused flag's allowed values are
compared case-insensitively.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# flag[,alias...] | kind (switch: --X/--no-X, value, list: one or more values) | policy[:allowed,...] | why
TABLE = """
--additional-config | value | log | platform-specific engine configuration
--aggregate-engine-logging | switch | log | one engine: its logs are already aggregated
--all2all-backend | value | log | expert parallelism sums the ranks with one all-reduce (no all-to-all)
--allow-deprecated-quantization | switch | log | block FP8, the one method served, is not deprecated
--allowed-media-domains | list | log | multimodal inputs are refused (text-only server)
--calculate-kv-scales | switch | log | only used with an fp8 KV cache
--code-revision | value | log | models are loaded from a local folder
--collect-detailed-traces | value | log | no OpenTelemetry tracing
--compilation-config,-cc | value | log | deltaserve does not use torch.compile (it captures CUDA graphs itself)
--optimization-level,-O | value | log | deltaserve does not use torch.compile
--config-format | value | refuse:auto,hf | only Hugging Face configs are read
--convert | value | refuse:auto,none | only text generation is served
--cp-kv-cache-interleave-size | value | log | context parallelism is not used
--cpu-distributed-timeout-seconds | value | log | one process group
--cpu-offload-gb | value | warn | weights are not offloaded to the CPU
--cpu-offload-params | list | warn | weights are not offloaded to the CPU
--cudagraph-capture-sizes | list | log | deltaserve picks its own CUDA-graph batch sizes
--cudagraph-metrics | switch | log | no CUDA-graph metrics
--data-parallel-rank,-dpn | value | log | data parallelism is not used
--data-parallel-start-rank,-dpr | value | log | data parallelism is not used
--data-parallel-size-local,-dpl | value | log | data parallelism is not used
--data-parallel-address,-dpa | value | log | data parallelism is not used
--data-parallel-rpc-port,-dpp | value | log | data parallelism is not used
--data-parallel-backend,-dpb | value | log | data parallelism is not used
--data-parallel-hybrid-lb,-dph | switch | log | data parallelism is not used
--data-parallel-external-lb,-dpe | switch | log | data parallelism is not used
--data-parallel-multi-port-external-lb,-dpm | switch | log | data parallelism is not used
--dbo-decode-token-threshold | value | log | dual-batch overlap is not used
--dbo-prefill-token-threshold | value | log | dual-batch overlap is not used
--dcp-comm-backend | value | log | context parallelism is not used
--dcp-kv-cache-interleave-size | value | log | context parallelism is not used
--default-mm-loras | value | log | no LoRA adapters and no multimodal inputs
--device-ids | value | log | one device, chosen by CUDA_VISIBLE_DEVICES
--diffusion-config,-dc | value | refuse | only autoregressive text generation is served
--disable-cascade-attn | switch | log | no cascade attention
--disable-chunked-mm-input | switch | log | multimodal inputs are refused (text-only server)
--disable-custom-all-reduce | switch | log | all-reduces are NCCL's (no custom all-reduce)
--disable-hybrid-kv-cache-manager | switch | log | deltaserve has one KV/state manager for hybrid models
--disable-nccl-for-dp-synchronization | switch | log | data parallelism is not used
--disable-sliding-window | switch | log | the served models have no sliding-window attention
--distributed-timeout-seconds | value | log | one process group
--download-dir | value | log | models are loaded from a local folder, nothing is downloaded
--ec-transfer-config | value | log | no encoder-cache transfer (text-only server)
--enable-bf16x3-router-gemm | switch | warn | the MoE router runs in the model dtype
--enable-chunked-prefill | switch | log | prefill chunking follows --max-num-batched-tokens
--enable-cumem-allocator | switch | log | no sleep mode
--enable-dbo | switch | log | dual-batch overlap is not used
--enable-elastic-ep | switch | log | expert parallelism is not used
--enable-ep-weight-filter | switch | log | expert parallelism is not used
--enable-eplb | switch | log | expert parallelism is not used
--enable-flashinfer-autotune | switch | log | FlashInfer is not used
--enable-layerwise-nvtx-tracing | switch | log | no NVTX ranges per layer
--disable-log-requests | switch | log | requests are not logged one by one
--enable-logging-iteration-details | switch | log | per-step details are on /metrics
--enable-lora | switch | refuse | LoRA adapters are not supported
--enable-mamba-cache-stochastic-rounding | switch | warn | the recurrent state is stored in float32
--enable-mfu-metrics | switch | log | no FLOP metrics
--enable-mixed-moe-lora-format | switch | log | LoRA adapters are not supported
--enable-mm-embeds | switch | log | multimodal inputs are refused (text-only server)
--enable-moe-shared-loras | switch | log | LoRA adapters are not supported
--enable-prompt-embeds | switch | warn | requests with prompt_embeds are refused
--enable-return-routed-experts | switch | warn | responses carry no routed_experts
--enable-sleep-mode | switch | warn | no sleep mode (no /sleep or /wake_up route)
--enable-tower-connector-lora | switch | log | LoRA adapters are not supported
--eplb-config | value | log | expert parallelism is not used
--expert-placement-strategy | value | log | expert parallelism is not used
--fail-on-environ-validation | switch | log | VLLM_* environment variables are not validated
--fully-sharded-loras | switch | log | LoRA adapters are not supported
--hf-config-path | value | refuse | the config is read from the model folder
--hf-overrides | value | refuse | config overrides would change the model
--hf-token | value | log | nothing is downloaded
--ignore-patterns | list | log | models are loaded from a local folder
--interleave-mm-strings | switch | log | multimodal inputs are refused (text-only server)
--io-processor-plugin | value | log | no pooling I/O processors
--ir-op-priority | value | log | deltaserve picks its own kernels
--kernel-config | value | log | deltaserve picks its own kernels
--kv-cache-dtype | value | warn:auto | the KV cache is kept in the model dtype
--kv-cache-dtype-skip-layers | list | log | the KV cache is kept in the model dtype
--kv-cache-metrics | switch | log | no KV residency metrics
--kv-cache-metrics-sample | value | log | no KV residency metrics
--kv-events-config | value | log | no KV cache events
--kv-offloading-backend | value | log | the KV cache is not offloaded
--kv-offloading-size | value | log | the KV cache is not offloaded
--kv-sharing-fast-prefill | switch | log | no cross-layer KV sharing
--kv-transfer-config | value | refuse | disaggregated prefill/decode is not supported
--linear-backend | value | log | deltaserve picks its own GEMM kernels
--logits-processors | list | refuse | custom logits processors would change the tokens
--logprobs-mode | value | refuse:raw_logprobs | logprobs are the raw model log-probabilities
--long-prefill-token-threshold | value | log | prefill chunking follows --max-num-batched-tokens
--lora-dtype | value | log | LoRA adapters are not supported
--lora-target-modules | list | log | LoRA adapters are not supported
--max-cpu-loras | value | log | LoRA adapters are not supported
--max-lora-rank | value | log | LoRA adapters are not supported
--max-loras | value | log | LoRA adapters are not supported
--mamba-backend | value | log | deltaserve picks its own Gated DeltaNet kernels
--mamba-block-size | value | log | GDN state checkpoints are placed by --prefix-cache-checkpoint-interval
--mamba-cache-dtype | value | warn:auto,float32 | the recurrent state is stored in float32
--mamba-cache-mode | value | log | GDN states are kept at prompt and generation ends (and per checkpoint interval)
--mamba-cache-philox-rounds | value | log | no stochastic rounding of the recurrent state
--mamba-ssm-cache-dtype | value | warn:auto,float32 | the recurrent state is stored in float32
--master-addr | value | log | ranks on several hosts read MASTER_ADDR from the environment (torchrun)
--master-port | value | log | ranks on several hosts read MASTER_PORT from the environment (torchrun)
--max-cudagraph-capture-size | value | log | deltaserve picks its own CUDA-graph batch sizes
--max-long-partial-prefills | value | log | prefill chunking follows --max-num-batched-tokens
--max-num-partial-prefills | value | log | prefill chunking follows --max-num-batched-tokens
--max-num-scheduled-tokens | value | log | the step budget is --max-num-batched-tokens
--max-parallel-loading-workers | value | log | weights load in one process
--media-io-kwargs | value | log | multimodal inputs are refused (text-only server)
--mm-encoder-attn-backend | value | log | text-only server: no vision encoder
--mm-encoder-attn-dtype | value | log | text-only server: no vision encoder
--mm-encoder-fp8-scale-path | value | log | text-only server: no vision encoder
--mm-encoder-fp8-scale-save-margin | value | log | text-only server: no vision encoder
--mm-encoder-fp8-scale-save-path | value | log | text-only server: no vision encoder
--mm-encoder-only | switch | refuse | deltaserve serves the language model only
--mm-encoder-tp-mode | value | log | text-only server: no vision encoder
--mm-ipc-gpu-memory-gb | value | log | text-only server: no vision encoder
--mm-processor-cache-gb | value | log | text-only server: no multimodal processor
--mm-processor-cache-type | value | log | text-only server: no multimodal processor
--mm-shm-cache-max-object-size-mb | value | log | text-only server: no multimodal processor
--mm-tensor-ipc | value | log | text-only server: no multimodal processor
--model-class-overrides | value | refuse | deltaserve implements the architectures itself
--model-impl | value | refuse:auto,vllm | deltaserve implements the architectures itself
--model-loader-extra-config | value | log | the safetensors loader takes no options
--moe-backend | value | log | deltaserve picks its own MoE kernels
--nnodes,-n | value | refuse:1 | several hosts: start every rank with torchrun
--node-rank,-r | value | refuse:0 | several hosts: start every rank with torchrun
--numa-bind | switch | log | no NUMA binding
--numa-bind-cpus | value | log | no NUMA binding
--numa-bind-nodes | value | log | no NUMA binding
--offload-backend | value | warn | weights are not offloaded
--offload-group-size | value | warn | weights are not offloaded
--offload-num-in-group | value | warn | weights are not offloaded
--offload-params | list | warn | weights are not offloaded
--offload-prefetch-step | value | warn | weights are not offloaded
--otlp-traces-endpoint | value | log | no OpenTelemetry tracing
--override-attention-dtype | value | warn | attention runs in the model dtype
--performance-mode | value | log | deltaserve has one tuning
--pipeline-parallel-size,-pp | value | refuse:1 | tensor parallelism is the only parallelism
--pooler-config | value | log | only text generation is served
--prefill-context-parallel-size,-pcp | value | refuse:1 | tensor parallelism is the only parallelism
--decode-context-parallel-size,-dcp | value | refuse:1 | tensor parallelism is the only parallelism
--data-parallel-size,-dp | value | refuse:1 | tensor parallelism is the only parallelism
--prefill-schedule-interval | value | log | the scheduler's own policy
--prefix-match-unit | value | log | prefill chunks end on deltaserve's own checkpoint positions
--profiler-config | value | log | no /start_profile route
--pt-load-map-location | value | log | only safetensors are loaded
--quantization-config | value | refuse | online quantization is not served (only a checkpoint's own block FP8)
--ray-workers-use-nsight | switch | log | no Ray workers
--reasoning-parser-plugin | value | log | only the built-in qwen3 reasoning parser
--renderer-num-workers | value | log | chat templates render in deltaserve's own worker processes
--revision | value | log | models are loaded from a local folder
--runner | value | refuse:auto,generate | only text generation is served
--safetensors-load-strategy | value | log | the loader's own strategy
--safetensors-prefetch-block-size | value | log | the loader's own strategy
--safetensors-prefetch-num-threads | value | log | the loader's own strategy
--scheduler-cls | value | refuse | deltaserve has its own scheduler
--scheduler-reserve-full-isl | switch | log | the scheduler's own policy
--show-hidden-metrics-for-version | value | log | no hidden metrics
--skip-mm-profiling | switch | log | text-only server: nothing multimodal to profile
--skip-tokenizer-init | switch | refuse | the API needs the tokenizer
--specialize-active-lora | switch | log | LoRA adapters are not supported
--swap-space | value | log | CPU swap space is not used
--tokenizer-mode | value | refuse:auto,hf,fast,slow | only Hugging Face tokenizers
--tokenizer-revision | value | log | the tokenizer is loaded from a local folder
--trust-remote-code | switch | log | deltaserve implements the architectures itself and runs no checkpoint code
--ubatch-size | value | log | dual-batch overlap is not used
--use-fp64-gumbel | switch | warn | the sampler draws in float32
--use-tqdm-on-load | switch | log | no progress bar while loading weights
--video-pruning-rate | value | log | text-only server: no video inputs
--watermark | value | refuse | watermarking would change the tokens
--weight-transfer-config | value | log | no weight transfer
--worker-cls | value | refuse | deltaserve has its own model runner
--worker-extension-cls | value | refuse | deltaserve has its own model runner
--lora-modules | list | refuse | LoRA adapters are not supported
--tool-parser-plugin | value | log | only the built-in tool parsers
--tool-server | value | refuse | built-in tools are not supported
--enable-server-load-tracking | switch | log | GET /load always reports the server load
--enable-log-outputs | switch | log | outputs are not logged
--enable-log-deltas | switch | log | outputs are not logged
--log-error-stack | switch | log | tracebacks are logged for internal errors only
--tokens-only | switch | refuse | the OpenAI routes are always served
--data-parallel-supervisor-port | value | log | data parallelism is not used
--dp-supervisor-probe-interval-s | value | log | data parallelism is not used
--dp-supervisor-probe-timeout-s | value | log | data parallelism is not used
--dp-supervisor-probe-failure-threshold | value | log | data parallelism is not used
--enable-ssl-refresh | switch | warn | certificates are read once at startup
--enable-offline-docs | switch | log | the docs routes use FastAPI's defaults
--enable-flash-late-interaction | switch | log | no pooling models
--headless | switch | refuse | the API server always runs
--api-server-count,-asc | value | refuse:1 | one API server process
--grpc | switch | refuse | only the HTTP server is available
--h11-max-header-count | value | log | uvicorn's own header bound applies
"""


@dataclass(frozen=True)
class CompatFlag:
    flags: tuple[str, ...]
    kind: str  # "switch", "value" or "list"
    policy: str  # "log", "warn" or "refuse"
    allowed: tuple[str, ...]  # values that are accepted even under "refuse" (or not warned about under "warn")
    reason: str

    @property
    def dest(self) -> str:
        return "compat_" + self.flags[0].lstrip("-").replace("-", "_")


def _parse_table(table: str) -> tuple[CompatFlag, ...]:
    entries = []
    for line in table.strip().splitlines():
        flags, kind, policy, reason = (part.strip() for part in line.split("|"))
        name, _, allowed = policy.partition(":")
        entries.append(CompatFlag(tuple(flags.split(",")), kind, name, tuple(allowed.split(",")) if allowed else (),
                                  reason))  # fmt: skip
    return tuple(entries)


COMPAT_FLAGS = _parse_table(TABLE)


def is_allowed(entry: CompatFlag, value: object) -> bool:
    if not entry.allowed:
        return False
    values = value if isinstance(value, list) else [value]
    return all(str(item).strip().lower() in entry.allowed for item in values)


_BY_KEYWORD = {entry.flags[0].lstrip("-").replace("-", "_"): entry for entry in COMPAT_FLAGS}


def apply_policy(entry: CompatFlag, value: object, shown: str, log: logging.Logger = logger) -> None:
    """One given flag or keyword under its entry's policy: refused (ValueError naming `shown`, how the user wrote
    it), warned about, or logged as ignored on `log`; False, or a value the entry allows, passes a refusal."""
    if entry.policy == "refuse":
        if value is False or is_allowed(entry, value):
            return
        accepted = f" (accepted: {', '.join(entry.allowed)})" if entry.allowed else ""
        raise ValueError(f"{shown}: not supported by deltaserve: {entry.reason}{accepted}")
    if entry.policy == "warn" and value is not False and not is_allowed(entry, value):
        log.warning("accepting %s without honouring it: %s", shown, entry.reason)
    else:
        log.info("ignoring %s: %s", shown, entry.reason)


def check_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The offline LLM(...)'s vLLM engine keywords of the table, as the server takes the flags of those names
    (trust_remote_code=True for --trust-remote-code): refused with a ValueError naming the keyword, or logged, by the
    entry's policy; None (vLLM's default for most) or an empty dict / list counts as not given. Returns the other
    keywords, for EngineConfig (which refuses a name it does not know with a TypeError, as vLLM's EngineArgs)."""
    rest: dict[str, Any] = {}
    for name, value in kwargs.items():
        entry = _BY_KEYWORD.get(name)
        if entry is None:
            rest[name] = value
        elif not (value is None or (isinstance(value, dict | list | tuple) and not value)):
            apply_policy(entry, value, f"{name}={value!r}")
    return rest
