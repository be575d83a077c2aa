"""On the GPU: async scheduling through the decode CUDA graphs (input tokens gathered on the device from the rows'
last samples) gives the tokens of the synchronous path, and the shared logits buffer serves every bucket."""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path

import pytest
import torch

from deltaserve import env
from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams


def _workload(llm: LLM) -> list[list[int]]:
    """Greedy and seeded requests with length-only stops (so both paths form the same batches), added in waves."""
    rng = random.Random(3)
    engine = llm.engine
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    collected: dict[str, list[int]] = {}
    pending = list(range(len(prompts)))
    while pending or engine.has_unfinished():
        for _ in range(3):
            if pending:
                i = pending.pop(0)
                kind = {"temperature": 0.0} if i % 2 else {"temperature": 0.9, "top_p": 0.9, "seed": i}
                engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=8 + i, ignore_eos=True, **kind))
        for output in engine.step(by_output_kind=False):
            collected.setdefault(output.request_id, []).extend(output.outputs[0].token_ids if output.outputs else [])
    return [collected[str(i)] for i in range(len(prompts))]


@pytest.mark.gpu
def test_async_graph_decode_matches_sync(tiny_dense: Path) -> None:
    config = {"dtype": "float32", "max_num_seqs": 16, "max_model_len": 256, "gpu_memory_utilization": 0.3}
    synchronous = LLM(tiny_dense, async_scheduling=False, **config)
    assert synchronous.engine.runner.graphs is not None
    sizes = synchronous.engine.runner.graphs.sizes
    assert sizes == [1, 2, 4, 8, 16]
    expected = _workload(synchronous)
    del synchronous
    gc.collect()
    torch.cuda.empty_cache()
    asynchronous = LLM(tiny_dense, async_scheduling=True, **config)
    got = _workload(asynchronous)
    del asynchronous
    gc.collect()
    torch.cuda.empty_cache()
    assert got == expected


@pytest.mark.gpu
def test_graph_decode_matches_eager(tiny_dense: Path) -> None:
    """The graph path (static buffers, dummy-row padding, shared logits) against eager decoding, greedy."""
    prompts = [[5 + i, 9, 11 + 2 * i] for i in range(5)]  # 5 sequences: the 8 bucket pads 3 rows
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for eager in (False, True):
        llm = LLM(tiny_dense, dtype="float32", max_num_seqs=8, max_model_len=128, gpu_memory_utilization=0.3,
                  enforce_eager=eager)  # fmt: skip
        result = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[eager] = [o.outputs[0].token_ids for o in result]
        del llm, result
        gc.collect()
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["tiny_dense", "tiny_moe"])
def test_pdl_decode_matches_plain_launches(variant: str, request: pytest.FixtureRequest) -> None:
    """KERNEL_NOTES C21: the decode-path kernels launched with programmatic dependent launch (the default on a
    Hopper GPU) give the tokens of plain launches, in bf16 through the decode graphs and the eager prefill steps
    (tests/kernels/test_pdl.py checks on the source what each kernel touches before its wait)."""
    checkpoint = request.getfixturevalue(variant)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    config = {"dtype": "bfloat16", "max_num_seqs": 16, "max_model_len": 256, "gpu_memory_utilization": 0.3}
    tokens = {}
    for value in ("1", "0"):
        with env.overridden("DELTASERVE_PDL", value):
            llm = LLM(checkpoint, **config)
            assert llm.engine.runner.graphs is not None
            tokens[value] = _workload(llm)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    assert tokens["1"] == tokens["0"]


@pytest.mark.gpu
def test_state_and_block_copies_do_not_wait_for_the_stream(tiny_dense: Path) -> None:
    """A prefix-cache hit's first step copies a checkpoint's state slot and partial KV block before its forward
    (runner/cache.py); their index tensors go through pinned memory, so launching them does not wait for the work
    already queued (a copy from pageable memory would: the host would sit out ~0.1 s of queued sleep here)."""
    from deltaserve.runner.cache import copy_kv_blocks, copy_state_slots

    llm = LLM(tiny_dense, max_model_len=256, gpu_memory_utilization=0.3)
    model = llm.engine.runner.model
    copy_state_slots(model, [(0, 1)])  # warm: the first pinned allocation may sync
    copy_kv_blocks(model, ((0, 1),))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the copies
    start = time.perf_counter()
    copy_state_slots(model, [(0, 1), (2, 3)])
    copy_kv_blocks(model, ((0, 1), (2, 3)))
    launched = time.perf_counter() - start
    torch.cuda.synchronize()
    waited = time.perf_counter() - start
    assert waited > 0.05, waited  # the sleep really was queued
    assert launched < waited / 2, (launched, waited)
