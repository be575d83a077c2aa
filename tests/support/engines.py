"""The GPU memory share a test engine asks for: tests written for the CPU build several engines in one process, and
vLLM's default share (0.9 of the card, checked against the free memory at start-up) leaves no room for a second one
when the suite runs on cuda (`-m "gpu or not gpu"`)."""

from __future__ import annotations

import torch

TEST_SHARE = 0.08  # ~6 GiB of an 80 GiB card: ample for a tiny model's cache, room for ten engines alive at once


def share() -> dict[str, float]:
    """The engine options of a test engine: a small memory share where the engine lands on cuda, nothing on the CPU."""
    return {"gpu_memory_utilization": TEST_SHARE} if torch.cuda.is_available() else {}
