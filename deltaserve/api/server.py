"""The FastAPI app of `deltaserve serve`: vLLM's OpenAI-compatible routes around one AsyncEngine.

build_app(engine, settings) wires the routes, the error envelope, CORS, the optional API key (for /v1/* routes, as
vLLM checks it) and a lifespan that starts the engine loop on the server's event loop and stops it on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

import deltaserve
from deltaserve.api import serving_chat, serving_completion, serving_tokenize
from deltaserve.api.errors import APIError, error_response, install_error_handlers, unauthorized
from deltaserve.api.metrics import ServerMetrics
from deltaserve.api.settings import EngineClient, ServerSettings, ServerState

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class APIKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware), so streaming and disconnect detection are untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            given = (Headers(scope=scope).get("authorization") or "").encode()
            if not secrets.compare_digest(given, self.expected):
                await error_response(unauthorized())(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
        "deltaserve ready: serving %s as %r on http://%s:%d (max_model_len %d)",
        settings.model_root, settings.model_name, settings.host, settings.port, state.engine.max_model_len,
    )  # fmt: skip


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


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(engine, settings.model_name, engine.max_model_len)
    state = ServerState(engine=engine, settings=settings, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        announce = asyncio.create_task(_announce_ready(app, state))
        try:
            yield
        finally:
            announce.cancel()
            await engine.stop()

    app = FastAPI(title="deltaserve", version=deltaserve.__version__, lifespan=lifespan)
    app.state.deltaserve = state
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    # Added last, so outermost: preflights and 401s carry the CORS headers too.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=settings.allowed_origins,
        allow_methods=settings.allowed_methods,
        allow_headers=settings.allowed_headers,
        allow_credentials=settings.allow_credentials,
    )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.is_dead else 200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=503 if engine.is_dead else 200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": deltaserve.__version__}

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": state.num_inflight}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_cards(state))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(await serving_tokenize.tokenize(state, request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await serving_tokenize.detokenize(state, request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_alive(state)
        return await serving_completion.create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_alive(state)
        return await serving_chat.create_chat_completion(state, request)

    return app
