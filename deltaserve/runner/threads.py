"""Torch's CPU threads in a process that serves on a GPU: one, once start-up is done, as vLLM's workers do
(vllm-project/vllm#49919; docs/multimodal.md#speed-under-image-traffic).

Why: torch sizes its intra-op pool to the host's cores, and any CPU op above its parallel grain (32K elements) fans
out over that pool, whose OpenMP workers then spin-wait after the region, taking cycles from the step loop's own
Python. A serving step still runs such ops on the host: an image step concatenates and pins its patch rows (1.5M
values for one 512x512 image) and builds the tower's RoPE tables; vLLM traced a 2-6x structured-output decode
slowdown to the same pattern. Loading and warm-up keep torch's choice (they run before this is applied). An explicit
OMP_NUM_THREADS or DELTASERVE_CPU_THREADS is left alone; the CPU device keeps the runner's own rule
(env.cpu_threads_for), since there torch's threads run the model itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

EXPLICIT = ("OMP_NUM_THREADS", "DELTASERVE_CPU_THREADS")  # a count named by the operator wins


def serving_threads(device_type: str, environ: Mapping[str, str] = os.environ) -> int | None:
    """The torch intra-op thread count for serving on `device_type`, or None to leave torch's setting alone."""
    if device_type != "cuda" or any(environ.get(name) for name in EXPLICIT):
        return None
    return 1


def apply_serving_threads(device_type: str) -> int | None:
    """Sets the serving thread count (serving_threads) in this process; returns it, or None when left alone."""
    threads = serving_threads(device_type)
    if threads is not None and torch.get_num_threads() != threads:
        logger.info("torch CPU threads for serving: %d (from %d; OMP_NUM_THREADS sets another)", threads,
                    torch.get_num_threads())  # fmt: skip
        torch.set_num_threads(threads)
    return threads
