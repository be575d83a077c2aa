"""The offline LLM.chat's prompt: one conversation of OpenAI-style messages -> the chat template's text -> token ids,
as vLLM's LLM.chat makes it for a Hugging Face tokenizer (the template rendered by the tokenizer's own
apply_chat_template, then encoded without special tokens: the template already wrote them).

Offline code is the caller's own, so the template runs in-process without the server's bounded sandbox
(api/template.py); the content rule is the server's: a message's text parts are joined with newlines (vLLM's
"string" content format, what "auto" picks for text on this family), or passed through as the list with
chat_template_content_format="openai". Image and video parts are refused by name: offline, images go through
LLM.generate with multi_modal_data.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

# The content parts vLLM's chat parser reads as text, and the field each keeps it in (a bare string in a content list
# is text too); a part whose text is missing or empty is dropped, as vLLM drops it (no empty line in the join).
TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                    "thinking": "thinking"}  # fmt: skip
TEXT_PART_TYPES = tuple(TEXT_PART_FIELDS)
CONTENT_FORMATS = ("auto", "string", "openai")
# apply_chat_template's own arguments: a chat_template_kwargs entry of the same name is dropped (the server drops
# them too, api/chat.py), so it cannot change how the template runs
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs",
    "return_assistant_tokens_mask",
})  # fmt: skip


def _content(content: Any, index: int, content_format: str) -> Any:
    """A message's content as the template gets it (see the module docstring)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}].content must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = "text" if isinstance(part, str) else part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES:
            raise ValueError(
                f"messages[{index}]: content part type {kind!r} is not supported by the offline LLM.chat (text "
                "parts only; pass images and videos to LLM.generate as multi_modal_data with the template's "
                "placeholders in the prompt)"
            )
        text = part if isinstance(part, str) else part.get(TEXT_PART_FIELDS[kind])
        if text:
            texts.append(str(text))
    if content_format == "openai":
        return [{"type": "text", "text": text} for text in texts]
    return "\n".join(texts)


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """(the rendered prompt, its token ids) of one conversation."""
    if chat_template_content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got "
            f"{chat_template_content_format!r}"
        )
    if add_generation_prompt and continue_final_message:
        # vLLM's words (its chat request validation)
        raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a list of message dicts (or a list of such lists)")
    conversation = [
        {**message, "content": _content(message.get("content"), index, chat_template_content_format)}
        for index, message in enumerate(messages)
    ]
    template_kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
    text = tokenizer.apply_chat_template(
        conversation,
        **template_kwargs,  # the template's own variables (enable_thinking, ...)
        tools=tools,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
    )
    return text, tokenizer.encode(text, add_special_tokens=False)
