"""POST /tokenize and /detokenize, as vLLM serves them (`vllm bench serve` uses both to align prompt lengths).

/tokenize takes a completion-style body ({prompt, add_special_tokens}) or a chat-style one ({messages, ...},
rendered through the chat template) and returns count, max_model_len, tokens and optionally token_strs.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from deltaserve.api.chat import encode_prompt, render_chat, template_kwargs
from deltaserve.api.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from deltaserve.api.serving_common import check_model, check_token_ids, parse_body, read_json
from deltaserve.api.settings import ServerState


async def tokenize(state: ServerState, raw_request: Request) -> dict[str, Any]:
    data = await read_json(raw_request)
    tokenizer = state.engine.tokenizer
    if "messages" in data:
        chat = parse_body(TokenizeChatRequest, data)
        check_model(state, chat.model)
        prompt = render_chat(
            state,
            chat.messages,
            tools=chat.tools,
            chat_template=chat.chat_template,
            kwargs=template_kwargs(state, chat.chat_template_kwargs),
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
        )
        token_ids = encode_prompt(state, prompt, chat.add_special_tokens)
        return_token_strs = chat.return_token_strs
    else:
        request = parse_body(TokenizeCompletionRequest, data)
        check_model(state, request.model)
        token_ids = encode_prompt(state, request.prompt, request.add_special_tokens)
        return_token_strs = request.return_token_strs
    token_strs = tokenizer.convert_ids_to_tokens(token_ids) if return_token_strs else None
    return {"count": len(token_ids), "max_model_len": state.engine.max_model_len, "tokens": token_ids,
            "token_strs": token_strs}  # fmt: skip


async def detokenize(state: ServerState, raw_request: Request) -> dict[str, Any]:
    request = parse_body(DetokenizeRequest, await read_json(raw_request))
    check_model(state, request.model)
    check_token_ids(state, request.tokens, "tokens")
    return {"prompt": state.engine.tokenizer.decode(request.tokens)}
