"""The GPU-only start-up and serving paths, run on the CPU with the CUDA calls stood in (tests/support/fake_cuda.py):
the cache budget from the GPU's memory figures, the warm-up (with its verify step while speculating), the decode and
verify CUDA graphs' capture and replay, pinned host copies and events. Each engine runs greedy requests on a trained
tiny checkpoint in fp32 and must emit the tokens of a plain CPU engine (the graphs' replays included)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from deltaserve.engine.llm import LLM
from deltaserve.runner import memory
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.support.fake_cuda import FakeCuda, fake_cuda

MIB = 2**20
UTILIZATION = 0.5
TOTAL = 2 * (memory.HEADROOM_BYTES + 24 * MIB)  # this engine's share leaves ~24 MiB above the headroom
PEAK = 3 * MIB  # the faked warm-up peak
BASE = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 64, "max_num_batched_tokens": 64}
CORPUS = (Path(__file__).parents[2] / "deltaserve" / "tiny" / "corpus.txt").read_text()
IDS = AutoTokenizer.from_pretrained(trained_model_dir("dense"))(CORPUS[:2000])["input_ids"]
TOGETHER = [IDS[0:9], IDS[10:30], IDS[70:95]]  # one batch: 3 rows replay the bucket of 4 (a padded row)
SHARED = IDS[200:248]  # a 48-token prompt: three full blocks of 16
PROMPTS = {
    "plain": TOGETHER,
    "mtp": TOGETHER,
    # the prompt, then two that extend it: both hit its prompt-end checkpoint (docs/prefix-caching.md)
    "prefix": [SHARED, SHARED + [9, 4], SHARED + [31]],
}
CONFIGS = {
    "plain": {"enable_prefix_caching": False},
    "mtp": {"enable_prefix_caching": False, "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}},
    "prefix": {"enable_prefix_caching": True},
}


CACHED = {"plain": [0, 0, 0], "mtp": [0, 0, 0], "prefix": [0, 48, 48]}  # num_cached_tokens of each request


@dataclass
class Served:
    name: str
    expected: list[list[int]]  # a plain CPU engine's tokens
    tokens: list[list[int]]  # the faked GPU engine's
    cached: list[int | None]  # num_cached_tokens of each faked request
    budgets: list[int]  # what cache_budget returned
    graph_bytes: int
    cuda: FakeCuda
    is_graphed: bool
    is_spec_graphed: bool


def _generate(llm: LLM, name: str) -> tuple[list[list[int]], list[int | None]]:
    """Greedy tokens and num_cached_tokens of the scenario's prompts: together in one batch, or for the prefix cache
    one at a time (the later ones find the first's checkpoint)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS[name]]
    batches = [[p] for p in prompts] if name == "prefix" else [prompts]
    outs = [out for batch in batches for out in llm.generate(batch, params, use_tqdm=False)]
    return [list(out.outputs[0].token_ids) for out in outs], [out.num_cached_tokens for out in outs]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def served(request: pytest.FixtureRequest) -> Served:
    name = request.param
    kwargs = {**BASE, **CONFIGS[name]}
    plain = LLM(trained_model_dir("dense"), **kwargs)
    expected, _ = _generate(plain, name)
    del plain
    budgets: list[int] = []
    cache_budget = memory.cache_budget
    with pytest.MonkeyPatch.context() as monkeypatch, fake_cuda(monkeypatch, TOTAL, PEAK) as cuda:

        def spy(runner, *args: int) -> int:  # noqa: ANN001 (the runner under construction)
            budgets.append(cache_budget(runner, *args))
            return budgets[-1]

        monkeypatch.setattr(memory, "cache_budget", spy)
        llm = LLM(trained_model_dir("dense"), gpu_memory_utilization=UTILIZATION, **kwargs)
        runner = llm.engine.runner
        _, graph_bytes = memory.graph_bytes(runner, runner.max_num_seqs)
        tokens, cached = _generate(llm, name)
    return Served(name, expected, tokens, cached, budgets, graph_bytes, cuda, runner.is_graphed, runner.is_spec_graphed)


def test_the_cache_budget_comes_from_the_faked_gpu_memory(served: Served) -> None:
    # weights 0 (nothing allocated), the faked peak, the graphs' static buffers and the fixed headroom out of the
    # engine's share
    share = math.ceil(TOTAL * UTILIZATION)
    assert served.budgets == [share - PEAK - served.graph_bytes - memory.HEADROOM_BYTES]
    assert served.graph_bytes > 0


def test_graphs_are_captured_and_replayed_and_the_tokens_are_the_cpu_engines(served: Served) -> None:
    assert served.tokens == served.expected
    assert served.is_graphed != served.is_spec_graphed  # decode graphs, or verify graphs while speculating
    assert served.cuda.captures > 0 and served.cuda.replays > 0  # the served decode/verify steps replayed
    assert served.cuda.events > 0  # the sampled tokens' host copies were marked by events


def test_the_prefix_cache_serves_the_shared_prompt_under_the_graphs(served: Served) -> None:
    assert served.cached == CACHED[served.name]
