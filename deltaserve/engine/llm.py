"""LLM: the offline API, shaped like vLLM's: LLM(model_dir, dtype=...).generate(prompts, SamplingParams(...)).

A prompt is a string or {"prompt_token_ids": [...]} (or {"prompt": str}), optionally with vLLM's
"multi_modal_data" ({"image": ..., "video": ...}; the prompt holds the chat template's placeholders) and
"cache_salt" (only prompts with the same salt share cached prefixes). All prompts
are submitted to the engine at once and run with continuous batching; results come back in input order. The prefix
cache is on unless LLM(..., enable_prefix_caching=False); RequestOutput.num_cached_tokens says what it served, and
reset_prefix_cache() empties it. LLM.chat renders conversations with the chat template first; LLM.beam_search runs
vLLM's beam search over generate (engine/offline_beam.py). max_logprobs (vLLM's, default 20; -1: the vocabulary)
bounds every request's logprobs and prompt_logprobs, refused before any prompt runs.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from deltaserve.engine import offline_beam
from deltaserve.engine.beam_search import BeamSearchOutput
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.frontend import check_cache_salt, check_priority
from deltaserve.engine.offline_chat import chat_prompt
from deltaserve.engine.request import RequestOutput
from deltaserve.engine_config import EngineConfig
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.multimodal.offline import loaded_media
from deltaserve.sampling_params import (
    ALL_LOGPROBS,
    MAX_LOGPROBS,
    BeamSearchParams,
    SamplingParams,
    logprobs_cap_error,
)
from deltaserve.speculative_config import SpeculativeConfig

PromptType = str | dict[str, Any]


def check_no_lora(lora_request: Any) -> None:
    """vLLM's lora_request keyword, as generate, chat and beam_search take it: None runs, anything else is refused."""
    if lora_request is not None:
        raise ValueError("lora_request: deltaserve serves no LoRA adapters")


def salt_of(prompt: PromptType) -> str | None:
    """A prompt's vLLM cache_salt (None for a string prompt or a dict without one)."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


class LLM:
    def __init__(
        self,
        model: str | Path,
        dtype: str = "auto",
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        **engine_kwargs: Any,
    ) -> None:
        """speculative_config: vLLM's dict ({"method": "mtp", "num_speculative_tokens": k, ...}), validated as vLLM
        validates it (deltaserve/speculative_config.py): the model is built with its MTP layer and that layer's KV.
        max_logprobs: vLLM's cap on a request's logprobs and prompt_logprobs (-1: the vocabulary), as the server's
        --max-logprobs."""
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < ALL_LOGPROBS:
            raise ValueError(f"max_logprobs must be -1 (no cap: the vocabulary) or more, got {max_logprobs!r}")
        self.max_logprobs = max_logprobs
        config = EngineConfig(model=str(model), dtype=dtype, speculative_config=speculative_config, **engine_kwargs)
        self.engine = LLMEngine(config)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the checkpoint's generation_config.json defaults (temperature, top_p, top_k,
        ...; the engine's generation_config setting picks the source), SamplingParams() where it sets none."""
        return SamplingParams(**self.engine.default_sampling)

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._to_token_ids(prompt["prompt"])
        raise TypeError(f"a prompt is a string or a dict with prompt_token_ids, got {type(prompt).__name__}")

    def _multimodal(self, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], MultimodalInput | None]:
        """(expanded token ids, the processed images and videos) for a prompt with multi_modal_data."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return token_ids, None
        processor = self.engine.frontend.mm_processor
        if processor is None:
            raise ValueError("this model serves text only (no vision tower): multi_modal_data is refused")
        media = loaded_media(data, processor.configs.video.fps or 2.0)
        expanded, mm_input = processor.process_loaded(token_ids, media)
        return expanded, mm_input

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: SequenceABC[int] | int | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """priority: one per prompt, or one value for every prompt, as vLLM's LLM.generate takes it (needs
        scheduling_policy="priority" for any value but 0; lower runs first). vLLM's other keywords are taken, and
        refused by name when set: deltaserve serves no LoRA adapter, tokenizes a text prompt as the server does and
        has no processor overrides (a caller that passes them as None, as lm-eval passes lora_request, runs).
        sampling_params None: get_default_sampling_params()."""
        check_no_lora(lora_request)
        if tokenization_kwargs:
            raise ValueError("tokenization_kwargs: the offline LLM tokenizes a text prompt as the server does")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: the offline LLM has no processor overrides")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        if priority is None or isinstance(priority, int):
            priorities = [priority or 0] * len(prompts)
        else:
            priorities = list(priority)
        if len(priorities) != len(prompts):
            raise ValueError("The lengths of prompts and priority must be the same.")
        for value in priorities:  # before any prompt is added: a refusal leaves nothing behind
            check_priority(value, self.engine.config.scheduling_policy)
        for params in params_list:
            error = logprobs_cap_error(params.logprobs, params.prompt_logprobs, self.max_logprobs,
                                       self.engine.frontend.vocab_size)  # fmt: skip
            if error is not None:
                raise ValueError(error[0])
        for prompt in prompts:
            check_cache_salt(salt_of(prompt))
        request_ids = []
        for prompt, params, request_priority in zip(prompts, params_list, priorities, strict=True):
            text, token_ids = self._to_token_ids(prompt)
            token_ids, mm_input = self._multimodal(prompt, token_ids)
            request_id = uuid.uuid4().hex
            salt = salt_of(prompt)
            self.engine.add_request(
                request_id, token_ids, params, prompt=text, mm_input=mm_input, priority=request_priority,
                cache_salt=salt,
            )  # fmt: skip
            request_ids.append(request_id)
        states = {rid: self.engine.requests[rid] for rid in request_ids}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as progress:
            try:
                while self.engine.has_unfinished():
                    for output in self.engine.step():
                        if output.finished:
                            progress.update(1)
            except BaseException:
                # a step that raised (a model error, Ctrl-C) leaves its requests scheduled with no step in flight:
                # abort them so they free their blocks and slots and the next call does not wait on them forever
                for request_id in request_ids:
                    if request_id in self.engine.requests:
                        self.engine.abort_request(request_id)
                raise
        return [states[rid].final_output() for rid in request_ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or a batch of them, each rendered with the chat
        template (the tokenizer's, or `chat_template`) and generated as LLM.generate does (engine/offline_chat.py)."""
        check_no_lora(lora_request)
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: the offline LLM.chat takes text messages only")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[PromptType] = []
        for conversation in conversations:
            text, token_ids = chat_prompt(
                self.engine.tokenizer, conversation, chat_template, chat_template_content_format,
                add_generation_prompt, continue_final_message, tools, chat_template_kwargs,
            )  # fmt: skip
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: SequenceABC[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the params.beam_width best sequences of each prompt (a string, {"prompt": ...}
        or {"prompt_token_ids": [...]}, optionally with "cache_salt"), one step per token, each step one batched
        generate over every live beam (engine/offline_beam.py). Refuses lora_request, multi_modal_data and
        structured_outputs by name; a width whose 2 * width logprobs exceed max_logprobs is refused as generate
        refuses it."""
        check_no_lora(lora_request)
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        offline_beam.check_beam_search_params(params)
        inputs = []
        for prompt in prompts:
            if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
                raise ValueError("multi_modal_data: deltaserve's beam search takes text prompts only")
            salt = salt_of(prompt)
            check_cache_salt(salt)
            text, token_ids = self._to_token_ids(prompt)
            token_input: dict[str, Any] = {"type": "token", "prompt_token_ids": token_ids}
            if text is not None:
                token_input["prompt"] = text
            if salt is not None:
                token_input["cache_salt"] = salt
            inputs.append(token_input)
        return offline_beam.beam_search(
            self.generate, self.engine.tokenizer, inputs, params, use_tqdm=use_tqdm, concurrency_limit=concurrency_limit
        )

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Drops every cached KV block and GDN state checkpoint (vLLM's LLM.reset_prefix_cache), so the next prompt
        is computed in full; True when all were dropped. No request runs between two generate() calls, so
        reset_running_requests changes nothing here; there is no KV connector to reset."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker processes (tensor_parallel_size > 1); a no-op otherwise. They stop by
        themselves when the LLM is garbage-collected or the interpreter exits."""
        self.engine.shutdown()

    def prefill_logits(
        self, token_ids: list[int], prefill_chunks: list[int] | None = None, mm_input: MultimodalInput | None = None
    ) -> torch.Tensor:
        """Logits [L, V] (fp32, on the CPU) of every position of token_ids: prefill chunks of the given sizes
        (default: one chunk of everything), then decode steps, as one prefill-only request through the scheduler
        and the runner. `mm_input`: the processor's images and videos for the prompt at the head of token_ids
        (the runner encodes them and applies their MRoPE table, as for a request). Needs an idle engine."""
        return self.engine.prefill_logits(token_ids, prefill_chunks, mm_input)
