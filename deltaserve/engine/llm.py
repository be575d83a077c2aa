"""LLM: the offline API, shaped like vLLM's: LLM(model_dir, dtype=...).generate(prompts, SamplingParams(...)).

A prompt is a string, a list of token ids or {"prompt_token_ids": [...]} (or {"prompt": str}), as vLLM's (one
prompt or a list of them), optionally with vLLM's "multi_modal_data" ({"image": ..., "video": ...}; the prompt holds
the chat template's placeholders) and "cache_salt" (only prompts with the same salt share cached prefixes). All prompts
are submitted to the engine at once and run with continuous batching; results come back in input order.
LLM.enqueue / LLM.enqueue_chat add requests without running them and LLM.wait_for_completion runs them, as vLLM's
do (engine/offline_requests.py: one path for all four; request ids "0", "1", ... as vLLM counts them). The prefix
cache is on unless LLM(..., enable_prefix_caching=False); RequestOutput.num_cached_tokens says what it served, and
reset_prefix_cache() empties it. LLM.chat renders conversations with the chat template first; LLM.beam_search runs
vLLM's beam search over generate (engine/offline_beam.py). max_logprobs (vLLM's, default 20; -1: the vocabulary)
bounds every request's logprobs and prompt_logprobs, refused before any prompt runs.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from deltaserve.engine import metrics_snapshot, offline_beam
from deltaserve.engine.beam_search import BeamSearchOutput
from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.frontend import check_cache_salt
from deltaserve.engine.metrics_snapshot import Metric
from deltaserve.engine.offline_chat import chat_prompt
from deltaserve.engine.offline_requests import OfflineRequests, UseTqdm
from deltaserve.engine.offline_unsupported import UnsupportedOfflineMethods
from deltaserve.engine.prompts import (
    PromptType,
    check_no_lora,
    check_no_overrides,
    prompt_to_seq,
    salt_of,
    to_token_ids,
)
from deltaserve.engine.request import RequestOutput
from deltaserve.engine_config import EngineConfig
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.sampling_params import (
    ALL_LOGPROBS,
    MAX_LOGPROBS,
    BeamSearchParams,
    SamplingParams,
)
from deltaserve.speculative_config import SpeculativeConfig
from deltaserve.vllm_flags import check_engine_kwargs


class LLM(UnsupportedOfflineMethods):
    def __init__(
        self,
        model: str | Path,
        dtype: str = "auto",
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        disable_log_stats: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        """speculative_config: vLLM's dict ({"method": "mtp", "num_speculative_tokens": k, ...}), validated as vLLM
        validates it (deltaserve/speculative_config.py): the model is built with its MTP layer and that layer's KV.
        max_logprobs: vLLM's cap on a request's logprobs and prompt_logprobs (-1: the vocabulary), as the server's
        --max-logprobs. disable_log_stats: vLLM's, True by default offline as in vLLM; False keeps the metrics that
        get_metrics() returns. engine_kwargs: EngineConfig's fields (vLLM's EngineArgs names), and vLLM's others as
        `deltaserve serve` takes their flags (vllm_flags.py: logged, or refused by name)."""
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < ALL_LOGPROBS:
            raise ValueError(f"max_logprobs must be -1 (no cap: the vocabulary) or more, got {max_logprobs!r}")
        self.max_logprobs = max_logprobs
        # vLLM's engine keywords deltaserve does not implement (trust_remote_code, swap_space, ...): refused or logged
        # as the server's flags of those names are (vllm_flags.py); EngineConfig takes the rest
        engine_kwargs = check_engine_kwargs(engine_kwargs)
        config = EngineConfig(model=str(model), dtype=dtype, speculative_config=speculative_config, **engine_kwargs)
        self.engine = LLMEngine(config)
        self._requests = OfflineRequests(self.engine, max_logprobs)
        self.log_stats = not disable_log_stats

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's LLM.llm_engine: the engine (get_tokenizer(), has_unfinished_requests(),
        get_num_unfinished_requests() under vLLM's names)."""
        return self.engine

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the checkpoint's generation_config.json defaults (temperature, top_p, top_k,
        ...; the engine's generation_config setting picks the source), SamplingParams() where it sets none."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
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
        check_no_overrides(tokenization_kwargs, mm_processor_kwargs)
        self._add(prompts, sampling_params, priority)
        return self._requests.run(use_tqdm)

    def enqueue(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        lora_request: Any = None,
        priority: SequenceABC[int] | int | None = None,
        use_tqdm: UseTqdm = True,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """vLLM's LLM.enqueue: adds the prompts' requests as generate() would, checked and refused alike, without
        running the engine; their request ids ("0", "1", ... counted per LLM, as vLLM's). wait_for_completion() (or
        the next generate / chat) runs them. use_tqdm: a bar over the prompts being added (a bool, or vLLM's
        callable that makes the bar, as every method here takes it)."""
        check_no_lora(lora_request)
        check_no_overrides(tokenization_kwargs, mm_processor_kwargs)
        return self._add(prompts, sampling_params, priority, use_tqdm, desc="Adding requests")

    def _add(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
        priority: SequenceABC[int] | int | None,
        use_tqdm: UseTqdm = False,
        desc: str = "Adding requests",
    ) -> list[str]:
        """The prompts' requests added to the engine (sampling_params None: get_default_sampling_params(), as
        generate, enqueue and enqueue_chat take it); their ids."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._requests.add(prompts, sampling_params, priority, use_tqdm, desc=desc)

    def wait_for_completion(
        self, output_type: type | tuple[type, ...] | None = None, *, use_tqdm: UseTqdm = True
    ) -> list:
        """vLLM's LLM.wait_for_completion: runs the engine until every enqueued request finished; their
        RequestOutputs ordered by request id (the order they were enqueued in), [] when none was. output_type: the
        type(s) the outputs must be (None: any; deltaserve makes RequestOutputs only, no pooling outputs)."""
        types = output_type if isinstance(output_type, tuple) else (output_type,)
        if output_type is not None and not issubclass(RequestOutput, types):
            # checked before the run, so the refusal loses no output (vLLM asserts each output's type as it comes)
            raise TypeError(f"wait_for_completion: the outputs are RequestOutput, not {output_type!r}")
        return self._requests.run(use_tqdm)

    def _chat_prompts(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        chat_template: str | None,
        chat_template_content_format: str,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        tokenization_kwargs: dict[str, Any] | None,
        mm_processor_kwargs: dict[str, Any] | None,
    ) -> list[PromptType]:
        """Each conversation's prompt (its rendered text and token ids), as LLM.chat and LLM.enqueue_chat add it."""
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: the offline LLM.chat takes text messages only")
        check_no_overrides(tokenization_kwargs, None)
        # vLLM's conversation_to_seq: a non-empty list of message dicts is one conversation, anything else a list of
        # them (so [] is no conversation, and an empty result)
        conversations = [messages] if messages and all(isinstance(m, dict) for m in messages) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text, token_ids = chat_prompt(
                self.engine.tokenizer, conversation, chat_template, chat_template_content_format,
                add_generation_prompt, continue_final_message, tools, chat_template_kwargs,
            )  # fmt: skip
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return prompts

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or a batch of them, each rendered with the chat
        template (the tokenizer's, or `chat_template`) and generated as LLM.generate does (engine/offline_chat.py)."""
        check_no_lora(lora_request)
        prompts = self._chat_prompts(
            messages, chat_template, chat_template_content_format, add_generation_prompt, continue_final_message,
            tools, chat_template_kwargs, tokenization_kwargs, mm_processor_kwargs,
        )  # fmt: skip
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def enqueue_chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        priority: SequenceABC[int] | int | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """vLLM's LLM.enqueue_chat: the conversations rendered as LLM.chat renders them, added as LLM.enqueue adds
        prompts; their request ids."""
        check_no_lora(lora_request)
        prompts = self._chat_prompts(
            messages, chat_template, chat_template_content_format, add_generation_prompt, continue_final_message,
            tools, chat_template_kwargs, tokenization_kwargs, mm_processor_kwargs,
        )  # fmt: skip
        return self._add(prompts, sampling_params, priority, use_tqdm, desc="Adding conversations")

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
        if self._requests.pending:
            # each search step is a generate, which would also return the enqueued requests' outputs
            raise RuntimeError(
                f"beam_search: {len(self._requests.pending)} enqueued request(s) have not run; call "
                "wait_for_completion() first"
            )
        prompts = prompt_to_seq(prompts)
        offline_beam.check_beam_search_params(params)
        inputs = []
        for prompt in prompts:
            if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
                raise ValueError("multi_modal_data: deltaserve's beam search takes text prompts only")
            salt = salt_of(prompt)
            check_cache_salt(salt)
            text, token_ids = to_token_ids(self.engine, prompt)
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

    def get_metrics(self) -> list[Metric]:
        """vLLM's LLM.get_metrics: a snapshot of the vllm:* series (Counter, Gauge, Histogram, Vector records of
        engine/metrics_snapshot.py), the engine's from its stats now, the per-request counters over every request
        this LLM returned. Needs LLM(disable_log_stats=False), as in vLLM."""
        if not self.log_stats:
            raise AssertionError("Stat logging disabled")  # vLLM's assert and words (raised, so -O keeps it)
        return metrics_snapshot.snapshot(self.engine.stats(), self._requests.counts, self.engine.config.model)

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the ranks serving the model, tensor_parallel_size here (no pipeline or data parallelism, so
        include_dp changes nothing)."""
        return self.engine.config.tensor_parallel_size

    def reset_mm_cache(self) -> None:
        """vLLM's: clears the multimodal processor and encoder caches. deltaserve keeps none (each image and video
        is processed and encoded per request), so there is nothing to clear."""

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
