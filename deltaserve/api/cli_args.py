"""The `deltaserve serve` command line: every flag it defines, and vLLM's rules for reading a command line.

normalize_argv reads argv as vLLM's FlexibleArgumentParser does: `--max_model_len` is `--max-model-len` (underscores
before any '.'), `-O3` is `-O 3`, `--compilation-config.cudagraph_mode=X` sets one key of that JSON flag, and
`--config file.yaml` inserts the YAML's keys as flags (the command line wins). Boolean flags have vLLM's --X / --no-X
pair. The flags vLLM has and deltaserve does not implement are added from compat.py.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from deltaserve import env
from deltaserve.api.compat import add_compat_arguments
from deltaserve.api.settings import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_LOGPROBS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
)
from deltaserve.engine_config import GDN_PREFILL_BACKENDS, JIT_MONITOR_MODES, EngineConfig

# Seconds the server drains open requests after SIGTERM / Ctrl-C before it closes them (--timeout-graceful-shutdown).
DEFAULT_GRACEFUL_SHUTDOWN_S = 30.0
# Seconds a connection may take to send a whole request head (--timeout-request-header).
DEFAULT_HEADER_TIMEOUT_S = 20.0

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# vLLM's --prefix-caching-hash-algo values (its CacheConfig.prefix_caching_hash_algo); any other is refused
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_CHECKPOINT_INTERVAL = EngineConfig.__dataclass_fields__["prefix_cache_checkpoint_interval"].default
SWITCH = argparse.BooleanOptionalAction


# vLLM's human_readable_int suffixes: lowercase decimal, uppercase binary
BYTE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def readable_int(value: str, what: str) -> int:
    """vLLM's human_readable_int: plain digits; or a number and one suffix, lowercase k/m/g/t decimal (x10^3 ..
    x10^12, a fraction allowed: 1.5g) or uppercase K/M/G/T binary (x2^10 .. x2^40, whole numbers only: 4G). Other
    spellings (4GiB, 4 GB, 1.5G) are refused as vLLM refuses them; `what` names the value in the error."""
    text = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not {what}: {value!r} (digits, or a number with a suffix: k/m/g/t decimal, K/M/G/T binary)"
            ) from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * BYTE_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{value!r}: decimals are not allowed with binary suffixes like {suffix} (as in vLLM); did you mean "
            f"{number}{suffix.lower()}?"
        )
    return int(number) * BYTE_SUFFIXES[suffix]


def human_int(value: str) -> int | None:
    """vLLM's human_readable_int_or_auto (--max-model-len, --max-num-batched-tokens): 32768, 32k (x1000), 32K
    (x1024), 1m / 1M, ...; -1 or auto: the model's own."""
    if value.strip().lower() in ("-1", "auto"):
        return None
    number = readable_int(value, "an integer")
    if number < 0:
        raise argparse.ArgumentTypeError(f"not a count: {value!r} (-1 or auto: the model's own)")
    return number


def kv_cache_bytes(value: str) -> int | None:
    """--kv-cache-memory-bytes as vLLM 0.26 reads it (its human_readable_int behind optional_type): "" or "None" is
    no value, else readable_int; a negative count is refused here (vLLM refuses it only at start-up)."""
    if value in ("", "None"):
        return None
    count = readable_int(value, "a byte count")
    if count < 0:
        raise argparse.ArgumentTypeError(f"a byte count is at least 0 (0: not set), got {value!r}")
    return count


def optional_int(value: str) -> int | None:
    """vLLM's optional_type(int): "" or "None" is no value, else an integer."""
    if value in ("", "None"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None


def optional_value(value: str) -> str | None:
    """vLLM's reading of an optional flag's value: "" or "None" is no value."""
    return None if value in ("", "None") else value


def port_number(value: str) -> int:
    """A TCP port, 0-65535 (0: any free port), refused at parse time rather than by the bind after loading."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0-65535, got {port}")
    return port


def byte_count(value: str) -> int:
    number = human_int(value)
    if number is None or number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive size in bytes, got {value!r}")
    return number


def json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


def json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError("must be a JSON list of strings")
    return parsed


def config_file_args(path: str) -> list[str]:
    """vLLM's --config: a YAML mapping of flag names to values, as command-line arguments."""
    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config {path}: the config file must be YAML (.yaml or .yml)")
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: cannot read it: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: must hold a mapping of flag names to values")
    argv: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, list):
            argv += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def _dotted_to_json(argv: list[str]) -> list[str]:
    """vLLM's dotted flags: `--compilation-config.cudagraph_mode=PIECEWISE` sets one key of a JSON flag."""
    merged: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    at = 0
    while at < len(argv):
        arg = argv[at]
        name, sep, value = arg.partition("=")
        if arg.startswith("--") and "." in name:
            flag, _, key = name.partition(".")
            if not sep and at + 1 < len(argv):
                at += 1
                value = argv[at]
            try:
                parsed: Any = json.loads(value)
            except ValueError:
                parsed = value
            if flag not in merged:
                order.append(flag)
            merged.setdefault(flag, {})[key] = parsed
        else:
            order.append(arg)
        at += 1
    return [item for arg in order for item in ((arg, json.dumps(merged[arg])) if arg in merged else (arg,))]


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser rules: underscores in flag names (before any '.'), -O<level>, dotted keys of
    JSON flags, and --config FILE."""
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 >= len(argv):
            raise ValueError("--config needs a YAML file")
        head, tail = argv[:at], argv[at + 2 :]
        # The config's flags come first, so the command line overrides them (the positional model stays first).
        lead = head[:1] if head and not head[0].startswith("-") else []
        argv = lead + config_file_args(argv[at + 1]) + head[len(lead) :] + tail
    normalized = []
    for arg in argv:
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            flag, dot, key = name.partition(".")
            normalized.append(flag.replace("_", "-") + dot + key + sep + value)
        elif arg.startswith("-O") and len(arg) > 2:
            normalized += ["-O", arg[3:] if arg[2] == "=" else arg[2:]]
        else:
            normalized.append(arg)
    return _dotted_to_json(normalized)


def _add_engine_arguments(add: Any) -> None:
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
        choices=("auto", "safetensors", "fastsafetensors", "dummy"),
        help="dummy: seeded random weights of the right shapes (fastsafetensors reads as safetensors)",
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
        "--speculative-config",
        type=speculative_config,
        default=None,
        help='speculative decoding with the checkpoint\'s MTP layer, vLLM\'s JSON: {"method": "mtp", '
        '"num_speculative_tokens": k} (plus vLLM\'s rejection_sample_method / synthetic_acceptance_* keys)',
    )


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


def _add_chat_arguments(add: Any) -> None:
    add("--chat-template", default=None, help="chat template: a file path or inline Jinja")
    add(
        "--chat-template-content-format",
        default="auto",
        choices=("auto", "string", "openai"),
        help="message content as a string (auto, string) or as a list of {type, text} parts (openai)",
    )
    add(
        "--trust-request-chat-template",
        action=SWITCH,
        default=False,
        help="accept a chat_template sent with a request (refused by default, as in vLLM)",
    )
    add(
        "--default-chat-template-kwargs",
        type=json_object,
        default=None,
        help="template kwargs for every chat request, e.g. '{\"enable_thinking\": false}'",
    )
    add("--response-role", default="assistant", help="the role of generated messages (with add_generation_prompt)")
    add(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="put <think> text in message.reasoning / delta.reasoning",
    )
    add(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="qwen3_coder / qwen3_xml: Qwen3.5's XML tool calls; hermes: Qwen3-Next's JSON in <tool_call> tags",
    )
    add("--enable-auto-tool-choice", action=SWITCH, default=False, help='allow tool_choice "auto"')
    add(
        "--exclude-tools-when-tool-choice-none",
        action=SWITCH,
        default=False,
        help='leave the tools out of the prompt when tool_choice is "none"',
    )
    add("--return-tokens-as-token-ids", action=SWITCH, default=False, help="logprob tokens as 'token_id:N'")
    add(
        "--enable-prompt-tokens-details", action=SWITCH, default=False, help="usage.prompt_tokens_details.cached_tokens"
    )
    add("--enable-force-include-usage", action=SWITCH, default=False, help="usage on every streamed response")


def _add_http_arguments(add: Any) -> None:
    add("--host", default=None, help="address to bind (default: every interface, as vllm serve)")
    add("--port", type=port_number, default=8000)
    add("--uds", default=None, help="serve on this Unix domain socket instead of host:port")
    add(
        "--api-key",
        nargs="+",
        default=None,
        help="require `Authorization: Bearer KEY` (any of the keys) on every route but /health, /ping, /version "
        "and /metrics; default: the VLLM_API_KEY environment variable",
    )
    add("--root-path", default=None, help="the path prefix of a proxy in front of the server")
    add("--ssl-keyfile", default=None, help="serve HTTPS with this private key ...")
    add("--ssl-certfile", default=None, help="... and this certificate")
    add("--ssl-ca-certs", default=None, help="CA certificates for client certificates")
    add("--ssl-cert-reqs", type=int, default=0, help="client certificates: 0 none, 1 optional, 2 required")
    add("--ssl-ciphers", default=None, help="TLS 1.2 cipher suites")
    add("--allowed-origins", type=json_list, default=[], help='CORS origins as a JSON list (default none; ["*"]: any)')
    add("--allowed-methods", type=json_list, default=["*"], help="CORS methods as a JSON list")
    add("--allowed-headers", type=json_list, default=["*"], help="CORS headers as a JSON list")
    add("--allow-credentials", action=SWITCH, default=False, help="CORS: allow credentials")
    add("--enable-request-id-headers", action=SWITCH, default=False, help="X-Request-Id on every response")
    add("--enable-tokenizer-info-endpoint", action=SWITCH, default=False, help="serve GET /tokenizer_info")
    add("--disable-fastapi-docs", action=SWITCH, default=False, help="no /docs, /redoc or /openapi.json")
    add("--middleware", action="append", default=[], help="an ASGI middleware class or http function, by import path")
    add(
        "--max-request-body-bytes",
        type=byte_count,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"deltaserve only: larger request bodies get a 413 (default {DEFAULT_MAX_BODY_BYTES // 2**20}M)",
    )
    add(
        "--max-prompt-logprob-entries",
        type=int,
        default=DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
        help="deltaserve only: a completion whose n x prompt tokens x (prompt_logprobs + 1) (echo: + logprobs + 1) "
        f"exceeds this gets a 400 (default {DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES}); see docs/limits.md",
    )
    add("--h11-max-incomplete-event-size", type=int, default=None, help="largest incomplete HTTP event (bytes)")
    _add_timeout_arguments(add)
    add(
        "--disable-log-stats",
        action=SWITCH,
        default=False,
        help="no periodic stats line (throughputs, running / waiting, KV usage, prefix cache hit rate; every "
        "VLLM_LOG_STATS_INTERVAL seconds, default 10)",
    )
    add(
        "--jit-monitor-mode",
        default="warn",
        choices=JIT_MONITOR_MODES,
        help="a Triton kernel compiled after start-up (a shape the warm-up missed): logged once (warn) or the step "
        "that met it fails (error)",
    )
    add("--jit-monitor-verbose", action=SWITCH, default=False, help="log every compile after start-up, in full")
    add("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    add("--disable-uvicorn-access-log", action=SWITCH, default=False)
    add("--disable-access-log-for-endpoints", default=None, help='paths left out of the access log, e.g. "/health"')
    add("--log-config-file", default=None, help="a logging dictConfig JSON for deltaserve and uvicorn")


def shutdown_seconds(value: str) -> int:
    """vLLM's --shutdown-timeout: whole seconds, at least 0."""
    try:
        seconds = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole seconds, got {value!r}") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value!r}")
    return seconds


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value!r}")
    return seconds


def _add_timeout_arguments(add: Any) -> None:
    """deltaserve's bounds on slow clients and on shutdown (vLLM sets only uvicorn's keep-alive, by environment)."""
    add(
        "--timeout-keep-alive",
        type=positive_seconds,
        default=env.vllm_http_timeout_keep_alive(),
        help="seconds an idle keep-alive connection stays open (default: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, else 5)",
    )
    add(
        "--timeout-request-header",
        type=positive_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="deltaserve only: a connection that has not sent a whole request head in this many seconds is closed "
        f"(default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    add(
        "--timeout-request-body",
        type=positive_seconds,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="deltaserve only: a request body that stalls this many seconds between two reads gets a 408 "
        f"(default {DEFAULT_BODY_READ_TIMEOUT_S:g})",
    )
    add(
        "--timeout-graceful-shutdown",
        type=positive_seconds,
        default=DEFAULT_GRACEFUL_SHUTDOWN_S,
        help="deltaserve only: after SIGTERM or Ctrl-C, open requests may finish for this many seconds, then they "
        f"are closed and the server exits (default {DEFAULT_GRACEFUL_SHUTDOWN_S:g})",
    )
    add(
        "--shutdown-timeout",
        type=shutdown_seconds,
        default=None,
        metavar="SECONDS",
        help="vLLM's drain bound: after SIGTERM, in-flight requests may finish for this many seconds (0: closed at "
        "once, vLLM's default); given, it replaces --timeout-graceful-shutdown",
    )


def structured_outputs_config(value: str) -> str:
    """vLLM's --structured-outputs-config JSON, checked at parse time (an unsupported backend is refused by name)."""
    from deltaserve.engine.grammar import StructuredOutputsConfig

    try:
        StructuredOutputsConfig.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def speculative_config(value: str) -> str:
    """vLLM's --speculative-config JSON, checked at parse time (a method or key deltaserve refuses is named)."""
    from deltaserve.speculative_config import SpeculativeConfigError, parse_speculative_config

    try:
        parse_speculative_config(value)
    except SpeculativeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "model",
        nargs="?",
        default=None,
        help="checkpoint folder; omit it to serve the built-in tiny checkpoint on the CPU",
    )
    add("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)  # vLLM's deprecated spelling
    add(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the API accepts in `model` (default: MODEL as given); the first is reported",
    )
    _add_engine_arguments(add)
    _add_chat_arguments(add)
    _add_http_arguments(add)
    add_compat_arguments(parser)
