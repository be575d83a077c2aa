"""On the GPU: the verify CUDA graphs (runner/spec_graphs.py) capture, and their replays give the tokens of the
same static-buffer forward run uncaptured (bf16 and fp32: the same kernels on the same shapes, so bit for bit) and,
in fp32, of the eager verify path (--enforce-eager), on the trained tiny checkpoints with their MTP heads drafting,
k = 3, greedy and seeded requests of different lengths (rows padded below k, batches padded to their bucket).
With the k policy's batch rule moving k between 0 and 3, the width-1 graphs of the all-decode steps without verify
chunks capture and replay too, with the same two comparisons. The CPU proves the uncaptured paths against eager and
against no speculation (tests/runner/test_spec_graphs.py, tests/runner/test_spec_width_one_graphs.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run

CONFIG = {"max_num_seqs": 8, "max_model_len": 256, "gpu_memory_utilization": 0.3}
SPEC = {"method": "mtp", "num_speculative_tokens": 3}
# 5 decodes x (1 + 1) > 5: k 0 (width-1 graphs) until the batch is down to 2 (k 1) and 1 (k 3)
POLICY = {**SPEC, "k_policy": {"max_batch_tokens": 5, "token_cost": 0.0}}
MAX_TOKENS = (9, 17, 6, 20, 12)


def params() -> list[SamplingParams]:
    kinds = [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95, "seed": 3}]
    return [SamplingParams(max_tokens=m, ignore_eos=True, **kinds[i % 2]) for i, m in enumerate(MAX_TOKENS)]


def tokens_of(variant: str, dtype: str, mode: str, spec: dict = SPEC) -> tuple[list[list[int]], int]:
    """mode: "captured" (the default engine), "uncaptured" (the static-buffer forward without capture) or "eager"
    (--enforce-eager). Returns the tokens and the steps the graph path ran (under the k policy: the width-1 graphs'
    steps)."""
    llm = LLM(trained_model_dir(variant), dtype=dtype, speculative_config=spec, enforce_eager=mode == "eager",
              **CONFIG)  # fmt: skip
    runner = llm.engine.runner
    if mode == "eager":
        assert runner.spec_graphs is None
    else:
        assert runner.spec_graphs is not None and runner.spec_graphs.is_captured
        if mode == "uncaptured":
            runner._use_spec_graphs(capture=False)
    graph_steps = [0]
    counted = runner.spec_graphs if "k_policy" not in spec else runner.spec_decode_graphs
    if counted is not None:
        replay = counted.run

        def counting_run(*args):  # noqa: ANN002, ANN202 (VerifyGraphs.run's signature)
            graph_steps[0] += 1
            return replay(*args)

        counted.run = counting_run
    prompts = make_prompts(llm)[: len(MAX_TOKENS)]
    tokens = [list(o.token_ids) for o in run(llm, prompts, params())]
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, graph_steps[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_replay_equals_uncaptured_forward(variant: str, dtype: str) -> None:
    captured, steps = tokens_of(variant, dtype, "captured")
    uncaptured, _ = tokens_of(variant, dtype, "uncaptured")
    assert steps > 0 and captured == uncaptured


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_replay_equals_eager_in_fp32(variant: str) -> None:
    captured, steps = tokens_of(variant, "float32", "captured")
    eager, _ = tokens_of(variant, "float32", "eager")
    assert steps > 0 and captured == eager


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_width_one_replay_equals_uncaptured_and_eager(variant: str) -> None:
    captured, steps = tokens_of(variant, "float32", "captured", POLICY)
    uncaptured, _ = tokens_of(variant, "float32", "uncaptured", POLICY)
    eager, _ = tokens_of(variant, "float32", "eager", POLICY)
    assert steps > 0 and captured == uncaptured == eager


ASYNC = {**SPEC, "async_verify": True}  # chained chunks: planned behind their verify in flight, moved on the device


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_async_verify_replays_equal_eager_and_the_greedy_rows_equal_no_speculation(variant: str) -> None:
    """Async verify on the GPU (docs/speculative-decoding.md#async-verify): captured replays of chained steps equal
    the eager path in fp32 (the shift moves the static buffers as it moves the eager inputs), and the greedy rows
    equal those of the default engine without async_verify (the seeded rows never chain, but their drafts come from
    other batches, so they are compared within an engine only)."""
    captured, steps = tokens_of(variant, "float32", "captured", ASYNC)
    eager, _ = tokens_of(variant, "float32", "eager", ASYNC)
    without, _ = tokens_of(variant, "float32", "captured")
    assert steps > 0 and captured == eager
    assert captured[0::2] == without[0::2]
