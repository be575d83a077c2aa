"""vLLM's skip_reading_prefix_cache (offline SamplingParams): True looks nothing up (no hit, no query counted) while
the request's own blocks and checkpoints are still cached for later ones; None resolves to "asks prompt_logprobs",
as vLLM's; False with prompt_logprobs is refused by name (deltaserve reports every prompt position)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from tests.support.engines import share

TEXT = "the sea and the river and the long road home " * 12


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, **kwargs)


def test_defaults_and_the_refusal() -> None:
    assert SamplingParams().skip_reading_prefix_cache is False
    assert SamplingParams(prompt_logprobs=1).skip_reading_prefix_cache is True
    assert SamplingParams(skip_reading_prefix_cache=True).skip_reading_prefix_cache is True
    with pytest.raises(ValueError, match="skip_reading_prefix_cache=False is not supported with prompt_logprobs"):
        SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)


def test_a_skipping_request_reads_nothing_and_still_writes(tiny_dense: Path) -> None:
    llm = LLM(tiny_dense, dtype="float32", enable_prefix_caching=True, **share())

    def one(text: str, **kwargs: object) -> tuple[list[int], int]:
        (output,) = llm.generate([text], greedy(**kwargs), use_tqdm=False)
        return list(output.outputs[0].token_ids), output.num_cached_tokens

    def queries() -> int:
        return llm.llm_engine.scheduler.prefix_cache_queries

    written, cached = one(TEXT, skip_reading_prefix_cache=True)  # the first: writes its checkpoints
    assert cached == 0
    before = queries()
    skipped, cached = one(TEXT, skip_reading_prefix_cache=True)
    assert (skipped, cached) == (written, 0) and queries() == before  # no lookup, no query counted
    read, cached = one(TEXT)
    assert read == written and cached > 0 and queries() > before  # the skipping requests' blocks were cached
