"""Hostile and careless input on every route: each gets its status in vLLM's error envelope, and /health keeps
answering while the request is in flight (the server holds; nothing runs on its event loop).

The server is a real uvicorn over the FakeEngine in its own process (hostile_server.py), trusting request chat
templates (so hostile templates are rendered, and must hit their bounds), with a 4 MiB body limit and a 3 s
template bound. Each case is built and sent by a process of its own (hostile_sender) while the test thread probes
/health on its own connection: a sending thread of this process shares the GIL with the probes, and the 64 MB body's
send held them ~25 ms a probe that way (100-430 ms on a machine whose memory had become slow, which failed CI once),
against ~2 ms from a process of its own.

What is bounded is the time the server held a probe, not the probe's latency: the latency less the time the server's
threads and this process's threads spent runnable but waiting for a CPU meanwhile (the run-queue wait of Linux's
per-thread schedstat) must stay under HEALTH_BUDGET_S. A request that stalls the event loop (a blocking read or
sleep, or work run on the loop, or a thread holding the GIL) holds the probe for the stall's own length, which no
CPU wait accounts for, on an idle machine or a busy one; other work on the machine's cores lengthens a probe by such
waits only. test_a_stalled_loop_is_caught shows that the
check fails a body read that blocks the loop. A case holds if all its probes pass in one of ATTEMPTS runs: a request
that stalls the server stalls it every time. The logging checks at the end run against the same settings in a thread
of this process, to read its log.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaserve.api import body as api_body
from deltaserve.api.server import build_app
from tests.support.ports import free_port

from .fake_engine import FakeEngine
from .hostile_server import BODY_LIMIT, MODEL_NAME, hostile_settings
from .server_thread import ServerThread

HEALTH_BUDGET_S = 0.1
ATTEMPTS = 3
ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "hi"}]
ASSISTANT_LAST = [*USER, {"role": "assistant", "content": "Sure, "}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@dataclass
class Case:
    name: str
    path: str
    body: Any = None  # dict: JSON; bytes: raw; callable: a content iterator (chunked)
    status: int = 400
    param: str | None = None
    message: str | None = None  # a substring the error message must hold
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, **fields}


def template(source: str) -> dict[str, Any]:
    return chat(chat_template=source)


def chunked(total: int, size: int = 65536) -> Any:
    def body() -> Iterator[bytes]:
        sent = 0
        while sent < total:
            yield b" " * size
            sent += size

    return body


THOUSAND_IDS = list(range(100, 1100))  # distinct tokens, so every logprob entry has its own text
LONG_WORDS = "word " * 5000  # over the fake's 2048-token context
FAR_TOO_MANY_CHARS = "x" * 2_000_000  # over max_model_len * the longest token: refused before tokenising
MANY_MESSAGES = [{"role": "user", "content": "hello there"}] * 16000
TOO_MANY_MESSAGES = [{"role": "user", "content": "hello there"}] * 60000

CASES: list[Case] = [
    # -- the body itself (on /v1/completions) -----------------------------------------------------------------
    Case("broken json", "/v1/completions", b'{"prompt": "x",'),
    Case("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}'),
    Case("json array body", "/v1/completions", b"[1, 2]"),
    Case("json string body", "/v1/completions", b'"prompt"'),
    Case("empty body", "/v1/completions", b""),
    Case("NaN literal", "/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    Case("Infinity literal", "/v1/completions", b'{"prompt": "x", "top_p": Infinity}'),
    Case("nested arrays 100k deep", "/v1/completions", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
    Case("nested objects 100k deep", "/v1/completions", b'{"a": ' + b'{"a": ' * 100000 + b"1" + b"}" * 100001),
    Case(
        "more JSON elements than allowed",
        "/v1/completions",
        b'{"prompt": [' + b"0," * 1_100_000 + b"0]}",
        message="JSON elements",
    ),  # fmt: skip
    Case("body over the limit (content-length)", "/v1/completions", b" " * (BODY_LIMIT + 1), 413),
    Case("body over the limit (chunked)", "/v1/completions", chunked(BODY_LIMIT + 65536), 413),
    Case("64 MB body", "/v1/completions", b" " * (64 * 2**20), 413),
    Case(
        "text/plain content type",
        "/v1/completions",
        b'{"prompt": "x"}',
        headers={"content-type": "text/plain"},
        message="Only 'application/json' is allowed",
    ),  # fmt: skip
    Case(
        "form content type",
        "/v1/completions",
        b"prompt=x",
        headers={"content-type": "application/x-www-form-urlencoded"},
    ),  # fmt: skip
    Case("no content type", "/v1/completions", b'{"prompt": "x"}', headers={"content-type": ""}),
    # -- completion fields --------------------------------------------------------------------------------------
    Case("prompt an int", "/v1/completions", completion(prompt=5), param="body.prompt"),
    Case("prompt an object", "/v1/completions", completion(prompt={"a": 1}), param="body.prompt"),
    Case("prompt mixed list", "/v1/completions", completion(prompt=[1, "a"])),
    Case("prompt nested mixed", "/v1/completions", completion(prompt=[[1, "a"]])),
    Case("prompt missing", "/v1/completions", {"max_tokens": 3}, param="prompt"),
    Case("prompt null", "/v1/completions", completion(prompt=None), param="prompt"),
    Case("prompt empty string", "/v1/completions", completion(prompt=""), param="prompt"),
    Case("prompt empty list", "/v1/completions", completion(prompt=[]), param="prompt"),
    Case("prompt empty token list", "/v1/completions", completion(prompt=[[]]), param="prompt"),
    Case("token id out of vocab", "/v1/completions", completion(prompt=[10**9]), param="prompt"),
    Case("negative token id", "/v1/completions", completion(prompt=[-1]), param="prompt"),
    Case("token id beyond int64", "/v1/completions", completion(prompt=[2**70]), param="prompt"),
    Case(
        "1025 prompts",
        "/v1/completions",
        completion(prompt=["a"] * 1025),
        param="prompt",
        message="prompt list length 1025 exceeds the maximum allowed count of 1024.",
    ),  # vLLM's bound
    Case("1025 prompts of token ids", "/v1/completions", completion(prompt=[[1]] * 1025), param="prompt"),
    Case("a prompt of 1025 token ids", "/v1/completions", completion(prompt=[1] * 1025, max_tokens=1), status=200),
    Case("prompt over the context", "/v1/completions", completion(prompt=LONG_WORDS), param="prompt"),
    Case(
        "prompt far over the context",
        "/v1/completions",
        completion(prompt=FAR_TOO_MANY_CHARS),
        param="prompt",
        message="characters",
    ),  # fmt: skip
    Case("500k token ids", "/v1/completions", completion(prompt=[1] * 500_000), param="prompt"),
    Case("max_tokens negative", "/v1/completions", completion(max_tokens=-1), param="max_tokens"),
    Case("max_tokens zero", "/v1/completions", completion(max_tokens=0), param="max_tokens"),
    Case("max_tokens huge", "/v1/completions", completion(max_tokens=10**12), param="max_tokens"),
    Case("max_tokens a string", "/v1/completions", completion(max_tokens="abc"), param="body.max_tokens"),
    Case("max_tokens a float", "/v1/completions", completion(max_tokens=1.5), param="body.max_tokens"),
    Case("n zero", "/v1/completions", completion(n=0), param="n"),
    Case("n a million", "/v1/completions", completion(n=10**6), param="n"),
    Case("n a string", "/v1/completions", completion(n="many"), param="body.n"),
    Case("temperature negative", "/v1/completions", completion(temperature=-1), param="temperature"),
    Case("temperature a string", "/v1/completions", completion(temperature="hot"), param="body.temperature"),
    Case("top_p zero", "/v1/completions", completion(top_p=0), param="top_p"),
    Case("top_p above one", "/v1/completions", completion(top_p=2), param="top_p"),
    # vLLM raises these as plain ValueErrors: the 400 names no field
    Case("top_k below -1", "/v1/completions", completion(top_k=-5), message="top_k must be 0 (disable), or at least 1"),
    Case("min_p above one", "/v1/completions", completion(min_p=2), message="min_p must be in [0, 1]"),
    Case(
        "repetition_penalty zero",
        "/v1/completions",
        completion(repetition_penalty=0),
        message="repetition_penalty must be greater than zero",
    ),
    Case(
        "presence_penalty 5",
        "/v1/completions",
        completion(presence_penalty=5),
        message="presence_penalty must be in [-2, 2]",
    ),
    Case(
        "frequency_penalty -5",
        "/v1/completions",
        completion(frequency_penalty=-5),
        message="frequency_penalty must be in [-2, 2]",
    ),
    Case(
        "greedy n 3",
        "/v1/completions",
        completion(temperature=0, n=3),
        message="n must be 1 when using greedy sampling, got 3.",
    ),
    Case(
        "temperature 2.5",
        "/v1/completions",
        completion(temperature=2.5),
        param="temperature",
        message="temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",
    ),
    Case("seed beyond int64", "/v1/completions", completion(seed=2**70), param="body.seed"),
    Case("seed a string", "/v1/completions", completion(seed="x"), param="body.seed"),
    Case("logprobs 100", "/v1/completions", completion(logprobs=100), param="logprobs"),
    Case("logprobs negative", "/v1/completions", completion(logprobs=-1), param="logprobs"),
    Case("stop an int", "/v1/completions", completion(stop=5)),
    Case("stop empty string", "/v1/completions", completion(stop=[""]), message="stop cannot contain an empty string."),
    Case("100,000 stop strings with n=8", "/v1/completions", completion(stop=["x"] * 100_000, n=8), param="stop"),
    Case(
        "129 one-character stop strings",
        "/v1/completions",
        completion(stop=["z"] * 129),
        param="stop",
        message="at most 128",
    ),  # fmt: skip
    Case("stop string of 100k characters", "/v1/completions", completion(stop=["y" * 100_000]), param="stop"),
    Case("stop_token_ids out of vocab", "/v1/completions", completion(stop_token_ids=[10**9]), param="stop_token_ids"),
    Case("stop_token_ids negative", "/v1/completions", completion(stop_token_ids=[-3]), param="stop_token_ids"),
    Case(
        "min_tokens above max_tokens",
        "/v1/completions",
        completion(max_tokens=2, min_tokens=5),
        message="min_tokens must be less than or equal to max_tokens=2, got 5.",
    ),  # fmt: skip
    Case("truncate_prompt_tokens zero", "/v1/completions", completion(truncate_prompt_tokens=0)),
    Case("truncate_prompt_tokens -5", "/v1/completions", completion(truncate_prompt_tokens=-5)),
    Case(
        "truncate_prompt_tokens above context",
        "/v1/completions",
        completion(truncate_prompt_tokens=10**6),
        param="truncate_prompt_tokens",
    ),  # fmt: skip
    Case(
        "truncation_side middle", "/v1/completions", completion(truncation_side="middle"), param="body.truncation_side"
    ),  # fmt: skip
    Case("suffix", "/v1/completions", completion(suffix="y"), param="suffix"),
    Case("allowed_token_ids empty", "/v1/completions", completion(allowed_token_ids=[]), param="allowed_token_ids"),
    Case("logit_bias negative id", "/v1/completions", completion(logit_bias={"-1": 10}), param="logit_bias"),
    Case("logit_bias not an id", "/v1/completions", completion(logit_bias={"five": 10}), param="logit_bias"),
    Case("chat beam", "/v1/chat/completions", chat(use_beam_search=True, length_penalty=1), param="use_beam_search"),
    Case("beam search too wide", "/v1/completions", completion(use_beam_search=True, n=11), param="n"),
    Case("prompt_logprobs negative", "/v1/completions", completion(prompt_logprobs=-5), param="prompt_logprobs"),
    # issue 39: a big body is built and rendered off the event loop; beyond the bound on n x prompt x logprobs, a 400
    Case(
        "n 32 x 1000 prompt tokens x prompt_logprobs 20",
        "/v1/completions",
        completion(prompt=THOUSAND_IDS, n=32, max_tokens=1, prompt_logprobs=20),
        200,
    ),
    Case(
        "n 16 x 1000 prompt tokens x echo logprobs 20",
        "/v1/completions",
        completion(prompt=THOUSAND_IDS, n=16, max_tokens=2, echo=True, logprobs=20),
        200,
    ),
    Case(
        "n 16 x 1000 prompt tokens x echo logprobs 20, streamed",
        "/v1/completions",
        completion(prompt=THOUSAND_IDS, n=16, max_tokens=2, echo=True, logprobs=20, stream=True),
        200,
    ),
    Case(
        "n 128 x 1000 prompt tokens x prompt_logprobs 20",
        "/v1/completions",
        completion(prompt=THOUSAND_IDS, n=128, max_tokens=1, prompt_logprobs=20),
        param="prompt_logprobs",
        message="--max-prompt-logprob-entries",
    ),
    Case("guided_json unclosed", "/v1/completions", completion(guided_json="["), param="guided_json"),
    Case(
        "structured_outputs bad regex",
        "/v1/completions",
        completion(structured_outputs={"regex": "(unclosed"}),
        param="structured_outputs.regex",
    ),  # fmt: skip
    Case(
        "structured_outputs two constraints",
        "/v1/completions",
        completion(structured_outputs={"regex": "a", "choice": ["a"]}),
        param="structured_outputs",
    ),  # fmt: skip
    Case(
        "structured_outputs bad grammar",
        "/v1/completions",
        completion(structured_outputs={"grammar": "root ::= nothing_defined"}),
        param="structured_outputs.grammar",
    ),  # fmt: skip
    Case(
        "structured_outputs empty choice",
        "/v1/completions",
        completion(structured_outputs={"choice": []}),
        param="structured_outputs.choice",
    ),  # fmt: skip
    Case("bad_words empty word", "/v1/completions", completion(bad_words=[""]), message="bad_words cannot contain"),
    Case(
        "bad_words 5,000 over 64 prompts",  # tokenized once a request, off the loop (were 64 x 10,000 encodes on it)
        "/v1/completions",
        completion(prompt=["x"] * 64, bad_words=[f"w{i} z{i}" for i in range(5000)]),
        status=200,
    ),  # fmt: skip
    Case(
        "bad_words 5,000 over 1,024 prompts",  # one word list for all prompts, checked in C, built in slices
        "/v1/completions",
        completion(prompt=["x"] * 1024, bad_words=[f"w{i} z{i}" for i in range(5000)], max_tokens=1),
        status=200,
    ),  # fmt: skip
    Case(
        "allowed_token_ids out of vocab",
        "/v1/completions",
        completion(allowed_token_ids=[10**7]),
        param="allowed_token_ids",
    ),  # fmt: skip
    Case(
        "completion response_format unknown type",
        "/v1/completions",
        completion(response_format={"type": "xml"}),
        param="response_format",
    ),  # fmt: skip
    Case("unknown model", "/v1/completions", completion(model="gpt-4"), 404, "model"),
    Case(
        "stream_options without stream",
        "/v1/completions",
        completion(stream_options={"include_usage": True}),
        message="Stream options can only be defined when `stream=True`.",
    ),  # fmt: skip
    Case("stream_options not an object", "/v1/completions", completion(stream=True, stream_options="yes")),
    # -- chat fields --------------------------------------------------------------------------------------------
    Case("messages empty", "/v1/chat/completions", chat(messages=[]), param="body.messages"),
    Case("messages missing", "/v1/chat/completions", {"model": MODEL_NAME}, param="body.messages"),
    Case("messages a string", "/v1/chat/completions", chat(messages="hi"), param="body.messages"),
    Case("message without a role", "/v1/chat/completions", chat(messages=[{"content": "hi"}])),
    Case("content an int", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}])),
    Case(
        "image content part",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
        param="messages.0.content",
    ),  # fmt: skip
    Case("chat over the context", "/v1/chat/completions", chat(messages=[{"role": "user", "content": LONG_WORDS}])),
    Case(
        "chat far over the context",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": FAR_TOO_MANY_CHARS}]),
        message="characters",
    ),  # fmt: skip
    Case("16,000 messages", "/v1/chat/completions", chat(messages=MANY_MESSAGES)),
    Case("60,000 messages", "/v1/chat/completions", chat(messages=TOO_MANY_MESSAGES), message="JSON objects"),
    Case(
        "20,000 objects in a small body",
        "/v1/completions",
        b'{"prompt": "x", "a": [' + b"{}," * 20000 + b"{}]}",
        message="JSON objects",
    ),  # fmt: skip
    Case("max_completion_tokens negative", "/v1/chat/completions", chat(max_completion_tokens=-3), param="max_tokens"),
    Case("chat max_tokens huge", "/v1/chat/completions", chat(max_tokens=10**9), param="max_tokens"),
    Case("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=2), param="top_logprobs"),
    Case("top_logprobs 50", "/v1/chat/completions", chat(logprobs=True, top_logprobs=50), param="logprobs"),
    Case("tool_choice without tools", "/v1/chat/completions", chat(tool_choice="auto"), param="tool_choice"),
    Case("tools an empty list", "/v1/chat/completions", chat(tools=[]), param="tools"),
    Case(
        "tool_choice names an unknown function",
        "/v1/chat/completions",
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        param="tool_choice",
    ),
    Case("tool_choice sometimes", "/v1/chat/completions", chat(tools=[TOOL], tool_choice="sometimes")),
    Case(
        "response_format json_schema without a schema",
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema"}),
        param="response_format",
    ),  # fmt: skip
    Case("chat_template_kwargs a list", "/v1/chat/completions", chat(chat_template_kwargs=[1])),
    Case(
        "continue and generation prompt",
        "/v1/chat/completions",
        chat(messages=ASSISTANT_LAST, continue_final_message=True),
        param="continue_final_message",
    ),  # fmt: skip
    Case(
        "continue a user message",
        "/v1/chat/completions",
        chat(continue_final_message=True, add_generation_prompt=False),
        param="continue_final_message",
    ),
    Case(
        "reasoning_effort extreme",
        "/v1/chat/completions",
        chat(reasoning_effort="extreme"),
        param="body.reasoning_effort",
    ),  # fmt: skip
    Case(
        "tool call arguments not JSON",
        "/v1/chat/completions",
        chat(
            messages=[
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        ),
        param="messages.1.tool_calls",
    ),  # fmt: skip
    Case("chat n a million", "/v1/chat/completions", chat(n=10**6), param="n"),
    Case("chat 100,000 stop strings with n=8", "/v1/chat/completions", chat(stop=["x"] * 100_000, n=8), param="stop"),
    Case(
        "thinking_token_budget a float",
        "/v1/chat/completions",
        chat(thinking_token_budget=1.5),
        message="must be a non-negative integer or -1",
        param="thinking_token_budget",
    ),  # fmt: skip
    Case("chat unknown model", "/v1/chat/completions", chat(model="nope"), 404, "model"),
    Case(
        "chat stream_options without stream",
        "/v1/chat/completions",
        chat(stream_options={"include_usage": True}),
        message="Stream options",
    ),  # fmt: skip
    # -- chat templates sent with the request (rendered: this server trusts them) -----------------------------------
    Case(
        "template repeats a string 3M times",
        "/v1/chat/completions",
        template("{{ 'ab ' * 3000000 }}"),
        message="size bound",
    ),  # fmt: skip
    Case("template divides by zero", "/v1/chat/completions", template("{{ 1 // 0 }}"), message="ZeroDivisionError"),
    Case("template formats a missing key", "/v1/chat/completions", template("{{ '%(a)s' % {} }}"), message="KeyError"),
    Case("template uses an unknown filter", "/v1/chat/completions", template("{{ x|nofilter }}")),
    Case("template raises", "/v1/chat/completions", template("{{ raise_exception('no') }}"), message="no"),
    Case("template syntax error", "/v1/chat/completions", template("{% for %}")),
    Case("template reads an undefined attribute", "/v1/chat/completions", template("{{ foo.bar.baz }}")),
    Case(
        "template loops 10^10 times",
        "/v1/chat/completions",
        template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
        message="took longer",
    ),  # fmt: skip
    Case(
        "template loops over strings",
        "/v1/chat/completions",
        template("{% for a in 'x' * 100000 %}{% for b in 'y' * 100000 %}{% endfor %}{% endfor %}"),
        message="took longer",
    ),  # fmt: skip
    Case(
        "template recurses",
        "/v1/chat/completions",
        template("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
        message="recursed",
    ),  # fmt: skip
    Case(
        "template %-format width 10^9",
        "/v1/chat/completions",
        template("{{ '%0999999999d' % 1 }}"),
        message="size bound",
    ),  # fmt: skip
    Case(
        "template str.format width 10^9",
        "/v1/chat/completions",
        template("{{ '{:>999999999}'.format(1) }}"),
        message="size bound",
    ),  # fmt: skip
    Case("template center(10^9)", "/v1/chat/completions", template("{{ 'a'.center(10**9) }}"), message="size bound"),
    Case(
        "template center filter 10^9", "/v1/chat/completions", template("{{ 'a'|center(10**9) }}"), message="size bound"
    ),  # fmt: skip
    Case(
        "template indent filter 10^9",
        "/v1/chat/completions",
        template("{{ 'a\nb'|indent(10**9) }}"),
        message="size bound",
    ),  # fmt: skip
    Case(
        "template doubles a string 40 times",
        "/v1/chat/completions",
        template(
            "{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}{% endfor %}{{ ns.x }}"
        ),
        message="size bound",
    ),  # fmt: skip
    Case(
        "template allocates 100 GB",
        "/v1/chat/completions",
        template(
            "{% set ns = namespace(l=[]) %}{% for i in range(12500) %}{% set ns.l = ns.l + ['x' * 8000000] %}"
            "{% endfor %}"
        ),
        message="MiB",
    ),
    Case(
        "template writes 100 MB",
        "/v1/chat/completions",
        template("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"),
        message="longer than",
    ),  # fmt: skip
    Case(
        "template replaces the empty string",
        "/v1/chat/completions",
        template("{{ ('a' * 100000)|replace('', 'b' * 1000) }}"),
        message="size bound",
    ),  # fmt: skip
    Case(
        "template tojson indent 10^9",
        "/v1/chat/completions",
        template("{{ messages|tojson(indent=10**9) }}"),
        message="indent",
    ),  # fmt: skip
    Case("template power 10^9", "/v1/chat/completions", template("{{ 2 ** 1000000000 }}"), message="power"),
    Case("template range 10^9", "/v1/chat/completions", template("{{ range(10**9)|list|length }}")),
    Case("template lipsum", "/v1/chat/completions", template("{{ lipsum(10**6) }}")),
    Case("template sandbox escape", "/v1/chat/completions", template("{{ ''.__class__.__mro__[1].__subclasses__() }}")),
    Case("template namespace dunder", "/v1/chat/completions", template("{% set ns = namespace(__x=1) %}{{ 1 }}")),
    Case("template int of 5000 digits", "/v1/chat/completions", template("{{ (10 ** 4096) * (10 ** 900) }}")),
    Case("template renders nothing", "/v1/chat/completions", template("{# nothing #}"), param="messages"),
    # -- /tokenize, /detokenize, /invocations ---------------------------------------------------------------------
    Case("tokenize without a body", "/tokenize", b""),
    Case("tokenize without prompt", "/tokenize", {"model": MODEL_NAME}, param="body.prompt"),
    Case("tokenize prompt an int", "/tokenize", {"prompt": 5}, param="body.prompt"),
    Case("tokenize unknown model", "/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    Case("tokenize 40,000 characters", "/tokenize", {"prompt": "hello world " * 3333}, 200),
    Case(
        "tokenize 4e6 characters",
        "/tokenize",
        {"prompt": "hello world " * 333_334},
        param="prompt",
        message="maximum context length is 2048 tokens",
    ),
    Case(
        "tokenize messages of 4e6 characters",
        "/tokenize",
        {"messages": [{"role": "user", "content": "hello world " * 333_334}]},
        param="messages",
        message="maximum context length is 2048 tokens",
    ),
    Case(
        "tokenize hostile template",
        "/tokenize",
        {
            "messages": USER,
            "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        },
        message="took longer",
    ),  # fmt: skip
    Case("tokenize messages empty", "/tokenize", {"messages": []}, param="body.messages"),
    Case("tokenize text/plain", "/tokenize", b'{"prompt": "x"}', headers={"content-type": "text/plain"}),
    Case("detokenize without tokens", "/detokenize", {"model": MODEL_NAME}, param="body.tokens"),
    Case("detokenize out of vocab", "/detokenize", {"tokens": [10**9]}, param="tokens"),
    Case("detokenize negative", "/detokenize", {"tokens": [-1]}, param="tokens"),
    Case("detokenize strings", "/detokenize", {"tokens": "abc"}, param="body.tokens"),
    Case("detokenize 500k tokens", "/detokenize", {"tokens": [100] * 500_000}, 200),
    Case(
        "invocations neither chat nor completion",
        "/invocations",
        {"model": MODEL_NAME},
        message="Cannot find suitable handler",
    ),  # fmt: skip
    Case("invocations empty messages", "/invocations", {"messages": []}, param="body.messages"),
    Case("invocations bad prompt", "/invocations", {"prompt": 5}, param="body.prompt"),
    Case("invocations text/plain", "/invocations", b'{"prompt": "x"}', headers={"content-type": "text/plain"}),
    # -- routes and methods -----------------------------------------------------------------------------------------
    Case("GET a POST route", "/v1/completions", method="GET", status=405),
    Case("POST /v1/models", "/v1/models", {}, 405),
    Case("DELETE /health", "/health", method="DELETE", status=405),
    Case("unknown route", "/v1/nothing", {}, 404),
    Case("path traversal", "/../../etc/passwd", method="GET", status=404),
    Case("8 KB path", "/" + "a" * 8192, method="GET", status=404),
    Case("tokenizer_info when not enabled", "/tokenizer_info", method="GET", status=404),
]


@dataclass
class RemoteServer:
    base_url: str
    port: int
    pid: int


@pytest.fixture(scope="module")
def hostile_server() -> Iterator[RemoteServer]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "tests.api.hostile_server", str(port)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    server = RemoteServer(f"http://127.0.0.1:{port}", port, process.pid)
    deadline = time.monotonic() + 120
    try:
        while True:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            try:
                if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the hostile server did not start"
            time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def local_server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    server = ServerThread(build_app(fake_engine, hostile_settings())).start()
    yield server
    server.stop()


def encode(case: Case) -> dict[str, Any]:
    """The request's arguments, built before any probing (json.dumps of a big body holds this process's GIL)."""
    headers = {key: value for key, value in {"content-type": "application/json", **case.headers}.items() if value}
    kwargs: dict[str, Any] = {"headers": headers}
    if isinstance(case.body, bytes):
        kwargs["content"] = case.body
    elif callable(case.body):
        kwargs["content"] = case.body()
    elif case.body is not None:
        kwargs["content"] = json.dumps(case.body).encode()
    return kwargs


def send(base_url: str, case: Case, kwargs: dict[str, Any]) -> tuple[int, str]:
    """(status, body text) of the case's request."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        response = client.request(case.method, case.path, **kwargs)
        return response.status_code, response.text


def send_named(base_url: str, name: str) -> tuple[int, str]:
    """In the sender process: builds the named case of CASES there and sends it (module docstring)."""
    case = next(case for case in CASES if case.name == name)
    return send(base_url, case, encode(case))


def cpu_wait_s(pids: Collection[int]) -> float:
    """Seconds the threads of these processes have spent runnable but waiting for a CPU: the second field of Linux's
    /proc/PID/task/TID/schedstat (nanoseconds). 0 where the kernel does not report it: the probes are then bounded by
    their plain latency."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as stats:
                    total += int(stats.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that ended since the listing
    return total / 1e9


@dataclass(frozen=True)
class Probe:
    latency_s: float
    cpu_wait_s: float  # the server's and the client's threads waited this long for a CPU meanwhile (summed)

    @property
    def held_s(self) -> float:
        """How long the server held the probe beyond what a busy machine explains."""
        return self.latency_s - self.cpu_wait_s

    def __str__(self) -> str:
        latency, wait = round(self.latency_s * 1000), round(self.cpu_wait_s * 1000)
        return f"{round(self.held_s * 1000)} ms held ({latency} ms, of which {wait} ms waiting for a CPU)"


def probe_health_while(client: httpx.Client, future: Any, server_pid: int) -> list[Probe]:
    """/health probes sent one after another until the hostile request is answered (at least one)."""
    pids = {server_pid, os.getpid()}  # one pid when the server runs in this process
    probes = []
    while True:
        waited = cpu_wait_s(pids)
        start = time.perf_counter()
        assert client.get("/health").status_code == 200
        latency = time.perf_counter() - start
        probes.append(Probe(latency, cpu_wait_s(pids) - waited))
        if future.done():
            return probes
        time.sleep(0.01)


def run_case(base_url: str, case: Case, server_pid: int, sender: Executor | None = None) -> Probe:
    """Sends the case while probing /health; checks the answer; returns the probe held longest. sender: the process
    that sends the cases of CASES (hostile_sender); None: a thread of this process sends it."""
    with httpx.Client(base_url=base_url, timeout=10) as client, ThreadPoolExecutor(1) as threads:
        client.get("/health")  # connected before the request goes out, so the probes cover its start
        if sender is not None:
            future = sender.submit(send_named, base_url, case.name)
        else:
            future = threads.submit(send, base_url, case, encode(case))
        probes = probe_health_while(client, future, server_pid)
        status, text = future.result()
    assert status == case.status, text[:500]
    if case.status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == case.status and isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["type"]
        if case.param is not None:
            assert error["param"] == case.param, error
        if case.message is not None:
            assert case.message in error["message"], error
    return max(probes, key=lambda probe: probe.held_s)


def held_in_attempts(base_url: str, case: Case, server_pid: int, sender: Executor | None = None) -> list[Probe]:
    """The probe held longest in each run of the case, until one stays under the budget or ATTEMPTS ran."""
    worst = [run_case(base_url, case, server_pid, sender)]
    while worst[-1].held_s >= HEALTH_BUDGET_S and len(worst) < ATTEMPTS:
        worst.append(run_case(base_url, case, server_pid, sender))
    return worst


@pytest.fixture(scope="module")
def hostile_sender() -> Iterator[Executor]:
    """One process that builds and sends the hostile requests: a thread of this process would share the GIL with
    the /health probes, and building or sending a 64 MB body there held them ~25 ms a probe (100-400 ms on a
    machine whose memory had become slow), which is the client's time, not the server's."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(int).result()  # started (and this module imported there) before any probe
        yield pool


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_request(hostile_server: RemoteServer, hostile_sender: Executor, case: Case) -> None:
    worst = held_in_attempts(hostile_server.base_url, case, hostile_server.pid, hostile_sender)
    assert worst[-1].held_s < HEALTH_BUDGET_S, f"/health in {len(worst)} runs: {'; '.join(map(str, worst))}"


def test_a_stalled_loop_is_caught(local_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails a server whose body read blocks its event loop (a sleep there, as a blocking read
    would), however busy the machine: a stall is not a CPU wait."""
    read = api_body.read_body

    async def blocking_read(*args: Any, **kwargs: Any) -> bytes:
        time.sleep(5 * HEALTH_BUDGET_S)  # on the event loop
        return await read(*args, **kwargs)

    monkeypatch.setattr(api_body, "read_body", blocking_read)
    case = Case("a plain completion", "/v1/completions", completion(), status=200)
    worst = held_in_attempts(local_server.base_url, case, os.getpid())
    assert len(worst) == ATTEMPTS and min(probe.held_s for probe in worst) >= 2 * HEALTH_BUDGET_S, worst


def test_suite_is_large_enough() -> None:
    assert len(CASES) >= 100 and len({case.name for case in CASES}) == len(CASES)


def test_client_dropping_mid_upload_is_not_an_internal_error(
    local_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """Content-Length promises 10,000 bytes, 10 arrive, the socket closes: one info line, no error, no traceback."""
    caplog.set_level("INFO")
    with socket.create_connection(("127.0.0.1", local_server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000\r\n\r\n" + b'{"prompt":')  # fmt: skip
    deadline = time.monotonic() + 5
    while not any("disconnected during the upload" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.02)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    assert httpx.get(local_server.base_url + "/health").status_code == 200


def test_template_errors_log_one_line_without_traceback(
    local_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    for source in ("{{ 1 // 0 }}", "{{ '%(a)s' % {} }}", "{{ x|nofilter }}", "{{ raise_exception('no') }}"):
        caplog.clear()
        response = httpx.post(local_server.base_url + "/v1/chat/completions", json=template(source), timeout=30)
        assert response.status_code == 400
        lines = [r for r in caplog.records if r.name.startswith("deltaserve")]
        assert len(lines) == 1 and "chat template error" in lines[0].getMessage() and not lines[0].exc_info


def test_killed_template_worker_is_replaced(hostile_server: RemoteServer) -> None:
    """After renders that overran (and their workers were killed), ordinary chats still render."""
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    url = hostile_server.base_url + "/v1/chat/completions"
    threads = [threading.Thread(target=httpx.post, args=(url,), kwargs={"json": template(loop), "timeout": 30})
               for _ in range(3)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    response = httpx.post(url, json=chat(), timeout=30)
    assert response.status_code == 200, response.text
