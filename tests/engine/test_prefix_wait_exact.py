"""Waiting for an in-flight prefix (docs/prefix-caching.md#waiting-for-an-in-flight-prefix) is exact and hits: requests
that arrive together sharing a prefix (ending inside a block, or on the GDN grid) wait for the first one's branch
checkpoint and resume from it, and their greedy tokens equal the cache-off engine's, fp32 on the CPU on the trained
tiny dense and MoE; in a small KV pool with every running sequence preempted before the first one reaches the
branch point, the waiters then run as usual and the tokens still match."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.runner.cache import bytes_per_block, bytes_per_slot
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_prefix_cache_exact import CORPUS, GREEDY, hits_of, make_llm

NUM_WAITERS = 4  # each wave: one request that computes the prefix, then these, all added in one go


def roomy_llm(model_dir: Path, is_on: bool) -> LLM:
    """A 512-token budget and room for every request of a wave: no preemption, no eviction."""
    config = ModelConfig.from_pretrained(model_dir)
    budget = 120 * bytes_per_block(config, 16, torch.float32) + 16 * bytes_per_slot(config, torch.float32)
    return LLM(
        model_dir, dtype="float32", device="cpu", max_model_len=400, max_num_seqs=8, max_num_batched_tokens=512,
        cpu_kv_cache_bytes=budget, enable_prefix_caching=is_on, async_scheduling=True,
    )  # fmt: skip


def waves(llm: LLM, preempt_at: int = -1) -> tuple[dict[str, list], dict[str, int]]:
    """Two waves of 1 + NUM_WAITERS requests, each added together: a prefix ending inside a block (150 tokens: the
    branch point is 128) and one ending on the GDN grid (192), each request with 20 tokens of its own."""
    tokens = llm.engine.tokenizer.encode(CORPUS)
    outputs, hits = {}, {}
    for name, start, length in (("mid-block", 0, 150), ("grid", 400, 192)):
        prefix = tokens[start : start + length]
        requests = {
            f"{name}{i}": (prefix + tokens[1000 + 20 * i : 1020 + 20 * i], GREEDY) for i in range(1 + NUM_WAITERS)
        }
        out, hits[name] = hits_of(llm, requests, preempt_at=preempt_at)
        outputs |= out
    return outputs, hits


@pytest.fixture(scope="module", params=["dense", "moe"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return trained_model_dir(request.param)


def test_requests_arriving_together_resume_from_the_first_ones_branch_point_with_the_same_tokens(
    model_dir: Path,
) -> None:
    off, off_hits = waves(roomy_llm(model_dir, False))
    on, on_hits = waves(roomy_llm(model_dir, True))
    assert on == off
    assert off_hits == {"mid-block": 0, "grid": 0}
    # every waiter hits the branch point (before the wait: only the requests admitted after the first step, here
    # none of the first four, since the budget admits them all in step 0)
    assert on_hits == {"mid-block": NUM_WAITERS * 128, "grid": NUM_WAITERS * 192}


def test_waiters_of_a_prefill_preempted_before_the_branch_point_run_with_the_same_tokens(model_dir: Path) -> None:
    # a 96-token budget: the first request has computed 96 tokens when everything running is preempted
    off, _ = waves(make_llm(model_dir, False, True), preempt_at=1)
    on_llm = make_llm(model_dir, True, True)
    on, hits = waves(on_llm, preempt_at=1)
    assert on == off
    assert on_llm.engine.scheduler.num_preemptions_total > 0 and hits["mid-block"] > 0
