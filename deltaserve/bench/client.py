"""The load generator: streaming /v1/completions or /v1/chat/completions requests over aiohttp, timed as `vllm bench
serve` times them.

One request = one POST with `stream: true` and `stream_options.include_usage`; the start time is taken after
the concurrency semaphore is acquired (so client queueing is excluded, as in vLLM). The SSE stream is split
on blank lines; `:` comment lines are pings; `data: [DONE]` ends it. The first event whose `choices` is
non-empty sets TTFT (its text may be empty); every later choice-bearing event adds one ITL gap; the last one
sets E2EL. A usage-only event sets the output token count (and the cached prompt tokens, when the server sends
`usage.prompt_tokens_details.cached_tokens`).

Chat (the `openai-chat` backend, vLLM's async_request_openai_chat_completions): one user message whose content is
[{"type": "text", "text": PROMPT}, *the request's media parts], `max_completion_tokens` for the output length, the
text read from `choices[0].delta.content`; as in vLLM's chat function, every data event (a usage-only one too)
moves the "last event" time, so the E2EL of a chat request ends at its usage event. One departure, kept on purpose:
vLLM counts a chat response with HTTP 200 but no choice-bearing event as a success with TTFT 0; here it fails
("Never received a valid chunk"), as vLLM's completions function does, so no untimed request enters the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from deltaserve.bench._extra import require
from deltaserve.bench.dataset import SampleRequest
from deltaserve.bench.metrics import RequestResult
from deltaserve.bench.traffic import send_offsets

if TYPE_CHECKING:
    import aiohttp

REQUEST_TIMEOUT_S = 6 * 60 * 60
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class SamplingOptions:
    """The sampling fields merged into every request body (only the ones that are set)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    is_ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    def body_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.is_ignore_eos:
            fields["ignore_eos"] = True
        fields.update(self.extra_body)
        return fields


def completion_payload(model: str, prompt: str, max_tokens: int, sampling: SamplingOptions) -> dict[str, Any]:
    """The JSON body vLLM's completions request function sends."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": max_tokens,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payload.update(sampling.body_fields())
    return payload


def chat_payload(
    model: str, prompt: str, mm_content: tuple[dict[str, Any], ...], max_tokens: int, sampling: SamplingOptions
) -> dict[str, Any]:
    """The JSON body vLLM's chat request function sends: the text part first, the media parts after it."""
    content: list[dict[str, Any]] = [{"type": "text", "text": prompt}, *mm_content]
    payload: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_completion_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payload.update(sampling.body_fields())
    return payload


class SSEBuffer:
    """Reassembles SSE events from arbitrary byte chunks; yields each event's data payloads."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        payloads: list[str] = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            payloads.extend(self._data_lines(event))
        return payloads

    def flush(self) -> list[str]:
        """Whatever is left when the stream closes without a final blank line."""
        event, self._buffer = self._buffer, b""
        return self._data_lines(event)

    @staticmethod
    def _data_lines(event: bytes) -> list[str]:
        lines: list[str] = []
        for raw in event.decode("utf-8", errors="replace").split("\n"):
            line = raw.strip()
            if not line or line.startswith(":"):
                continue
            if line.startswith("data:"):
                lines.append(line[len("data:") :].strip())
        return lines


class TimedStream:
    """Applies vLLM's timing rules to the data payloads of one response, in arrival order."""

    def __init__(self, result: RequestResult, start: float, is_chat: bool = False) -> None:
        self.result = result
        self.start = start
        self.last = start
        self.is_chat = is_chat
        self.is_first_received = False
        self.texts: list[str] = []
        self.is_done = False

    def on_payload(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            self.is_done = True
            return
        data = json.loads(payload)
        if "error" in data and not data.get("choices"):
            error = data["error"]
            raise RuntimeError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        choices = data.get("choices")
        if choices:
            if not self.is_first_received:
                self.is_first_received = True
                self.result.ttft = now - self.start
            else:
                self.result.itl.append(now - self.last)
            self.last = now
            if self.is_chat:
                self.texts.append((choices[0].get("delta") or {}).get("content") or "")
            else:
                self.texts.append(choices[0].get("text") or "")
        usage = data.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                self.result.output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.result.prompt_len = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.result.cached_tokens = int(details["cached_tokens"])
        if self.is_chat:
            # vLLM's chat function: any data event, with choices or without, is the latest event
            self.last = now

    def finish(self) -> None:
        self.result.generated_text = "".join(self.texts)
        self.result.latency = self.last - self.start
        if self.is_first_received:
            self.result.is_success = True
        else:
            self.result.error = "Never received a valid chunk to calculate TTFT."


def _headers(request_id: str) -> dict[str, str]:
    headers = {"x-request-id": request_id}
    api_key = os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def send_request(
    session: aiohttp.ClientSession,
    api_url: str,
    payload: dict[str, Any],
    prompt_len: int,
    request_id: str,
    is_chat: bool = False,
) -> RequestResult:
    """POST one streaming completion and time it; never raises (failures are recorded in the result)."""
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    result.start_time = start
    stream = TimedStream(result, start, is_chat)
    try:
        async with session.post(api_url, json=payload, headers=_headers(request_id)) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                result.error = f"HTTP {response.status} {response.reason or ''}: {body}"
                return result
            sse = SSEBuffer()
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                for data in sse.feed(chunk):
                    stream.on_payload(data, now)
            for data in sse.flush():
                stream.on_payload(data, time.perf_counter())
        stream.finish()
    except Exception:
        result.is_success = False
        result.error = "".join(traceback.format_exception(*sys.exc_info()))
    return result


@dataclass
class LoadOptions:
    """How requests are dispatched."""

    api_url: str
    model: str
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    # the prompts the warm-ups send (--warmup-distinct: drawn apart from the measured ones); empty: the first
    # measured request, as vLLM's client sends it
    warmup_requests: list[SampleRequest] = field(default_factory=list)
    seed: int = 0
    request_id_prefix: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:8]}-")
    is_tqdm_disabled: bool = False
    is_chat: bool = False  # the openai-chat backend: chat payloads on /v1/chat/completions
    # awaited once the warm-ups are done, before the measured requests (the server's counters are read there)
    after_warmups: Callable[[], Awaitable[None]] | None = None

    def payload(self, request: SampleRequest, sampling: SamplingOptions) -> dict[str, Any]:
        """The request body for `request` on this endpoint."""
        if self.is_chat:
            return chat_payload(self.model, request.prompt, request.mm_content, request.expected_output_len, sampling)
        if request.mm_content:
            raise ValueError("media content parts need the openai-chat backend (/v1/chat/completions)")
        return completion_payload(self.model, request.prompt, request.expected_output_len, sampling)


def client_session(load: LoadOptions) -> Any:
    """The aiohttp session a load runs in: at most --max-concurrency connections (0: unbounded), kept alive."""
    aiohttp = require("aiohttp")
    limit = load.max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    # Proxy variables apply to remote servers only: a local server under test is never reached through one.
    trust_env = urlsplit(load.api_url).hostname not in LOOPBACK_HOSTS
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=trust_env)


async def run_load(
    requests: list[SampleRequest],
    sampling: SamplingOptions,
    load: LoadOptions,
) -> tuple[list[RequestResult], float]:
    """Warm up, then send every request and wait for all; returns (results in request order, duration in s).

    The duration runs from just before the dispatch loop until the last response has finished.
    """
    from tqdm import tqdm

    async with client_session(load) as session:
        semaphore = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

        async def limited(payload: dict[str, Any], prompt_len: int, request_id: str, bar: Any) -> RequestResult:
            async with semaphore if semaphore is not None else contextlib.nullcontext():
                result = await send_request(session, load.api_url, payload, prompt_len, request_id, load.is_chat)
            if bar is not None:
                bar.update(1)
            return result

        if load.num_warmups > 0 and requests:
            pool = load.warmup_requests or requests[:1]
            chosen = [pool[i % len(pool)] for i in range(load.num_warmups)]
            warmups = [
                limited(load.payload(w, sampling), w.prompt_len, f"{load.request_id_prefix}warmup-{i}", None)
                for i, w in enumerate(chosen)
            ]
            warm_results = await asyncio.gather(*warmups)
            num_failed = sum(1 for r in warm_results if not r.is_success)
            if num_failed:
                print(
                    f"warning: {num_failed} of {load.num_warmups} warm-up requests failed: "
                    f"{warm_results[0].error.strip()[-300:]}",
                    file=sys.stderr,
                )

        if load.after_warmups is not None:
            await load.after_warmups()
        offsets = send_offsets(len(requests), load.request_rate, load.burstiness, np.random.default_rng(load.seed))
        bar = None if load.is_tqdm_disabled else tqdm(total=len(requests), desc="requests", file=sys.stderr)
        tasks: list[asyncio.Task[RequestResult]] = []
        t_start = time.perf_counter()
        for request, offset in zip(requests, offsets, strict=True):
            delay = offset - (time.perf_counter() - t_start)
            if offset > 0 and delay > 0:
                await asyncio.sleep(delay)
            payload = load.payload(request, sampling)
            request_id = load.request_id_prefix + request.request_id
            tasks.append(asyncio.create_task(limited(payload, request.prompt_len, request_id, bar)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
        if bar is not None:
            bar.close()
    return list(results), duration
