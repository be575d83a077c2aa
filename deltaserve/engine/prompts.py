"""vLLM's offline prompts made engine inputs, for LLM and LLMEngine alike: a prompt (a string, a token-id list, or a
TextPrompt / TokensPrompt dict with multi_modal_data and cache_salt) becomes its text, token ids and processed media;
vLLM's keywords deltaserve does not serve (lora_request, tokenization_kwargs, mm_processor_kwargs) are refused by
name."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, Any

from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.multimodal.offline import loaded_media

if TYPE_CHECKING:
    from deltaserve.engine.engine import LLMEngine

# vLLM's prompt forms: a string, a list of token ids, or a dict ({"prompt": ...} / {"prompt_token_ids": ...})
PromptType = str | list[int] | dict[str, Any]


def check_no_lora(lora_request: Any) -> None:
    """vLLM's lora_request keyword, as generate, chat and beam_search take it: None (or vLLM's per-prompt list of
    them) runs, anything else is refused."""
    if isinstance(lora_request, list | tuple) and all(item is None for item in lora_request):
        return
    if lora_request is not None:
        raise ValueError("lora_request: deltaserve serves no LoRA adapters")


def check_no_overrides(tokenization_kwargs: dict[str, Any] | None, mm_processor_kwargs: dict[str, Any] | None) -> None:
    """vLLM's tokenization_kwargs and mm_processor_kwargs: None or empty runs, anything else is refused by name."""
    if tokenization_kwargs:
        raise ValueError("tokenization_kwargs: the offline LLM tokenizes a text prompt as the server does")
    if mm_processor_kwargs:
        raise ValueError("mm_processor_kwargs: the offline LLM has no processor overrides")


def salt_of(prompt: PromptType) -> str | None:
    """A prompt's vLLM cache_salt (None for a string prompt or a dict without one)."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


def is_token_list(value: object) -> bool:
    """A non-empty list of ints: vLLM's token-id prompt (parse_dec_only_prompt's list form)."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def prompt_to_seq(prompts: PromptType | SequenceABC[PromptType]) -> SequenceABC[PromptType]:
    """vLLM's prompt_to_seq: a string, a dict or a non-empty list of token ids is one prompt; anything else is
    already a sequence of prompts (so [1, 2, 3] is one prompt, [[1, 2], [3]] two)."""
    if isinstance(prompts, str | dict) or is_token_list(prompts):
        return [prompts]  # type: ignore[list-item]
    return prompts  # type: ignore[return-value]


def to_token_ids(engine: LLMEngine, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(the prompt's text if it has one, its token ids): a string is encoded with special tokens, as the server
    encodes a completion prompt; a list of ints is the token ids themselves (vLLM's TokensPrompt)."""
    if isinstance(prompt, str):
        return prompt, engine.tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list):
        if not all(isinstance(t, int) for t in prompt):
            raise TypeError("Token prompt should be a list of integers")  # vLLM's words
        return None, list(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt.get("prompt"), list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError("Prompt text should be a string")  # vLLM's words
        return to_token_ids(engine, prompt["prompt"])
    raise TypeError(
        f"a prompt is a string, a list of token ids or a dict with prompt_token_ids, got {type(prompt).__name__}"
    )


def multimodal(engine: LLMEngine, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], MultimodalInput | None]:
    """(expanded token ids, the processed images and videos) for a prompt with multi_modal_data."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if not data:
        return token_ids, None
    processor = engine.frontend.mm_processor
    if processor is None:
        raise ValueError("this model serves text only (no vision tower): multi_modal_data is refused")
    media = loaded_media(data, processor.configs.video.fps or 2.0)
    return processor.process_loaded(token_ids, media)
