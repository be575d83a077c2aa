"""Request send times for a finite `--request-rate`, with `vllm bench serve`'s gamma gaps and rescaling.

Gaps are Gamma(shape=burstiness, scale=1/(rate * burstiness)): burstiness 1 is Poisson, < 1 burstier,
> 1 more even, inf is constant spacing. The cumulative delays are then rescaled so the last request goes
out exactly at num_requests / rate, which removes the 1-2 % seed-to-seed drift of the raw gamma sum.
"""

from __future__ import annotations

import math

import numpy as np


def send_offsets(num_requests: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Seconds after the start of the dispatch loop at which each request is sent (non-decreasing)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return [float(x) for x in offsets]
