"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as vLLM 0.26 serves it (its
entrypoints/anthropic), for clients built on Anthropic's SDK (coding agents among them).

As vLLM does, a request becomes a chat completion request, runs through the chat route's own steps (checks,
template, reasoning and tool-call parsing), and its answer is turned back: the system prompt (text blocks, billing
headers dropped; inline system messages merged into it unless --chat-template takes them where they stand), user
text and images (base64 as data URLs), assistant thinking as `reasoning`, tool_use as tool calls and tool_result as
tool messages (a result's images in a user message after it); tools and tool_choice (auto, any = required, tool =
named, none); max_tokens, stop_sequences, temperature, top_p, top_k; output_config's JSON schema and effort. The body
is vLLM's message: id (the chat id), content blocks thinking (with a fresh signature), text and tool_use, stop_reason
end_turn / max_tokens / tool_use, usage with the cache's reads and writes taken out of input_tokens (with
--enable-prompt-tokens-details). A stream is vLLM's event sequence (message_start, content_block_start / _delta /
_stop, message_delta with the usage, message_stop), converted from the chat route's own stream: text that arrives
inside a tool_use block is held and sent as a text block after it. Errors from the chat route come in Anthropic's
envelope ({"type": "error", "error": {type, message}}) with their status; a body that fails the request model is the
server's usual 400, as in vLLM.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deltaserve.api import serving_chat
from deltaserve.api.anthropic_protocol import ContentBlock, CountTokensRequest, Message, MessagesRequest
from deltaserve.api.body import parse_body, read_json
from deltaserve.api.chat import render_prompt
from deltaserve.api.chat_job import ChatJob, collect_choices
from deltaserve.api.errors import APIError, to_api_error
from deltaserve.api.protocol import ChatCompletionRequest
from deltaserve.api.sampling import tokenize_bad_words, warn_once_per_set
from deltaserve.api.serving_common import request_ids, respond
from deltaserve.api.settings import ServerState

logger = logging.getLogger(__name__)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}  # vLLM's map
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's system block, dropped as vLLM drops it
_logged_fields: OrderedDict[frozenset[str], None] = OrderedDict()


def merges_inline_system(chat_template: str | None) -> bool:
    """vLLM's check: inline system messages join the leading one unless the template renders [system, user, system,
    user] (Qwen's templates refuse a system message past the first; the model's own template is taken to)."""
    if not chat_template:
        return True
    try:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        turns = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
        env.from_string(chat_template).render(messages=turns, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def system_text(content: str | list[ContentBlock]) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b.text for b in content if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER)]
    return "".join(parts) or None


def convert_message(message: Message, out: list[dict[str, Any]]) -> None:
    """One user or assistant message as chat messages (tool results become tool messages of their own)."""
    converted: dict[str, Any] = {"role": message.role}
    if isinstance(message.content, str):
        out.append({**converted, "content": message.content})
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in message.content:
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and block.source:
            parts.append({"type": "image_url", "image_url": {"url": image_url(block.source)}})
        elif block.type == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif block.type == "tool_use":
            function = {"name": block.name or "", "arguments": json.dumps(block.input or {})}
            calls.append({"id": block.id or f"call_{int(time.time())}", "type": "function", "function": function})
        elif block.type == "tool_result":
            if message.role == "user":
                out.extend(tool_result_messages(block))
            else:
                parts.append({"type": "text", "text": f"Tool result: {block.content if block.content else ''}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        converted["content"] = parts[0]["text"] if only_text else parts
    if message.role == "user" and "content" not in converted:
        return  # a user message of tool results alone: they went as tool messages
    out.append(converted)


def tool_result_messages(block: ContentBlock) -> list[dict[str, Any]]:
    """A user's tool_result: a tool message with its text, then its images as a user message, then its tool
    references as a second tool message (vLLM's order)."""
    texts: list[str] = []
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(block.content, str):
        texts.append(block.content)
    elif isinstance(block.content, list):
        for item in block.content:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image" and (url := image_url(item.get("source", {}))):
                images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
    call_id = block.tool_use_id or ""
    found: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": "\n".join(texts)}]
    if images:
        found.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in images]})
    if references:
        found.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return found


def chat_request(state: ServerState, request: CountTokensRequest) -> ChatCompletionRequest:
    """vLLM's _convert_anthropic_to_openai_request."""
    merge = merges_inline_system(state.settings.chat_template)
    messages: list[dict[str, Any]] = []
    system: list[str] = []
    if request.system:
        text = system_text(request.system)
        system.extend([text] if text else [])
    if merge:
        system.extend(text for m in request.messages if m.role == "system" and (text := system_text(m.content)))
    if system:
        messages.append({"role": "system", "content": "".join(system)})
    for message in request.messages:
        if message.role == "system":
            if not merge and (text := system_text(message.content)):
                messages.append({"role": "system", "content": text})
            continue
        convert_message(message, messages)
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    if isinstance(request, MessagesRequest):
        body |= {"max_tokens": request.max_tokens, "stop": request.stop_sequences, "temperature": request.temperature,
                 "top_p": request.top_p, "top_k": request.top_k}  # fmt: skip
        if request.stream:
            body |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        config = request.output_config
        if config is not None and config.format is not None and config.format.json_schema:
            schema = {"name": config.format.type, "schema": config.format.json_schema}
            body["response_format"] = {"type": config.format.type, "json_schema": schema}
        if config is not None and config.effort is not None:
            body["reasoning_effort"] = config.effort
    if request.tool_choice is not None:
        choice = request.tool_choice
        named = {"type": "function", "function": {"name": choice.name}}
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, named)
    if request.tools is not None:
        body["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.input_schema,
            "strict": tool.strict}} for tool in request.tools]  # fmt: skip
        body.setdefault("tool_choice", "auto")
    return parse_body(ChatCompletionRequest, body)


def anthropic_usage(usage: dict[str, Any] | None) -> dict[str, int]:
    """vLLM's _build_anthropic_usage: Anthropic counts cache reads and writes apart from input_tokens."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    found = {"output_tokens": usage.get("completion_tokens") or 0}
    input_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        input_tokens -= details["cached_tokens"]
        found["cache_read_input_tokens"] = details["cached_tokens"]
    if details.get("created_cache_tokens") is not None:
        input_tokens -= details["created_cache_tokens"]
        found["cache_creation_input_tokens"] = details["created_cache_tokens"]
    return {"input_tokens": max(0, input_tokens), **found}


def anthropic_error(err: APIError) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": err.err_type, "message": err.message}}, err.status)


def log_ignored(request: CountTokensRequest) -> None:
    names = frozenset(request.model_extra or {})
    warn_once_per_set(logger, _logged_fields, 64, names, "Messages API fields ignored")
    if isinstance(request, MessagesRequest) and (request.kv_transfer_params or request.ec_transfer_params):
        logger.warning(
            "kv_transfer_params / ec_transfer_params ignored: no KV or encoder-cache connector is configured"
        )


async def create_messages(state: ServerState, raw_request: Request) -> Response:
    data, _ = await read_json(state, raw_request)
    request = parse_body(MessagesRequest, data)
    log_ignored(request)
    try:
        chat = chat_request(state, request)
        job = await submit(state, raw_request, chat)
    except Exception as exc:  # the chat route's refusals, in Anthropic's envelope
        return anthropic_error(to_api_error(exc))

    async def full() -> Response:
        try:
            result = await collect_choices(job)
        except Exception as exc:
            return anthropic_error(to_api_error(exc))
        return JSONResponse(full_message(job, result.choices[0], job.usage(result.processors)))

    return await respond(state, raw_request, bool(chat.stream), lambda: stream_events(job), full)


async def submit(state: ServerState, raw_request: Request, request: ChatCompletionRequest) -> ChatJob:
    """The chat route's steps up to its submit (serving_chat.create_chat_completion's)."""
    arrival = time.perf_counter()
    constraint, tool_choice = await serving_chat.validate(state, request)
    prompt = await render_prompt(state, request)
    params = serving_chat.sampling_params(state, request, prompt, constraint, await tokenize_bad_words(state, request))
    response_id = request_ids(raw_request, request.request_id, "chatcmpl")
    role = serving_chat.response_role(state, request)
    return serving_chat.submit(state, request, prompt, params, tool_choice, response_id, arrival, role, "")


def full_message(job: ChatJob, choice: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    """vLLM's messages_full_converter, serialised without its null fields."""
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                        "input": json.loads(function["arguments"])})  # fmt: skip
    body: dict[str, Any] = {"id": job.response_id, "type": "message", "role": "assistant",
                            "content": content or [{"type": "text", "text": ""}],
                            "model": job.state.settings.model_name}  # fmt: skip
    stop_reason = STOP_REASONS.get(choice["finish_reason"])
    if stop_reason is not None:
        body["stop_reason"] = stop_reason
    body["usage"] = anthropic_usage(usage)
    return body


def event(kind: str, payload: dict[str, Any]) -> str:
    return (
        f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False, separators=(',', ':'))}\n\n"
    )


class BlockStream:
    """vLLM's message_stream_converter: the open content block, its index, and the events that open and close one."""

    def __init__(self) -> None:
        self.next_index = 0
        self.kind: str | None = None  # the open block's type
        self.tool_id: str | None = None
        self.signature: str | None = None  # a thinking block's, sent when it closes
        self.held: list[str] = []  # text that arrived inside a tool_use block
        self.tool_ids: dict[int, str] = {}  # a streamed tool call's index -> its id

    def start(self, block: dict[str, Any]) -> str:
        self.kind = block["type"]
        self.tool_id = block.get("id") if self.kind == "tool_use" else None
        self.signature = uuid.uuid4().hex if self.kind == "thinking" else None
        return event("content_block_start", {"content_block": block, "index": self.next_index})

    def delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"delta": delta, "index": self.next_index})

    def stop(self) -> list[str]:
        if self.kind is None:
            return []
        found = []
        if self.signature is not None:
            found.append(self.delta({"type": "signature_delta", "signature": self.signature}))
        found.append(event("content_block_stop", {"index": self.next_index}))
        self.kind = self.tool_id = self.signature = None
        self.next_index += 1
        return found

    def stop_and_flush(self) -> list[str]:
        """Closes the open block, then sends the text held during a tool_use block as a text block of its own."""
        held, self.held = "".join(self.held), []
        found = self.stop()
        if held:
            found += [self.start({"type": "text", "text": ""}), self.delta({"type": "text_delta", "text": held})]
            found += self.stop()
        return found

    def switch_to(self, block: dict[str, Any]) -> list[str]:
        return [*self.stop_and_flush(), self.start(block)]


async def stream_events(job: ChatJob) -> AsyncIterator[str]:
    """The chat route's stream (serving_chat.stream_chat) as Anthropic's events."""
    blocks = BlockStream()
    finish_reason: str | None = None
    is_first = True
    async for item in serving_chat.stream_chat(job):
        data = item[len("data: ") :].strip()
        if data == "[DONE]":
            for each in blocks.stop_and_flush():
                yield each
            yield event("message_stop", {})
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            yield event("error", {"error": {"type": error.get("type", "internal_error"), "message": error["message"]}})
            continue
        if is_first:  # the role chunk opens the message
            is_first = False
            message = {"id": chunk["id"], "type": "message", "role": "assistant", "content": [],
                       "model": chunk["model"], "stop_reason": None, "stop_sequence": None,
                       "usage": anthropic_usage(chunk.get("usage"))}  # fmt: skip
            yield event("message_start", {"message": message})
            continue
        if not chunk["choices"]:  # the usage chunk ends the message
            for each in blocks.stop_and_flush():
                yield each
            stop_reason = STOP_REASONS.get(finish_reason or "stop")
            yield event(
                "message_delta", {"delta": {"stop_reason": stop_reason}, "usage": anthropic_usage(chunk["usage"])}
            )
            continue
        choice = chunk["choices"][0]
        finish_reason = choice.get("finish_reason") or finish_reason
        for each in convert_delta(blocks, choice["delta"]):
            yield each


def convert_delta(blocks: BlockStream, delta: dict[str, Any]) -> list[str]:
    """One chat delta's reasoning, content and tool calls as content-block events."""
    found: list[str] = []
    if delta.get("reasoning"):
        if blocks.kind != "thinking":
            found += blocks.switch_to({"type": "thinking", "thinking": ""})
        found.append(blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
    if delta.get("content"):
        if blocks.kind == "tool_use":
            blocks.held.append(delta["content"])
        else:
            if blocks.kind != "text":
                found += blocks.switch_to({"type": "text", "text": ""})
            found.append(blocks.delta({"type": "text_delta", "text": delta["content"]}))
    for call in delta.get("tool_calls") or []:
        function = call.get("function") or {}
        call_id = call.get("id")
        if call_id is not None:
            blocks.tool_ids[call["index"]] = call_id
            if blocks.tool_id != call_id and function.get("name") is not None:
                found += blocks.switch_to({"type": "tool_use", "id": call_id, "name": function["name"], "input": {}})
        else:
            call_id = blocks.tool_ids.get(call["index"])
        if call_id is not None and function.get("arguments") and blocks.tool_id == call_id:
            found.append(blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
    return found


async def count_tokens(state: ServerState, raw_request: Request) -> Response:
    data, _ = await read_json(state, raw_request)
    request = parse_body(CountTokensRequest, data)
    log_ignored(request)
    try:
        chat = chat_request(state, request)
        await serving_chat.validate(state, chat)
        prompt = await render_prompt(state, chat)
    except Exception as exc:
        return anthropic_error(to_api_error(exc))
    count = len(prompt.token_ids)
    return JSONResponse({"input_tokens": count, "context_management": {"original_input_tokens": count}})
