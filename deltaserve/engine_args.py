"""EngineArgs: vLLM's engine-arguments object, for scripts that build an engine from it.

vLLM's offline examples and many users' scripts start an engine this way (vllm/engine/arg_utils.py,
vllm/v1/engine/llm_engine.py in 0.26):

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args()))

or with keywords, `EngineArgs(model=..., max_model_len=...)`. The keywords are the offline LLM's: EngineConfig's fields
(vLLM's EngineArgs names) and vLLM's others, refused by name or logged as `deltaserve serve` takes their flags
(vllm_flags.py); `disable_log_stats` is vLLM's. The command line is `deltaserve serve`'s, so a flag means what it
means to the server: `--model` (or the positional MODEL; neither: the built-in tiny checkpoint on the CPU), the
engine's flags, and vLLM's other flags checked against the same table (api/cli.py, read only by the two methods
that parse a command line). The engine takes only the EngineConfig it builds (engine.LLMEngine.from_engine_args).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields
from typing import Any

from deltaserve.engine_config import EngineConfig
from deltaserve.vllm_flags import check_engine_kwargs

logger = logging.getLogger(__name__)


class EngineArgs:
    """vLLM's EngineArgs: the engine's settings by keyword; its attributes read them back (args.max_model_len)."""

    def __init__(self, model: str | None = None, disable_log_stats: bool = False, **kwargs: Any) -> None:
        self.model = model
        self.disable_log_stats = disable_log_stats
        self.kwargs = kwargs
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={value!r}" for name, value in self.kwargs.items())
        return f"EngineArgs(model={self.model!r}{', ' if shown else ''}{shown})"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """`deltaserve serve`'s flags on `parser` (returned, as vLLM's returns it)."""
        from deltaserve.api.cli_args import add_arguments

        add_arguments(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine settings `deltaserve serve` would build from these parsed flags (vLLM's other flags refused or
        logged as the server does); a start-up check that fails raises its ValueError."""
        from deltaserve.api import cli
        from deltaserve.api.compat import check_compat

        check_compat(args)
        model, device = cli.resolve_model(args)
        config = cli.build_engine_config(args, model, device)
        settings = {field.name: getattr(config, field.name) for field in fields(config) if field.name != "model"}
        return cls(model=model, disable_log_stats=bool(args.disable_log_stats), **settings)

    def create_engine_config(self, usage_context: Any = None) -> EngineConfig:
        """The EngineConfig of these settings (usage_context: vLLM's telemetry tag, taken and unused); vLLM's
        keywords of the table refused (ValueError) or logged, an unknown one a TypeError, as the offline LLM."""
        if self.model is None:
            raise ValueError("EngineArgs needs a model: EngineArgs(model='path/to/checkpoint')")
        return EngineConfig(model=str(self.model), **check_engine_kwargs(dict(self.kwargs)))


class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs: EngineArgs with enable_log_requests, which the engine takes and logs (deltaserve's
    server logs requests with its own flags)."""

    def __init__(self, model: str | None = None, enable_log_requests: bool = False, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.enable_log_requests = enable_log_requests
        if enable_log_requests:
            logger.info("enable_log_requests=True: accepted and logged; the engine logs no requests of its own")
