"""vLLM 0.26 LLM methods that deltaserve does not implement, taken with vLLM's signatures so a script that calls one
fails at that call with a NotImplementedError naming the method and why, not with an AttributeError.

sleep / wake_up (vLLM offloads or discards weights and KV cache, or pauses scheduling), collective_rpc / apply_model
(vLLM runs a function in every worker process on the live model) and start_profile / stop_profile (vLLM's profiler
per worker, configured by profiler_config). The LLM inherits these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


def refuse(method: str, why: str) -> NoReturn:
    raise NotImplementedError(f"LLM.{method}: deltaserve does not implement it ({why})")


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
