"""GPU only: once the engine has started, serving-like traffic compiles no Triton kernel.

The first H200 grid (benchmarks/results/grids/h200_first-35b-a3b-20261129.json) showed p99 TTFT of 11 s and a +82 %
drift re-run: kernels compiled (and MoE configs were re-picked) in the middle of serving, for specializations
the start-up warm-up never met — a sequence-count constexpr, batch-dependent integers Triton specializes on
(== 1, divisible by 16), slices whose pointers lost 16-byte alignment, and a warm-up that stopped at
max_model_len although a step may hold max_num_batched_tokens. Here requests of random lengths arrive while
others decode (mixed decode + prefill steps, chunked prompts, 1 to 8 sequences, steps longer than any one
sequence), and Triton's jit_cache_hook records every specialization first met in this process after
start-up: there must be none.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine_config import EngineConfig
from deltaserve.kernels import gdn_triton
from deltaserve.kernels._triton import num_tuned_keys
from deltaserve.runner import warmup
from deltaserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _staggered_traffic(engine: LLMEngine, num_requests: int, max_concurrency: int, seed: int) -> int:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    next_id = num_active = num_finished = num_steps = 0
    while num_finished < num_requests:
        while num_active < rng.randint(1, max_concurrency) and next_id < num_requests:
            prompt = [rng.randrange(10, vocab - 10) for _ in range(rng.randint(1, 170))]
            params = SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True, temperature=0.0)
            engine.add_request(f"r{next_id}", prompt, params)
            next_id += 1
            num_active += 1
        done = sum(1 for output in engine.step() if output.finished)
        num_finished += done
        num_active -= done
        num_steps += 1
    return num_steps


@pytest.mark.parametrize(("variant", "num_sms"), [("moe", None), ("dense", None), ("moe", 1)])
def test_serving_traffic_compiles_nothing_after_start_up(
    variant: str, num_sms: int | None, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """num_sms 1: the GDN scan's launch rule and the warm-up's probes count one SM, so a tiny model's calls of 1 to
    8 sequences pick every scan configuration (at the GPU's own count they all pick one): each compiled at start-up."""
    import triton

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if num_sms is not None:
        monkeypatch.setattr(gdn_triton, "sm_count", lambda device: num_sms)
        monkeypatch.setattr(warmup, "sm_count", lambda device: num_sms)
    config = EngineConfig(
        model=str(tiny_dirs[variant]),
        dtype="bfloat16",
        max_model_len=200,
        max_num_batched_tokens=256,  # above max_model_len: the warm-up must reach it with several sequences
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
    )
    engine = LLMEngine(config)
    compiles: list[str] = []

    def record(*, key: Any, repr: str, fn: Any, compile: Any, is_manual_warmup: bool, already_compiled: bool) -> None:
        compiles.append(repr)

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", record)
    tuned_before = num_tuned_keys()
    num_steps = _staggered_traffic(engine, num_requests=40, max_concurrency=8, seed=0)
    print(f"{variant}: {num_steps} steps after start-up, {len(compiles)} Triton specializations first met")
    assert compiles == [], "\n".join(c[:300] for c in compiles)
    assert num_tuned_keys() == tuned_before, "a step autotuned a key the warm-up had not tuned"
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
    assert stats.num_free_state_slots == stats.num_total_state_slots
