"""The GPU-only start-up and serving paths, run on the CPU with the CUDA calls stood in (tests/support/fake_cuda.py):
the cache budget from the GPU's memory figures, the warm-up (with its verify step while speculating), the decode and
verify CUDA graphs' capture and replay, pinned host copies and events. Each engine runs greedy requests on a trained
tiny checkpoint in fp32 and must emit the tokens of a plain CPU engine (the graphs' replays included)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from deltaserve.engine.llm import LLM
from deltaserve.runner import memory, warmup
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams
from deltaserve.tiny.fp8 import write_fp8_checkpoint
from deltaserve.tiny.trained import trained_model_dir
from tests.support.fake_cuda import FakeCuda, fake_cuda
from tests.support.vision import PROMPTS as VISION_PROMPTS
from tests.support.vision import case_for, generate_together

MIB = 2**20
UTILIZATION = 0.5
TOTAL = 2 * (warmup.HEADROOM_BYTES + 24 * MIB)  # this engine's share leaves ~24 MiB above the headroom
PEAK = 3 * MIB  # the faked warm-up peak
BASE = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 64, "max_num_batched_tokens": 64}
CORPUS = (Path(__file__).parents[2] / "deltaserve" / "tiny" / "corpus.txt").read_text()
IDS = AutoTokenizer.from_pretrained(trained_model_dir("dense"))(CORPUS[:2000])["input_ids"]
TOGETHER = [IDS[0:9], IDS[10:30], IDS[70:95]]  # one batch: 3 rows replay the bucket of 4 (a padded row)
SHARED = IDS[200:248]  # a 48-token prompt: three full blocks of 16
# the prompt, then two that extend it, one at a time: both hit its prompt-end checkpoint (docs/prefix-caching.md)
EXTENDED = [SHARED, SHARED + [9, 4], SHARED + [31]]
OFF = {"enable_prefix_caching": False}
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}


@dataclass(frozen=True)
class Scenario:
    variant: str  # the trained tiny checkpoint (deltaserve/tiny/trained), "+fp8": its block-FP8 copy
    config: dict
    prompts: list[list[int]]
    cached: list[int]  # num_cached_tokens of each request


SCENARIOS = {
    "dense": Scenario("dense", OFF, TOGETHER, [0, 0, 0]),
    "dense-mtp": Scenario("dense", {**OFF, **MTP}, TOGETHER, [0, 0, 0]),
    "dense-prefix": Scenario("dense", {}, EXTENDED, [0, 48, 48]),
    "moe-mtp-prefix": Scenario("moe", MTP, EXTENDED, [0, 48, 48]),
    "next-mtp": Scenario("next", {**OFF, **MTP}, TOGETHER, [0, 0, 0]),
    "dense-fp8": Scenario("dense+fp8", OFF, TOGETHER, [0, 0, 0]),
    "moe-fp8-mtp": Scenario("moe+fp8", {**OFF, **MTP}, TOGETHER, [0, 0, 0]),
}


@dataclass
class Served:
    scenario: Scenario
    expected: list[list[int]]  # a plain CPU engine's tokens
    tokens: list[list[int]]  # the faked GPU engine's
    cached: list[int | None]  # num_cached_tokens of each faked request
    budgets: list[int]  # what cache_budget returned
    graph_bytes: int
    cuda: FakeCuda
    is_graphed: bool
    is_spec_graphed: bool


def _generate(llm: LLM, scenario: Scenario) -> tuple[list[list[int]], list[int | None]]:
    """Greedy tokens and num_cached_tokens of the scenario's prompts: together in one batch, or with the prefix
    cache on one at a time (the later ones find the first's checkpoint)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in scenario.prompts]
    batches = [[p] for p in prompts] if scenario.prompts is EXTENDED else [prompts]
    outs = [out for batch in batches for out in llm.generate(batch, params, use_tqdm=False)]
    return [list(out.outputs[0].token_ids) for out in outs], [out.num_cached_tokens for out in outs]


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Block-FP8 copies of the trained tiny checkpoints, written once (deltaserve/tiny/fp8.py)."""
    root = tmp_path_factory.mktemp("fp8")
    return {v: write_fp8_checkpoint(trained_model_dir(v), root / v) for v in ("dense", "moe")}


def fake_gpu_llm(model_dir: Path, budgets: list[int], **kwargs: object) -> LLM:
    """An LLM whose runner took the CUDA branches (call inside fake_cuda); budgets gets what cache_budget returned."""
    cache_budget = warmup.cache_budget

    def spy(runner, *args: int) -> int:  # noqa: ANN001 (the runner under construction)
        budgets.append(cache_budget(runner, *args))
        return budgets[-1]

    with pytest.MonkeyPatch.context() as monkeypatch:
        # runner/warmup.py defines it; size_caches looks it up in runner/memory.py
        monkeypatch.setattr(memory, "cache_budget", spy)
        return LLM(model_dir, gpu_memory_utilization=UTILIZATION, **kwargs)


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def served(request: pytest.FixtureRequest, fp8_dirs: dict[str, Path]) -> Served:
    scenario = SCENARIOS[request.param]
    variant, _, fp8 = scenario.variant.partition("+")
    model_dir = fp8_dirs[variant] if fp8 else trained_model_dir(variant)
    kwargs = {**BASE, **scenario.config}
    expected, _ = _generate(LLM(model_dir, **kwargs), scenario)
    budgets: list[int] = []
    with pytest.MonkeyPatch.context() as monkeypatch, fake_cuda(monkeypatch, TOTAL, PEAK) as cuda:
        llm = fake_gpu_llm(model_dir, budgets, **kwargs)
        runner = llm.engine.runner
        _, graph_bytes = warmup.graph_bytes(runner, runner.max_num_seqs)
        tokens, cached = _generate(llm, scenario)
    return Served(scenario, expected, tokens, cached, budgets, graph_bytes, cuda, runner.is_graphed,
                  runner.is_spec_graphed)  # fmt: skip


def test_the_cache_budget_comes_from_the_faked_gpu_memory(served: Served) -> None:
    # weights 0 (nothing allocated), the faked peak, the graphs' static buffers and the fixed headroom out of the
    # engine's share
    share = math.ceil(TOTAL * UTILIZATION)
    assert served.budgets == [share - PEAK - served.graph_bytes - warmup.HEADROOM_BYTES]
    assert served.graph_bytes > 0


def test_graphs_are_captured_and_replayed_and_the_tokens_are_the_cpu_engines(served: Served) -> None:
    assert served.tokens == served.expected
    assert served.is_graphed != served.is_spec_graphed  # decode graphs, or verify graphs while speculating
    assert served.cuda.captures > 0 and served.cuda.replays > 0  # the served decode/verify steps replayed
    assert served.cuda.events > 0  # the sampled tokens' host copies were marked by events


def test_the_prefix_cache_serves_the_shared_prompt_under_the_graphs(served: Served) -> None:
    assert served.cached == served.scenario.cached


MIXED = {  # launched together, "late" three steps after the others (steps mixing prefill and decode or verify)
    "logprobs": (IDS[0:9], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2,
                                          prompt_logprobs=1)),
    "regex": (IDS[10:30], SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(
        regex="[a-z]+( [a-z]+)*"))),
    "seeded": (IDS[70:95], SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=10, ignore_eos=True)),
    "late": (IDS[100:140], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
}  # fmt: skip


def _run_mixed(llm: LLM) -> dict[str, tuple]:
    """name -> (token ids, sampled logprobs, prompt logprobs) of the MIXED requests, stepped by hand."""
    engine = llm.engine
    for name in ("logprobs", "regex", "seeded"):
        engine.add_request(name, *MIXED[name])
    states = {name: engine.requests[name] for name in ("logprobs", "regex", "seeded")}
    for step in itertools.count():
        if step == 3:
            engine.add_request("late", *MIXED["late"])
            states["late"] = engine.requests["late"]
        elif step > 3 and not engine.has_unfinished():
            break
        engine.step()
    finals = {name: state.final_output() for name, state in states.items()}
    return {n: (list(f.outputs[0].token_ids), f.outputs[0].logprobs, f.prompt_logprobs) for n, f in finals.items()}


@pytest.mark.parametrize("config", [OFF, {**OFF, **MTP}], ids=["decode-graphs", "verify-graphs"])
def test_logprobs_grammar_seeded_and_staggered_requests_under_the_graphs(config: dict) -> None:
    """Deferred sampling (the grammar), prompt logprobs (their event), a seeded random row and a request arriving
    mid-decode (eager mixed steps between graph replays): the tokens and prompt logprobs of a plain CPU engine; the
    sampled logprobs within fp32 noise (a graph's logits come from a padded bucket's matmul)."""
    kwargs = {**BASE, **config}
    expected = _run_mixed(LLM(trained_model_dir("dense"), **kwargs))
    with pytest.MonkeyPatch.context() as monkeypatch, fake_cuda(monkeypatch, TOTAL, PEAK) as cuda:
        got = _run_mixed(fake_gpu_llm(trained_model_dir("dense"), [], **kwargs))
    assert cuda.replays > 0
    for name, (tokens, logprobs, prompt_logprobs) in expected.items():
        assert got[name][0] == tokens and got[name][2] == prompt_logprobs, name
        if logprobs is not None:
            flat = [(t, e.rank, e.logprob) for row in logprobs for t, e in row.items()]
            flat_got = [(t, e.rank, e.logprob) for row in got[name][1] for t, e in row.items()]
            assert [f[:2] for f in flat_got] == [f[:2] for f in flat]
            assert [f[2] for f in flat_got] == pytest.approx([f[2] for f in flat], abs=1e-4)
    assert expected["logprobs"][2] and expected["logprobs"][1]  # the request did return both kinds


def _run_vision(llm: LLM) -> dict[str, list[int]]:
    """The image, multi-image and video prompts of tests/support/vision.py and a text request, launched together
    with a 40-token step budget (images cut across chunks, prefill steps shared with decodes): name -> tokens."""
    case = case_for("dense-vl")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = {name: case.prompt(name) for name in VISION_PROMPTS} | {"text": (IDS[0:9], None)}
    return generate_together(llm, requests, params)


@pytest.mark.parametrize("config", [{}, MTP], ids=["decode-graphs", "verify-graphs"])
def test_images_and_video_under_the_graphs(config: dict) -> None:
    """The tiny dense-vl checkpoint: the vision encoder's rows, 3-D MRoPE positions through the decode graphs (or,
    speculating, eager mixed steps and the verify graphs), the tokens of a plain CPU engine."""
    kwargs = {"dtype": "float32", "max_num_batched_tokens": 40, "max_num_seqs": 4, "max_model_len": 512, **config}
    model_dir = case_for("dense-vl").model_dir
    expected = _run_vision(LLM(model_dir, **kwargs))
    with pytest.MonkeyPatch.context() as monkeypatch, fake_cuda(monkeypatch, TOTAL, PEAK) as cuda:
        got = _run_vision(fake_gpu_llm(model_dir, [], **kwargs))
    assert cuda.replays > 0
    assert got == expected and len(expected) == len(VISION_PROMPTS) + 1
