"""`deltaserve serve [MODEL]`: vLLM's serve flags -> EngineConfig + ServerSettings -> AsyncEngine -> uvicorn.

With no MODEL it serves the built-in tiny checkpoint on the CPU, so the server can be tried on any machine.
The command line is read as vLLM reads it (normalize_argv): `--max_model_len` is `--max-model-len`, `-O3` is
`-O 3`, and `--config file.yaml` inserts the YAML's keys as flags (the command line wins). Boolean flags have
vLLM's --X / --no-X pair. Flags vLLM has and deltaserve does not implement are in compat.py.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import logging
import logging.config
import os
import re
from typing import Any

from deltaserve import env
from deltaserve.api.compat import add_compat_arguments, check_compat
from deltaserve.api.settings import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_LOGPROBS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ServerSettings,
)
from deltaserve.engine_config import EngineConfig

logger = logging.getLogger("deltaserve.serve")

BUILTIN_MODEL_NAME = "deltaserve-tiny"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SWITCH = argparse.BooleanOptionalAction


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
    add("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    add("--max-num-batched-tokens", type=human_int, default=None, help="token budget of one engine step")
    add("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory for weights + caches")
    add("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "half", "float32", "float"))
    add(
        "--load-format",
        default="auto",
        choices=("auto", "safetensors", "fastsafetensors", "dummy"),
        help="dummy: seeded random weights of the right shapes (fastsafetensors reads as safetensors)",
    )
    add("--block-size", type=int, default=16, help="tokens per KV-cache block")
    add("--seed", type=int, default=0)
    add("--enforce-eager", action=SWITCH, default=False, help="no CUDA graphs")
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
        help="accepted as in vLLM; deltaserve never builds the vision tower, so it is always language-model-only",
    )
    add("--max-logprobs", type=int, default=MAX_LOGPROBS, help="most logprobs a request may ask for (vLLM: 20)")


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
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for every interface)")
    add("--port", type=int, default=8000)
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
    add("--h11-max-incomplete-event-size", type=int, default=None, help="largest incomplete HTTP event (bytes)")
    add("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    add("--disable-uvicorn-access-log", action=SWITCH, default=False)
    add("--disable-access-log-for-endpoints", default=None, help='paths left out of the access log, e.g. "/health"')
    add("--log-config-file", default=None, help="a logging dictConfig JSON for deltaserve and uvicorn")


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
    from deltaserve.tiny import builtin_model_exists, default_model_dir

    if not builtin_model_exists():
        logger.info("no MODEL given: generating the built-in tiny checkpoint (first run only, a few seconds)")
    return str(default_model_dir(progress=logger.info)), args.device or "cpu"


def build_engine_config(args: argparse.Namespace, model: str, device: str) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype=args.dtype,
        device=device,
        # fastsafetensors is a faster reader of the same files.
        load_format="safetensors" if args.load_format == "fastsafetensors" else args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        generation_config=args.generation_config,
        tokenizer=args.tokenizer,
    )


def default_served_names(args: argparse.Namespace, model: str) -> list[str]:
    """MODEL as given (vLLM's default); the built-in tiny checkpoint answers to `deltaserve-tiny` (and its path)."""
    if args.model or args.model_flag:
        return [model]
    return [BUILTIN_MODEL_NAME, model]


def api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key wins over VLLM_API_KEY, as in vLLM; empty keys are no keys."""
    return [key for key in (args.api_key or [env.vllm_api_key()]) if key]


def check_server_flags(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs), ("--log-config-file", args.log_config_file)):  # fmt: skip
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file {path!r}")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    if args.max_logprobs < 0:
        raise ValueError(f"--max-logprobs must be at least 0, got {args.max_logprobs}")
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    for path in args.middleware:
        resolve_middleware(path)


def build_settings(args: argparse.Namespace, model: str) -> ServerSettings:
    check_server_flags(args)
    return ServerSettings(
        model_root=model,
        served_model_names=args.served_model_name or default_served_names(args, model),
        api_keys=api_keys(args),
        chat_template=read_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        trust_request_chat_template=args.trust_request_chat_template,
        response_role=args.response_role,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_request_id_headers=args.enable_request_id_headers,
        disable_fastapi_docs=args.disable_fastapi_docs,
        root_path=args.root_path,
        max_request_body_bytes=args.max_request_body_bytes,
        max_logprobs=args.max_logprobs,
        host=args.host,
        port=args.port,
        is_https=bool(args.ssl_certfile),
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
    )


def resolve_middleware(path: str) -> Any:
    """vLLM's --middleware: `package.module.Name`, a class (ASGI middleware) or an `async def (request, call_next)`."""
    module_name, _, name = path.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"--middleware {path}: cannot import it: {exc}") from None
    if not (inspect.isclass(target) or inspect.iscoroutinefunction(target)):
        raise ValueError(f"--middleware {path}: must be a class or an async function")
    return target


def add_user_middleware(app: Any, paths: list[str]) -> None:
    for path in paths:
        target = resolve_middleware(path)
        if inspect.isclass(target):
            app.add_middleware(target)
        else:
            app.middleware("http")(target)


class AccessLogFilter(logging.Filter):
    """--disable-access-log-for-endpoints: drops uvicorn access lines for these paths (query strings ignored)."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            return str(args[2]).split("?", 1)[0] not in self.paths
        return True


def uvicorn_config_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config keyword arguments from the serve flags (TLS, socket, logging, h11 limits)."""
    options: dict[str, Any] = {
        "log_level": args.uvicorn_log_level,
        "access_log": not args.disable_uvicorn_access_log,
    }
    if args.uds:
        options["uds"] = args.uds
    else:
        options.update(host=args.host, port=args.port)
    if args.ssl_certfile:
        options.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                       ssl_cert_reqs=args.ssl_cert_reqs)  # fmt: skip
        if args.ssl_ciphers:
            options["ssl_ciphers"] = args.ssl_ciphers
    if args.h11_max_incomplete_event_size:
        options["h11_max_incomplete_event_size"] = args.h11_max_incomplete_event_size
    if args.log_config_file:
        with open(args.log_config_file, encoding="utf-8") as handle:
            options["log_config"] = json.load(handle)
    return options


def configure_access_log(args: argparse.Namespace) -> None:
    if args.disable_access_log_for_endpoints:
        paths = [path.strip() for path in args.disable_access_log_for_endpoints.split(",") if path.strip()]
        logging.getLogger("uvicorn.access").addFilter(AccessLogFilter(paths))


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
    import uvicorn

    from deltaserve.api.server import build_app
    from deltaserve.engine.async_engine import AsyncEngine

    logger.info("loading %s (device %s, dtype %s)", model, device, args.dtype)
    engine = AsyncEngine.from_config(config)
    if args.override_generation_config:
        engine.default_sampling = {**engine.default_sampling, **args.override_generation_config}
    if engine.default_sampling:
        logger.info("sampling defaults from the generation config: %s", engine.default_sampling)
    app = build_app(engine, settings)
    add_user_middleware(app, args.middleware)
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_config_options(args)))
    configure_access_log(args)
    app.state.uvicorn_server = server  # the lifespan logs "ready" once the socket listens
    # uvicorn re-raises Ctrl-C after its graceful shutdown, which has already happened by then.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    logger.info("deltaserve stopped")
    return 0
