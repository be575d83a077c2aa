"""`deltaserve serve [MODEL]`: vLLM's serve flags -> EngineConfig + ServerSettings -> AsyncEngine -> uvicorn.

With no MODEL it serves the built-in tiny checkpoint on the CPU, so the server can be tried on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
from typing import Any

from deltaserve import env
from deltaserve.api.compat import add_compat_arguments, check_compat
from deltaserve.api.settings import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerSettings
from deltaserve.engine_config import EngineConfig

logger = logging.getLogger("deltaserve.serve")

BUILTIN_MODEL_NAME = "deltaserve-tiny"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def human_int(value: str) -> int | None:
    """vLLM's human-readable ints: 32768, 32k (x1000), 32K (x1024), 1m / 1M; -1 or auto: the model's own."""
    if value.strip().lower() in ("-1", "auto"):
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}")
    number, suffix = float(match.group(1)), match.group(2)
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    return int(number * scale)


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "model",
        nargs="?",
        default=None,
        help="checkpoint folder; omit it to serve the built-in tiny checkpoint on the CPU",
    )
    add("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)  # vLLM's deprecated spelling
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for every interface)")
    add("--port", type=int, default=8000)
    add(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the API accepts in `model` (default: MODEL as given); the first is reported",
    )
    add("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* routes")
    add("--tokenizer", default=None, help="tokenizer folder or id (default: MODEL)")
    add("--max-model-len", type=human_int, default=None, help="context length, e.g. 32768 or 32k (default: model)")
    add(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences in one batch (default: vLLM's, 1024 on an H200, capped by the GDN state memory)",
    )
    add("--max-num-batched-tokens", type=human_int, default=None, help="token budget of one engine step")
    add("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory for weights + caches")
    add("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "half", "float32", "float"))
    add(
        "--load-format",
        default="auto",
        choices=("auto", "safetensors", "dummy"),
        help="dummy: seeded random weights of the right shapes",
    )
    add("--block-size", type=int, default=16, help="tokens per KV-cache block")
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
        help="mp (the default and the only backend: worker processes, or ranks started by torchrun)",
    )
    add(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE: split the experts whole across the tensor-parallel ranks instead of each expert's width",
    )
    add("--seed", type=int, default=0)
    add("--enforce-eager", action="store_true", help="no CUDA graphs")
    add(
        "--ignore-unexpected-tensors",
        action="store_true",
        help="deltaserve only: load a checkpoint whose tensors include ones no parameter or skip rule explains "
        "(they are listed in the log); without it such a checkpoint is refused",
    )
    add(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan the next engine step while the current one runs (default on, as in vLLM)",
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
        action="store_true",
        help="serve a multimodal checkpoint as text only: no vision tower is built or loaded (as vLLM's flag)",
    )
    add("--chat-template", default=None, help="chat template: a file path or inline Jinja")
    add(
        "--default-chat-template-kwargs",
        type=json_object,
        default=None,
        help="template kwargs for every chat request, e.g. '{\"enable_thinking\": false}'",
    )
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
        help="parse Qwen3.5 XML tool calls into tool_calls (qwen3_xml is an alias of qwen3_coder)",
    )
    add("--enable-auto-tool-choice", action="store_true", help='allow tool_choice "auto" (needs --tool-call-parser)')
    add("--allowed-origins", type=json_list, default=["*"], help='CORS origins as a JSON list (default ["*"])')
    add("--allowed-methods", type=json_list, default=["*"], help="CORS methods as a JSON list")
    add("--allowed-headers", type=json_list, default=["*"], help="CORS headers as a JSON list")
    add("--allow-credentials", action="store_true", help="CORS: allow credentials")
    add("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    add("--disable-uvicorn-access-log", action="store_true")
    add_compat_arguments(parser)


def read_chat_template(value: str | None) -> str | None:
    """A path is read; text with Jinja syntax is the template itself; anything else is a missing file."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            return handle.read()
    if any(marker in value for marker in ("{{", "{%", "\n")):
        return value
    raise ValueError(f"--chat-template: no such file {value!r}")


def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(model, device): MODEL as given, or the built-in tiny checkpoint on the CPU."""
    model = args.model or args.model_flag
    if model is not None:
        return model, args.device or "auto"
    from deltaserve.tiny import default_model_dir

    return str(default_model_dir()), args.device or "cpu"


def build_engine_config(args: argparse.Namespace, model: str, device: str) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype=args.dtype,
        device=device,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        language_model_only=args.language_model_only,
        ignore_unexpected_tensors=args.ignore_unexpected_tensors,
        generation_config=args.generation_config,
        tokenizer=args.tokenizer,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        enable_expert_parallel=args.enable_expert_parallel,
    )


def default_served_names(args: argparse.Namespace, model: str) -> list[str]:
    """MODEL as given (vLLM's default); the built-in tiny checkpoint answers to `deltaserve-tiny` (and its path)."""
    if args.model or args.model_flag:
        return [model]
    return [BUILTIN_MODEL_NAME, model]


def build_settings(args: argparse.Namespace, model: str) -> ServerSettings:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return ServerSettings(
        model_root=model,
        served_model_names=args.served_model_name or default_served_names(args, model),
        api_key=args.api_key,
        chat_template=read_chat_template(args.chat_template),
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        host=args.host,
        port=args.port,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=env.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_compat(args)
        model, device = resolve_model(args)
        config = build_engine_config(args, model, device)
        settings = build_settings(args, model)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    from deltaserve.model.preflight import preflight, report_startup_error
    from deltaserve.runner.distributed import is_external_worker

    if is_external_worker(config.tensor_parallel_size):
        # a rank > 0 that torchrun started: no HTTP server, only rank 0's plans
        from deltaserve.runner.worker import run_external_worker

        return run_external_worker(config)

    # A bad checkpoint or start-up setting is one line naming the file and the field, exit 1; the traceback only
    # when debugging. The torch-free checks run first, so such errors come before the heavy imports.
    is_debug = env.log_level() == "DEBUG" or args.uvicorn_log_level in ("debug", "trace")
    is_debug = is_debug or str(getattr(args, "log_level", "") or "").lower() == "debug"
    try:
        preflight(config.model, config.tokenizer, config.generation_config, config.max_model_len, config.load_format)
        import uvicorn

        from deltaserve.api.server import build_app
        from deltaserve.engine.async_engine import AsyncEngine

        logger.info("loading %s (device %s, dtype %s)", model, device, args.dtype)
        engine = AsyncEngine.from_config(config)
    except Exception as exc:
        # start-up ends here whatever failed; only the form of the message differs
        return report_startup_error(exc, is_debug, logger)
    if args.override_generation_config:
        engine.default_sampling = {**engine.default_sampling, **args.override_generation_config}
    if engine.default_sampling:
        logger.info("sampling defaults from the generation config: %s", engine.default_sampling)
    app = build_app(engine, settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
        )
    )
    app.state.uvicorn_server = server  # the lifespan logs "ready" once the socket listens

    def stop_on_core_death() -> None:
        # called from the engine's output thread: uvicorn's main loop polls should_exit and shuts down gracefully
        server.should_exit = True

    engine.on_dead = stop_on_core_death
    # uvicorn re-raises Ctrl-C after its graceful shutdown, which has already happened by then.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if engine.is_dead:
        logger.error("deltaserve stopped: the engine core died")
        return 1
    logger.info("deltaserve stopped")
    return 0
