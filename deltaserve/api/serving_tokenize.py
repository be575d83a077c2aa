"""POST /tokenize, /detokenize and GET /tokenizer_info, as vLLM serves them (`vllm bench serve` uses the first two).

/tokenize takes a completion-style body ({prompt, add_special_tokens}) or a chat-style one ({messages, ...},
rendered through the chat template) and returns count, max_model_len, tokens and optionally token_strs. As in vLLM
it does not cap the count at max_model_len, but text that cannot fit the context is refused before tokenising, as
completions and chat refuse it (more than max_model_len x the longest token's characters, tokens.py), and the
body-size limit bounds the rest. The encode runs off the event loop (a large input on the large-input pool, so
big /tokenize bodies cannot hold the threads other requests tokenise on), and a long token list is written as JSON
slice by slice. /tokenizer_info (only with --enable-tokenizer-info-endpoint, since it exposes the chat template)
returns the tokenizer's init configuration without file paths.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deltaserve.api.body import parse_body, read_json
from deltaserve.api.chat import check_request_template, render_chat, template_kwargs
from deltaserve.api.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from deltaserve.api.serving_common import check_model, check_token_ids
from deltaserve.api.settings import ServerState
from deltaserve.api.tokens import SLICE_TOKENS, json_int_list


async def tokenize(state: ServerState, raw_request: Request) -> Response:
    data, _ = await read_json(state, raw_request)
    if "messages" in data:
        chat = await state.tokens.run(parse_body, TokenizeChatRequest, data)
        check_model(state, chat.model)
        check_request_template(state, chat.chat_template, chat.chat_template_kwargs)
        prompt = await render_chat(
            state,
            chat.messages,
            tools=chat.tools,
            chat_template=chat.chat_template,
            kwargs=template_kwargs(state, chat.chat_template_kwargs),
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
        )
        add_special_tokens, return_token_strs = chat.add_special_tokens, chat.return_token_strs
        param = "messages"
    else:
        request = parse_body(TokenizeCompletionRequest, data)
        check_model(state, request.model)
        prompt, add_special_tokens = request.prompt, request.add_special_tokens
        return_token_strs = request.return_token_strs
        param = "prompt"
    max_model_len = state.engine.max_model_len
    token_ids, _ = await state.tokens.encode(
        prompt, add_special_tokens=add_special_tokens, max_input_tokens=max_model_len, param=param
    )
    token_strs = await state.tokens.token_strings(token_ids) if return_token_strs else None
    head = {"count": len(token_ids), "max_model_len": max_model_len}
    if len(token_ids) <= SLICE_TOKENS:
        return JSONResponse({**head, "tokens": token_ids, "token_strs": token_strs})

    def dump() -> bytes:
        strs = "null" if token_strs is None else json.dumps(token_strs, ensure_ascii=False)
        text = json.dumps(head)[:-1] + f', "tokens": {json_int_list(token_ids)}, "token_strs": {strs}}}'
        return text.encode()

    return Response(await state.tokens.run_large(dump), media_type="application/json")


async def detokenize(state: ServerState, raw_request: Request) -> JSONResponse:
    data, _ = await read_json(state, raw_request)
    request = await state.tokens.run(parse_body, DetokenizeRequest, data)
    check_model(state, request.model)
    check_token_ids(state, request.tokens, "tokens")
    return JSONResponse({"prompt": await state.tokens.decode(request.tokens)})


def _json_ready(value: Any) -> Any:
    """Tokenizer init kwargs as JSON: AddedToken-like objects become their text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def tokenizer_info(state: ServerState) -> dict[str, Any]:
    tokenizer = state.engine.tokenizer
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    # File paths say where the server keeps its files; they are none of the client's business.
    for key in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        config.pop(key, None)
    info = _json_ready(config)
    info["tokenizer_class"] = type(tokenizer).__name__
    chat_template = state.settings.chat_template or getattr(tokenizer, "chat_template", None)
    if chat_template:
        info["chat_template"] = chat_template
    return info
