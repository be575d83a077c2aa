"""Stage package: sampler. Logits of one step + per-sequence sampling state -> next token ids (+ logprobs)."""

from deltaserve.sampler.sampler import (
    SAMPLING_EPS,
    Sampler,
    SamplerOutput,
    SequenceSamplingState,
    make_generator,
)

__all__ = ["SAMPLING_EPS", "Sampler", "SamplerOutput", "SequenceSamplingState", "make_generator"]
