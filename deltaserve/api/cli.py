"""`deltaserve serve [MODEL]`: vLLM's serve flags -> EngineConfig + ServerSettings -> AsyncEngine -> uvicorn.

With no MODEL it serves the built-in tiny checkpoint on the CPU (deltaserve/default_model.py), so the server can be
tried on any machine. The flags are in cli_args.py (the engine's in cli_engine_args.py, their value types in
cli_values.py) and vLLM's way of reading a command line in cli_normalize.py (add_arguments and normalize_argv are this
command's entry points for deltaserve/cli.py); the vLLM flags deltaserve accepts without implementing, or refuses,
are in compat.py.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
import socket
from typing import Any

from deltaserve import default_model, env
from deltaserve.api.cli_args import add_arguments
from deltaserve.api.cli_normalize import normalize_argv
from deltaserve.api.cli_values import human_int, json_list, json_object, merge_spec_aliases
from deltaserve.api.compat import check_compat
from deltaserve.api.fingerprint import system_fingerprint
from deltaserve.api.http_protocol import protocol_with_header_timeout
from deltaserve.api.settings import ServerSettings
from deltaserve.api.shutdown import install_shutdown_log_filter, stop_on_engine_death
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import ALL_LOGPROBS

logger = logging.getLogger("deltaserve.serve")
SAFETENSORS_READERS = ("fastsafetensors", "instanttensor")
ALL_INTERFACES = "0.0.0.0"  # --host's default, as vllm serve's (None: every interface)

# The command's entry points and helpers that tests reach through this module.
__all__ = ["add_arguments", "human_int", "json_list", "json_object", "normalize_argv", "run"]


def read_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a file that opens is read; text holding a brace or a newline is the template itself; anything
    else is a path that failed, refused in vLLM's words (deltaserve ships no named templates to fall back on)."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        if any(char in value for char in "{}\n"):
            return value
        raise ValueError(
            f"The supplied chat template ({value}) looks like a file path, but it failed to be opened. Reason: {exc}"
        ) from None


def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(model, device): MODEL as given, or the built-in tiny checkpoint on the CPU."""
    model = args.model or args.model_flag
    if model is not None:
        return model, args.device or "auto"
    folder = default_model.model_dir()
    logger.info("no MODEL given: serving the built-in tiny checkpoint %s as %r", folder, default_model.SERVED_NAME)
    return str(folder), args.device or "cpu"


def build_engine_config(args: argparse.Namespace, model: str, device: str) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype=args.dtype,
        device=device,
        # fastsafetensors and instanttensor are faster readers of the same files (vllm/config/load.py; vLLM loads both
        # with its DefaultModelLoader, vllm/model_executor/model_loader/__init__.py)
        load_format="safetensors" if args.load_format in SAFETENSORS_READERS else args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        lone_prefill_tokens=args.lone_prefill_tokens,
        one_pool=args.one_pool,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        scheduling_policy=args.scheduling_policy,
        language_model_only=args.language_model_only,
        ignore_unexpected_tensors=args.ignore_unexpected_tensors,
        allowed_local_media_path=args.allowed_local_media_path,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        mm_processor_kwargs=args.mm_processor_kwargs,
        generation_config=args.generation_config,
        tokenizer=args.tokenizer,
        structured_outputs_config=args.structured_outputs_config,
        reasoning_parser=args.reasoning_parser,
        reasoning_config=args.reasoning_config,
        speculative_config=merge_spec_aliases(
            args.speculative_config, args.spec_method, args.spec_model, args.spec_tokens
        ),  # fmt: skip
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        enable_expert_parallel=args.enable_expert_parallel,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_checkpoint_interval=args.prefix_cache_checkpoint_interval,
        num_checkpoint_slots=args.num_checkpoint_slots,
        quantization=args.quantization,
        gdn_prefill_backend=args.gdn_prefill_backend,
        attention_backend=attention_backend_of(args.attention_backend, args.attention_config),
        jit_monitor_mode=args.jit_monitor_mode,
        jit_monitor_verbose=args.jit_monitor_verbose,
        stream_interval=args.stream_interval,
    )


def attention_backend_of(backend: str | None, attention_config: dict[str, Any] | None) -> str | None:
    """--attention-backend, or --attention-config's "backend" (vLLM 0.26 reads the flag into that field and refuses
    both at once); the config's other keys are logged: deltaserve picks its own attention kernels."""
    if not attention_config:
        return backend
    others = sorted(key for key in attention_config if key != "backend")
    if others:
        logger.info("--attention-config %s: accepted and logged (deltaserve picks its own attention kernels)", others)
    from_config = attention_config.get("backend")
    if from_config is None:
        return backend
    if backend is not None:
        raise ValueError("attention_backend and attention_config.backend are mutually exclusive")
    return from_config


def default_served_names(args: argparse.Namespace, model: str) -> list[str]:
    """MODEL as given (vLLM's default); the built-in tiny checkpoint answers to `deltaserve-tiny` (and its path)."""
    if args.model or args.model_flag:
        return [model]
    return [default_model.SERVED_NAME, model]


def api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key wins over VLLM_API_KEY, as in vLLM; empty keys are no keys."""
    return [key for key in (args.api_key or [env.vllm_api_key()]) if key]


def check_server_flags(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.compat_enable_log_outputs and not args.enable_log_requests:  # vLLM's check and words
        raise ValueError("--enable-log-outputs requires --enable-log-requests")
    if args.enable_per_request_metrics and args.disable_log_stats:  # vLLM's check and words
        raise ValueError(
            "--enable-per-request-metrics requires engine statistics logging; remove --disable-log-stats to enable "
            "per-request metrics."
        )
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs), ("--log-config-file", args.log_config_file)):  # fmt: skip
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file {path!r}")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    if args.max_logprobs < ALL_LOGPROBS:  # vLLM's ModelConfig.max_logprobs is ge=-1
        raise ValueError(f"--max-logprobs must be -1 (no cap: the vocabulary) or more, got {args.max_logprobs}")
    if args.max_prompt_logprob_entries < 1:
        raise ValueError(f"--max-prompt-logprob-entries must be positive, got {args.max_prompt_logprob_entries}")
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    for path in args.middleware:
        resolve_middleware(path)


def bind_host(args: argparse.Namespace) -> str:
    """The address to bind: --host, or every IPv4 interface when it is not given (vllm serve binds ("", port))."""
    return args.host or ALL_INTERFACES


def check_listen_address(args: argparse.Namespace) -> None:
    """Binds --host:--port once and lets go, as uvicorn will bind it, so that a bad host or a taken port is one
    error before the model loads instead of tracebacks after it (a socket taken in between still fails later)."""
    if args.uds:
        return
    host = bind_host(args)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, args.port))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ValueError(f"--host {host} --port {args.port}: cannot listen there: {reason}") from None


def build_settings(args: argparse.Namespace, model: str, config: EngineConfig | None = None) -> ServerSettings:
    """The server's settings from its flags; config: the engine's, which the system_fingerprint hashes (None: the
    model's defaults)."""
    check_server_flags(args)
    fingerprint = system_fingerprint(config or EngineConfig(model=model), args.fingerprint_mode, args.fingerprint_value)
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
        disable_log_stats=args.disable_log_stats,
        log_stats_interval_s=env.vllm_log_stats_interval(),
        server_dev_mode=env.vllm_server_dev_mode(),
        enable_force_include_usage=args.enable_force_include_usage,
        enable_per_request_metrics=args.enable_per_request_metrics,
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        system_fingerprint=fingerprint,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_request_id_headers=args.enable_request_id_headers,
        disable_fastapi_docs=args.disable_fastapi_docs,
        root_path=args.root_path,
        max_request_body_bytes=args.max_request_body_bytes,
        body_read_timeout_s=args.timeout_request_body,
        max_logprobs=args.max_logprobs,
        max_prompt_logprob_entries=args.max_prompt_logprob_entries,
        scheduling_policy=args.scheduling_policy,
        host=bind_host(args),
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


def graceful_shutdown_s(args: argparse.Namespace) -> float:
    """How long in-flight requests may finish after SIGTERM / Ctrl-C: vLLM's --shutdown-timeout where given (0: they
    are closed at once, freeing their blocks and slots as a disconnect does), else --timeout-graceful-shutdown."""
    if args.shutdown_timeout is not None:
        return float(args.shutdown_timeout)
    return args.timeout_graceful_shutdown


def uvicorn_config_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config keyword arguments from the serve flags (TLS, socket, logging, h11 limits)."""
    options: dict[str, Any] = {
        "log_level": args.uvicorn_log_level,
        "access_log": not args.disable_uvicorn_access_log,
        # slow or stuck clients: h11 with a request-head bound, the keep-alive bound, the shutdown drain's bound
        "http": protocol_with_header_timeout(args.timeout_request_header),
        "timeout_keep_alive": args.timeout_keep_alive,
        "timeout_graceful_shutdown": graceful_shutdown_s(args),
    }
    if args.uds:
        options["uds"] = args.uds
    else:
        options.update(host=bind_host(args), port=args.port)
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
    args.host = bind_host(args)  # resolved once: every later reader of --host sees the address that is bound
    try:
        check_compat(args)
        for name in env.unread_vllm_variables():
            # names only: a variable's value may be a credential
            logger.info("ignoring the environment variable %s: deltaserve does not read it", name)
        if args.prefix_caching_hash_algo is not None:
            logger.info("ignoring --prefix-caching-hash-algo %s: the engine hashes blocks with its own 128-bit hash",
                        args.prefix_caching_hash_algo)  # fmt: skip
        model, device = resolve_model(args)
        config = build_engine_config(args, model, device)
        settings = build_settings(args, model, config)
        check_listen_address(args)
        if settings.enable_log_requests and env.log_level() != "DEBUG":
            # vLLM's note: the prompts themselves are logged only at DEBUG
            logger.info(
                "--enable-log-requests logs request ids and parameters; DELTASERVE_LOG_LEVEL=DEBUG adds prompts"
            )
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    from deltaserve.model.preflight import preflight, report_startup_error

    # Only a tensor-parallel start can be a rank > 0, and asking imports torch: a one-rank start asks nothing, so
    # its checkpoint errors below come before any heavy import (a second, not ten, on a busy 2-core machine).
    if config.tensor_parallel_size > 1:
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
        preflight(
            config.model,
            config.tokenizer,
            config.generation_config,
            config.max_model_len,
            config.load_format,
            config.quantization,
        )
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
    add_user_middleware(app, args.middleware)
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_config_options(args)))
    configure_access_log(args)
    app.state.uvicorn_server = server  # the lifespan logs "ready" once the socket listens

    install_shutdown_log_filter()
    # shutdown.py: the bounds of a shutdown, after a signal or the engine core's death
    engine.on_dead = functools.partial(stop_on_engine_death, server, graceful_shutdown_s(args))
    # uvicorn re-raises Ctrl-C after its graceful shutdown, which has already happened by then.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if engine.is_dead:
        # the death itself is the one ERROR line, logged where it was detected
        logger.info("deltaserve stopped (exit code 1): the engine core died")
        return 1
    logger.info("deltaserve stopped")
    return 0
