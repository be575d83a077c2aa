"""Stage package: sampler. Logits of one step + a SamplingBatch of tensors -> next token ids (+ logprobs)."""

from deltaserve.sampler.batch import build_sampling_batch
from deltaserve.sampler.sampler import (
    SAMPLING_EPS,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    logprobs_to_host,
    make_generator,
    row_seed,
)

__all__ = [
    "SAMPLING_EPS",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "build_sampling_batch",
    "logprobs_to_host",
    "make_generator",
    "row_seed",
]
