"""vLLM serve flags that deltaserve accepts only so that launch scripts keep working unchanged.

Each is either harmless here (logged at startup as ignored) or, when it asks for something deltaserve cannot do
(pipeline or data parallelism), refused with a clear message instead of being silently dropped. Tensor parallelism
(--tensor-parallel-size, --distributed-executor-backend, --enable-expert-parallel) is a real flag of api/cli.py.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)

# Flags with a value: (flag, aliases, help). Their value is logged as ignored when given.
VALUE_FLAGS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("--kv-cache-dtype", (), "the engine chooses the KV-cache dtype"),
    ("--mamba-ssm-cache-dtype", (), "the engine chooses the recurrent-state dtype"),
    ("--speculative-config", (), "speculative decoding is not configurable from serve"),
    ("--max-cudagraph-capture-size", (), "largest CUDA-graph batch; deltaserve picks its own buckets"),
    ("--limit-mm-per-prompt", (), "multimodal limits; deltaserve serves the language model only"),
    ("--mm-encoder-tp-mode", (), "vision-encoder parallelism; there is no vision encoder"),
    ("--max-logprobs", (), "deltaserve caps logprobs at 20, as vLLM does by default"),
    ("--swap-space", (), "CPU swap space is not used"),
    ("--compilation-config", ("-O",), "torch.compile config; deltaserve does not use torch.compile"),
    ("--hf-overrides", (), "config overrides; not supported"),
)
# Switches: logged as ignored when given.
SWITCHES: tuple[tuple[str, str], ...] = (
    ("--trust-remote-code", "deltaserve implements the architectures itself and runs no checkpoint code"),
    ("--enable-prefix-caching", "prefix caching is not configurable from serve"),
    ("--no-enable-prefix-caching", "prefix caching is not configurable from serve"),
    ("--enable-chunked-prefill", "prefill chunking follows --max-num-batched-tokens"),
    ("--no-enable-chunked-prefill", "prefill chunking follows --max-num-batched-tokens"),
    ("--disable-log-requests", "requests are not logged"),
    ("--enable-log-requests", "requests are not logged"),
    ("--disable-log-stats", "stats are exported on /metrics"),
    ("--enable-prompt-tokens-details", "usage has no prompt_tokens_details"),
    ("--disable-fastapi-docs", "the docs routes stay"),
)
# Parallelism deltaserve does not have: anything above 1 is refused.
PARALLEL_FLAGS: tuple[tuple[str, str], ...] = (
    ("--pipeline-parallel-size", "-pp"),
    ("--data-parallel-size", "-dp"),
)


def _dest(flag: str) -> str:
    return "compat_" + flag.lstrip("-").replace("-", "_")


def add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("accepted for vLLM compatibility (no effect in deltaserve)")
    for flag, aliases, help_text in VALUE_FLAGS:
        group.add_argument(
            flag, *aliases, dest=_dest(flag), default=None, metavar="VALUE", help=f"ignored: {help_text}"
        )
    for flag, help_text in SWITCHES:
        group.add_argument(flag, dest=_dest(flag), action="store_true", help=f"ignored: {help_text}")
    for flag, alias in PARALLEL_FLAGS:
        group.add_argument(
            flag, alias, dest=_dest(flag), type=int, default=1, metavar="N", help="must be 1 (tensor parallelism only)"
        )


def check_compat(args: argparse.Namespace) -> None:
    """Refuses parallelism deltaserve cannot honour (ValueError) and logs every ignored flag that was given."""
    for flag, _ in PARALLEL_FLAGS:
        if getattr(args, _dest(flag)) != 1:
            raise ValueError(
                f"{flag} {getattr(args, _dest(flag))}: deltaserve has tensor parallelism only "
                "(--tensor-parallel-size); pipeline and data parallelism are not supported"
            )
    for flag, _, help_text in VALUE_FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None:
            logger.warning("ignoring %s %s: %s", flag, value, help_text)
    for flag, help_text in SWITCHES:
        if getattr(args, _dest(flag)):
            logger.info("ignoring %s: %s", flag, help_text)
