"""vLLM 0.26 LLM methods that deltaserve does not implement, taken with vLLM's signatures so a script that calls one
fails at that call with a NotImplementedError naming the method and why, not with an AttributeError.

sleep / wake_up (vLLM offloads or discards weights and KV cache, or pauses scheduling), collective_rpc / apply_model
(vLLM runs a function in every worker process on the live model), start_profile / stop_profile (vLLM's profiler
per worker, configured by profiler_config) and vLLM's RL weight-transfer methods (init_weight_transfer_engine,
start_weight_update, start_draft_weight_update, update_weights, finish_weight_update). The LLM inherits these.

The pooling methods (encode, embed, classify, score) raise the ValueError vLLM raises for a generative model, whose
runner is not "pooling": deltaserve runs these models as generative ones only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


def refuse(method: str, why: str) -> NoReturn:
    raise NotImplementedError(f"LLM.{method}: deltaserve does not implement it ({why})")


def refuse_pooling(method: str) -> NoReturn:
    """vLLM's error for a pooling method of a generative model (encode, embed and classify say LLM.encode(), as
    vLLM's, which run through it)."""
    raise ValueError(
        f"LLM.{method}() is only supported for pooling models. deltaserve runs the model as a generative model "
        "only (no pooling runner)."
    )


class UnsupportedOfflineMethods:
    """The refused methods of deltaserve.LLM."""

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        refuse("sleep", "no sleep mode: the weights and the KV cache stay where they are")

    def wake_up(self, tags: list[str] | None = None) -> None:
        refuse("wake_up", "no sleep mode to wake from")

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        refuse("collective_rpc", "its workers take no remote calls")

    def apply_model(self, func: Callable[..., Any]) -> list[Any]:
        refuse("apply_model", "no function runs inside its workers on the live model")

    def start_profile(self, profile_prefix: str | None = None) -> None:
        refuse("start_profile", "no engine profiler; wrap the calls in torch.profiler yourself, with "
               "DELTASERVE_PROFILE_LABELS=1 for the model's per-layer ranges")  # fmt: skip

    def stop_profile(self) -> None:
        refuse("stop_profile", "no engine profiler")

    def init_weight_transfer_engine(self, request: Any) -> None:
        refuse("init_weight_transfer_engine", "no weight transfer: the weights are loaded once, from the checkpoint")

    def start_weight_update(self) -> None:
        refuse("start_weight_update", "no weight transfer")

    def start_draft_weight_update(self) -> None:
        refuse("start_draft_weight_update", "no weight transfer")

    def update_weights(self, request: Any) -> None:
        refuse("update_weights", "no weight transfer")

    def finish_weight_update(self) -> None:
        refuse("finish_weight_update", "no weight transfer")

    def encode(
        self,
        prompts: Any,
        pooling_params: Any = None,
        *,
        use_tqdm: Any = True,
        lora_request: Any = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        refuse_pooling("encode")

    def embed(
        self,
        prompts: Any,
        *,
        use_tqdm: Any = True,
        pooling_params: Any = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        refuse_pooling("encode")

    def classify(
        self,
        prompts: Any,
        *,
        pooling_params: Any = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        refuse_pooling("encode")

    def score(
        self,
        data_1: Any,
        data_2: Any,
        /,
        *,
        use_tqdm: Any = True,
        pooling_params: Any = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[Any]:
        refuse_pooling("score")
