"""The offline LLM.generate(..., priority=[...]) of vLLM, on the tiny checkpoint with one running place."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.engine.frontend import RequestError
from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams


def test_priority_orders_the_offline_batch(tiny_dense: Path) -> None:
    llm = LLM(tiny_dense, dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(["a", "b", "c", "d"], params, use_tqdm=False, priority=[3, 0, 2, 0])
    started = sorted(range(4), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert started == [1, 3, 2, 0]  # lower value first, ties by arrival
    for mismatched in ([1], []):  # vLLM's test_multiple_priority: an empty list is refused too
        with pytest.raises(ValueError, match=r"The lengths of prompts \(2\) and priority \(\d\) must be the same\."):
            llm.generate(["a", "b"], params, use_tqdm=False, priority=mismatched)
    # one value for every prompt, and a single prompt with a one-item list (vLLM's test_single_prompt_priority)
    assert len(llm.generate(["a", "b"], params, use_tqdm=False, priority=1)) == 2
    assert len(llm.generate("a", params, use_tqdm=False, priority=[0])) == 1


def test_priority_needs_the_policy(tiny_dense: Path) -> None:
    llm = LLM(tiny_dense, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(RequestError, match=r"^Got priority 1 but Priority scheduling is not enabled\.$"):
        llm.generate(["a", "b"], params, use_tqdm=False, priority=[0, 1])
    assert not llm.engine.has_unfinished()
    (output,) = llm.generate(["a"], params, use_tqdm=False, priority=[0])
    assert len(output.outputs[0].token_ids) == 2
