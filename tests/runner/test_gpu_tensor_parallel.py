"""On two GPUs (nvidia-h200-x2): tensor parallelism over NCCL with the decode CUDA graphs capturing the collectives.

TP=2 gives TP=1's greedy and seeded tokens in fp32 through the graphs (async scheduling, waves of requests, padded
buckets), every rank captured its graphs, the workers run with NVLink multicast off, and eager TP=2 equals graphed
TP=2; MTP speculative decoding at TP=2 keeps one GPU's greedy tokens. Skipped below two GPUs. On one GPU: TP=1 steps
the ModelRunner itself (no worker, no process group), and the MoE block's fused op (with its TP all-reduce a no-op)
gives eager's tokens through the graphs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deltaserve import env
from deltaserve.engine.llm import LLM
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run

from .test_gpu_async import _workload

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)
CONFIG = {"dtype": "float32", "max_num_seqs": 16, "max_model_len": 256, "gpu_memory_utilization": 0.3}


@pytest.mark.gpu
def test_one_gpu_steps_the_runner_itself(tiny_moe: Path) -> None:
    outputs = []
    for eager in (False, True):
        llm = LLM(tiny_moe, enforce_eager=eager, **CONFIG)
        try:
            runner = llm.engine.runner
            # the executor interface costs nothing at TP=1: the engine core calls the runner in its own process
            assert type(runner) is ModelRunner and runner.tp.size == 1 and not torch.distributed.is_initialized()
            assert (runner.graphs is None) == eager and runner.device.type == "cuda"
            outputs.append(_workload(llm))
        finally:
            llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_two_gpus_give_the_tokens_of_one(variant: str, tiny_dirs: dict[str, Path]) -> None:
    model = tiny_dirs[variant]
    one = LLM(model, **CONFIG)
    expected = _workload(one)
    one.shutdown()
    del one
    torch.cuda.empty_cache()
    two = LLM(model, tensor_parallel_size=2, **CONFIG)
    try:
        runner = two.engine.runner
        assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8, 16]
        assert str(runner.device) == "cuda:0" and len(runner.pids) == 1
        assert all(os.environ[name] == value for name, value in env.NVLINK_MULTICAST_OFF.items())
        assert _workload(two) == expected
    finally:
        two.shutdown()


@pytest.mark.gpu
@needs_two_gpus
def test_graphed_and_eager_two_gpu_decode_agree(tiny_moe: Path) -> None:
    outputs = []
    for eager in (False, True):
        llm = LLM(tiny_moe, tensor_parallel_size=2, enforce_eager=eager, **CONFIG)
        try:
            outputs.append(_workload(llm))
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@needs_two_gpus
def test_bfloat16_two_gpus_serve_with_expert_parallelism(tiny_moe: Path) -> None:
    """bf16 with whole experts per GPU: it runs through the graphs and keeps TP=1's tokens on most requests (bf16
    rounding of the split sums may flip near-ties on the random tiny model; scripts/tp_token_compare.py reports
    the margins)."""
    config = {**CONFIG, "dtype": "bfloat16"}
    one = LLM(tiny_moe, **config)
    expected = _workload(one)
    one.shutdown()
    del one
    torch.cuda.empty_cache()
    llm = LLM(tiny_moe, tensor_parallel_size=2, enable_expert_parallel=True, **config)
    try:
        got = _workload(llm)
    finally:
        llm.shutdown()
    assert len(got) == len(expected) and all(len(a) == len(b) for a, b in zip(got, expected, strict=True))
    assert sum(a == b for a, b in zip(got, expected, strict=True)) >= len(expected) // 2


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_mtp_at_two_gpus_gives_the_greedy_tokens_of_one(variant: str) -> None:
    """MTP speculative decoding (k = 3) at TP=2 over NCCL: rank 0's accept broadcast and the draft logits gathered on
    both GPUs (runner/spec_ranks.py) give one GPU's greedy tokens without speculation, with drafts accepted."""
    model = trained_model_dir(variant)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one = LLM(model, **CONFIG)
    prompts = make_prompts(one)
    expected = [list(o.token_ids) for o in run(one, prompts, params)]
    one.shutdown()
    del one
    torch.cuda.empty_cache()
    config = {"method": "mtp", "num_speculative_tokens": 3}
    two = LLM(model, tensor_parallel_size=2, speculative_config=config, **CONFIG)
    try:
        assert [list(o.token_ids) for o in run(two, prompts, params)] == expected
        assert two.engine.stats().spec_decode_num_accepted_tokens > 0
    finally:
        two.shutdown()
