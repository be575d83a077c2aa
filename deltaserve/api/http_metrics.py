"""vLLM 0.26's HTTP request metrics: prometheus-fastapi-instrumentator's default families on the app's /metrics.

vLLM's API server instruments its FastAPI app with prometheus-fastapi-instrumentator (vllm/entrypoints/serve/
instrumentator/metrics.py) and the library's default instrumentation: http_requests_total (method, status, handler),
http_request_size_bytes and http_response_size_bytes (handler; summaries of the Content-Length headers),
http_request_duration_highr_seconds (no labels, many buckets) and http_request_duration_seconds (handler, method).
instrument_http(app, registry) attaches the same library with vLLM's configuration: the library's defaults
(status codes grouped as 2xx / 4xx / ..., requests that match no route counted under handler "none", latency with
the streamed body included, no in-progress gauge), vLLM's excluded handlers, and the registry that /metrics renders.
vLLM hands the library its /metrics registry; deltaserve's is ServerMetrics.registry, so the families land in the one
exposition deltaserve already serves and no second /metrics route is added (vLLM's expose() route is its /metrics).
vLLM also swaps the library's route walk for one that skips routes without a path (FastAPI's lazily included
routers); deltaserve declares every route on the app itself, so the library's own walk names the same handlers.
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator

# vLLM's list, word for word. The library compiles each to a regex and searches the handler (the route template, or
# the raw path of a request no route matches), so "/load" also drops e.g. an unknown "/v1/load_lora_adapter" and
# "/server_info" (a dev-mode route in vLLM, absent here) still drops a stray request to that path, as in vLLM.
EXCLUDED_HANDLERS = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")


def instrument_http(app: FastAPI, registry: CollectorRegistry) -> None:
    """Adds the library's middleware to `app`, recording into `registry`. The middleware lands inside every
    middleware added after this call: build_app calls it before the API key, request id and CORS middleware, which
    vLLM too adds after its instrumentator (a 401 or a CORS preflight answered there is not counted, as in vLLM)."""
    # Every other option is the library's default, as vLLM leaves them. vLLM's .add() passes no instrumentation, so
    # the middleware falls back to metrics.default(), which registers the five families on `registry`; .expose() is
    # left out because build_app's /metrics already renders `registry`.
    Instrumentator(excluded_handlers=list(EXCLUDED_HANDLERS), registry=registry).instrument(app)
