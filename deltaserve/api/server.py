"""The FastAPI app of `deltaserve serve`: vLLM's OpenAI-compatible routes around one engine.

build_app(engine, settings) wires the routes (the OpenAI ones, Anthropic's /v1/messages, vLLM's tokens-in
/inference/v1/generate and its render / derender routes, tokenize, SageMaker's /invocations), the error envelope
(FastAPI's own 404/405 included), the middleware (CORS only for --allowed-origins, the API key on every route but the
probes, X-Request-Id, vLLM's HTTP request metrics, the body-size limit), --root-path, and a lifespan that starts the
engine, the chat-template workers, the tokenizer threads and the periodic stats line (unless --disable-log-stats),
and stops them on shutdown. With VLLM_SERVER_DEV_MODE=1 it serves vLLM's cache routes POST /reset_prefix_cache,
/reset_mm_cache and /reset_encoder_cache, as vLLM does (only then). Nothing CPU-heavy runs on the event loop:
tokenisation and JSON parsing of large bodies run on threads, chat templates in worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from deltaserve.api import (
    serving_anthropic,
    serving_chat,
    serving_chat_batch,
    serving_completion,
    serving_derender,
    serving_generate,
    serving_render,
    serving_responses,
    serving_tokenize,
)
from deltaserve.api.body import read_json
from deltaserve.api.errors import APIError, install_error_handlers, model_not_found
from deltaserve.api.http_metrics import instrument_http
from deltaserve.api.metrics import ServerMetrics
from deltaserve.api.middleware import APIKeyMiddleware, BodySizeMiddleware, RequestIdMiddleware
from deltaserve.api.settings import EngineClient, ServerSettings, ServerState
from deltaserve.api.stat_logger import LoggingStatLogger
from deltaserve.api.template_pool import TemplatePool
from deltaserve.api.tokens import Tokens
from deltaserve.version import __version__

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
INVOCATION_TYPES = "['ChatCompletionRequest', 'CompletionRequest']"


def get_state(request: Request) -> ServerState:
    return request.app.state.deltaserve


def _check_alive(state: ServerState) -> None:
    if state.engine.is_dead:
        raise APIError("The engine is dead.", status=503, err_type="ServiceUnavailableError")


async def _announce_ready(app: FastAPI, state: ServerState) -> None:
    """Logs the ready line once uvicorn listens (cli.py hands the server over), else right away."""
    server = getattr(app.state, "uvicorn_server", None)
    while server is not None and not server.started:
        await asyncio.sleep(0.05)
    settings = state.settings
    logger.info(
        "deltaserve ready: serving %s as %r on %s%s (max_model_len %d)",
        settings.model_root, settings.model_name, _listen_address(server, settings), settings.root_path or "",
        state.engine.max_model_len,
    )  # fmt: skip


def _listen_address(server: Any, settings: ServerSettings) -> str:
    """Where the server listens, read from its socket as bound (0.0.0.0 when --host was not given, the port the
    system chose for --port 0, a Unix socket's path), as vLLM's "Starting vLLM API server on ..." line names it;
    the settings' host and port when no uvicorn server was handed over."""
    host, port = settings.host, settings.port
    sockets = [sock for listener in getattr(server, "servers", None) or [] for sock in listener.sockets or []]
    if sockets:
        name = sockets[0].getsockname()
        if isinstance(name, str):
            return f"unix:{name}"
        host, port = name[0], name[1]
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if settings.is_https else 'http'}://{shown}:{port}"


def model_cards(state: ServerState) -> dict[str, Any]:
    permission = {"id": f"modelperm-{state.created}", "object": "model_permission", "created": state.created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}  # fmt: skip
    cards = [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "deltaserve",
            "root": state.settings.model_root,
            "parent": None,
            "max_model_len": state.engine.max_model_len,
            "permission": [permission],
        }  # fmt: skip
        for name in state.settings.served_model_names
    ]
    return {"object": "list", "data": cards}


def _add_middleware(app: FastAPI, settings: ServerSettings, metrics: ServerMetrics) -> None:
    # Added innermost first: the body limit runs after the key check, the request id wraps both, CORS wraps all
    # (so preflights and 401s carry the CORS headers too).
    app.add_middleware(BodySizeMiddleware, max_body_bytes=settings.max_request_body_bytes)
    # vLLM's HTTP metrics, inside the key check, request id and CORS as vLLM has them; outside the body limit,
    # which vLLM has not: a body vLLM would take to its route is counted under that route here too (as a 413).
    instrument_http(app, metrics.registry)
    if settings.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=settings.api_keys)
    if settings.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    if settings.allowed_origins:
        if "*" in settings.allowed_origins:
            logger.warning("CORS allows every origin (--allowed-origins '[\"*\"]'): any web page can call this server")
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=settings.allowed_methods,
            allow_headers=settings.allowed_headers,
            allow_credentials=settings.allow_credentials,
        )


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(engine, settings.model_name, engine.max_model_len)
    tokens = Tokens(engine.tokenizer)
    templates = TemplatePool(
        num_workers=settings.num_template_workers,
        timeout=settings.template_timeout_s,
        memory_bytes=settings.template_memory_bytes,
    )
    state = ServerState(engine=engine, settings=settings, metrics=metrics, tokens=tokens, templates=templates)
    stat_logger = LoggingStatLogger(engine, metrics, settings.log_stats_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.gather(templates.start(), tokens.warm_up())
        await engine.start()
        # As vLLM does (freeze_gc_heap): the startup heap (model, tokenizer, modules), its garbage collected first, is
        # left out of every later collection pass
        for generation in range(3):
            gc.collect(generation)
        gc.freeze()
        announce = asyncio.create_task(_announce_ready(app, state))
        log_stats = None if settings.disable_log_stats else asyncio.create_task(stat_logger.run())
        try:
            yield
        finally:
            announce.cancel()
            if log_stats is not None:
                log_stats.cancel()
            await engine.stop()
            await templates.stop()
            tokens.close()

    docs: dict[str, Any] = {}
    if settings.disable_fastapi_docs:
        docs = {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="deltaserve", version=__version__, lifespan=lifespan, **docs)
    # As vLLM sets it: the prefix is reported to routing whether or not the proxy stripped it from the path.
    app.root_path = settings.root_path or ""
    app.state.deltaserve = state
    install_error_handlers(app)
    _add_middleware(app, settings, metrics)

    def probe() -> Response:
        # vLLM's 503 for a dead engine; a hung one (no heartbeat from the core) fails the same way
        return Response(status_code=503 if engine.is_dead or engine.is_hung else 200)

    @app.get("/health")
    async def health() -> Response:
        return probe()

    @app.get("/ping")
    async def ping() -> Response:
        return probe()

    @app.post("/ping")
    async def ping_post() -> Response:
        return probe()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": state.num_inflight}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_cards(state))

    # The openai client's models.retrieve; `:path` so that a Hugging Face style name with a slash matches.
    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        for card in model_cards(state)["data"]:
            if card["id"] == model_id:
                return JSONResponse(card)
        raise model_not_found(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await serving_tokenize.tokenize(state, request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await serving_tokenize.detokenize(state, request)

    if settings.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            return JSONResponse(serving_tokenize.tokenizer_info(state))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_alive(state)
        return await serving_completion.create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_alive(state)
        return await serving_chat.create_chat_completion(state, request)

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(request: Request) -> Response:
        _check_alive(state)
        return await serving_chat_batch.create_batch_chat_completion(state, request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        _check_alive(state)
        return await serving_responses.create_response(state, request)

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request) -> Response:
        _check_alive(state)
        return await serving_anthropic.create_messages(state, request)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request) -> Response:
        return await serving_anthropic.count_tokens(state, request)

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(request: Request) -> Response:
        return await serving_render.render_chat(state, request)

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> Response:
        return await serving_render.render_completion(state, request)

    @app.post("/v1/chat/completions/derender")
    async def derender_chat_completion(request: Request) -> Response:
        return await serving_derender.derender_chat(state, request)

    @app.post("/v1/completions/derender")
    async def derender_completion(request: Request) -> Response:
        return await serving_derender.derender_completion(state, request)

    @app.post("/inference/v1/generate")
    async def generate_tokens(request: Request) -> Response:
        _check_alive(state)
        return await serving_generate.generate(state, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        raise serving_responses.response_not_found(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        raise serving_responses.response_not_found(response_id)

    if settings.server_dev_mode:
        logger.warning("SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!")

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(
            reset_running_requests: bool = Query(default=False), reset_external: bool = Query(default=False)
        ) -> Response:
            """vLLM 0.26's dev route: 200 with {"success": bool}, false when entries were kept (callers may retry).
            Blocks and checkpoints that running requests hold stay: reset_running_requests does not preempt them
            here; reset_external has no external cache to reset."""
            logger.info("Resetting prefix cache...")
            _check_alive(state)
            if reset_running_requests:
                logger.warning("reset_running_requests=true is not honoured: running requests keep what they hold")
            success = await engine.reset_prefix_cache()
            if not success:
                logger.warning("the prefix cache kept the entries that running requests hold")
            stat_logger.reset_prefix_hit_rate()
            return JSONResponse({"success": bool(success)})

        @app.post("/reset_mm_cache")
        async def reset_mm_cache() -> Response:
            """vLLM's dev route: nothing to drop (each image and video is processed with its request)."""
            logger.info("Resetting multi-modal cache...")
            return Response(status_code=200)

        @app.post("/reset_encoder_cache")
        async def reset_encoder_cache() -> Response:
            """vLLM's dev route: nothing to drop (no encoder outputs are kept between requests)."""
            logger.info("Resetting encoder cache...")
            return Response(status_code=200)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's entry point: the body's shape picks chat (messages) or completions (prompt)."""
        _check_alive(state)
        body = await read_json(state, request)
        if "messages" in body[0]:
            return await serving_chat.create_chat_completion(state, request, body)
        if "prompt" in body[0]:
            return await serving_completion.create_completion(state, request, body)
        raise APIError(f"Cannot find suitable handler for request. Expected one of: {INVOCATION_TYPES}")

    return app
