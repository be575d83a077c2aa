"""The `deltaserve serve` command line: add_arguments defines every flag, in the order `--help` lists them.

MODEL and --served-model-name come first, then the engine's flags (cli_engine_args.py), the chat flags, the HTTP
server's flags with its timeouts, and last the flags vLLM has and deltaserve does not implement (compat.py). Boolean
flags have vLLM's --X / --no-X pair. The flags' value types are in cli_values.py; vLLM's rules for reading a
command line (normalize_argv: underscores, -O3, dotted JSON keys, --config YAML) are in cli_normalize.py.
"""

from __future__ import annotations

import argparse
from typing import Any

from deltaserve import env
from deltaserve.api.cli_engine_args import add_engine_arguments
from deltaserve.api.cli_values import (
    SWITCH,
    byte_count,
    json_list,
    json_object,
    port_number,
    positive_seconds,
    shutdown_seconds,
)
from deltaserve.api.compat import add_compat_arguments
from deltaserve.api.fingerprint import FINGERPRINT_MODES
from deltaserve.api.settings import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
)
from deltaserve.engine_config import JIT_MONITOR_MODES

# Seconds the server drains open requests after SIGTERM / Ctrl-C before it closes them (--timeout-graceful-shutdown).
DEFAULT_GRACEFUL_SHUTDOWN_S = 30.0
# Seconds a connection may take to send a whole request head (--timeout-request-header).
DEFAULT_HEADER_TIMEOUT_S = 20.0

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
    add(
        "--enable-log-requests",
        action=SWITCH,
        default=False,
        help="log each request: its id and SamplingParams at INFO, its prompt and token ids at DEBUG "
        "(DELTASERVE_LOG_LEVEL)",
    )
    add("--max-log-len", type=int, default=None, help="prompt characters or token ids a logged request shows")
    add(
        "--enable-per-request-metrics",
        action=SWITCH,
        default=False,
        help="timing metrics (TTFT, queue time, ITL, ...) in each response's `metrics` (needs the engine's stats)",
    )
    add(
        "--fingerprint-mode",
        default="full",
        choices=FINGERPRINT_MODES,
        help="system_fingerprint: full (version, parallelism, config hash), hash, custom (--fingerprint-value), none",
    )
    add("--fingerprint-value", default=None, help="the system_fingerprint with --fingerprint-mode custom")


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
    add_engine_arguments(add)
    _add_chat_arguments(add)
    _add_http_arguments(add)
    add_compat_arguments(parser)
