"""On the GPU: the start-up warm-up's measured peak holds the verify step (runner/verify_warmup.py): with
speculation the peak is at least the verify step's own (its target forward over B rows of 1 + k tokens, the
sampler and the accept rule, the MTP drafter's passes), which is more than the verify step's sampling side alone,
and more than the peak of the same warm-up without speculation. On the CPU: tests/runner/test_warmup.py."""

from __future__ import annotations

import dataclasses
import gc
import logging

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.runner.verify_warmup import PeakMeter, warm_up_verify
from deltaserve.runner.warmup import drop_cache, profile_peak_bytes, warm_up_verify_sampling
from deltaserve.tiny.trained import trained_model_dir

MAX_LEN = 512  # also max_num_batched_tokens: the verify step's 128 chunks of 1 + k = 4 tokens fill it
ROWS = 128  # max_num_seqs, and the largest verify bucket at k = 3 (warm_up_verify_sampling's rows)


@pytest.mark.gpu
def test_the_warmup_peak_holds_the_verify_step(caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM(trained_model_dir("moe"), dtype="bfloat16", max_num_seqs=ROWS, max_model_len=MAX_LEN,
              max_num_batched_tokens=MAX_LEN, gpu_memory_utilization=0.3,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})  # fmt: skip
    runner = llm.engine.runner  # its caches are replaced by the warm-ups' throw-away ones below: not used after
    # as at start-up: no verify graphs yet (the warm-up's steps run eager) and no cache (the budget estimate that
    # caps the verify step's rows sees only the weights)
    runner.spec_graphs = None
    drop_cache(runner.model)
    gc.collect()
    torch.cuda.empty_cache()
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.warmup"):
        with_spec = profile_peak_bytes(runner, MAX_LEN, MAX_LEN, ROWS)
    assert f"a verify step of {ROWS} rows of 4 tokens with drafts and the MTP drafter" in caplog.text
    meter = PeakMeter(runner.device)
    meter.mark()
    warm_up_verify_sampling(runner.sampler, ROWS, 3, runner.vocab_size, runner.device)
    sampling_only = meter.peak()
    warm_up_verify(runner, ROWS, meter)
    verify_step = meter.peak()
    drop_cache(runner.model)
    # (1 MiB: a library workspace the first run allocated inside the warm-up is already there for the second)
    assert with_spec >= verify_step - 2**20 and verify_step > sampling_only, (with_spec, verify_step, sampling_only)
    config = runner.engine_config
    runner.engine_config = dataclasses.replace(config, speculative_config=None)
    without_spec = profile_peak_bytes(runner, MAX_LEN, MAX_LEN, ROWS)
    runner.engine_config = config
    assert with_spec > without_spec, (with_spec, without_spec)
