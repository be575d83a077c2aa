"""The width-1 graphs (runner/spec_graphs.py with width 1): under MTP with the k policy, an all-decode step without
verify chunks (k_step = 0) replays B rows of one token (the decode kernels, no scratch, no commit), then the
post-sampling graph's MTP first pass (and chained passes only where the plan asks for drafts). On the CPU, fp32, the
trained tiny dense / MoE / Next checkpoints with their MTP heads:

- uncaptured (the same static-buffer code): every all-decode step replays them, greedy tokens equal those without
  MTP (tests/engine/test_spec_drafts_next.py compares with vLLM's fixed k), the sampled logits of each replay equal
  an eager forward's of the same step, and the drafts each replay leaves equal the eager drafter's;
- captured with the CUDA calls stood in (tests/support/fake_cuda.py, which refuses host syncs and replays only what
  was recorded): every bucket has its width-1 forward graph and a post-sampling graph per draft count, the replays
  give a plain CPU engine's tokens, and the static buffers are counted in the cache budget.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.model.context import forward_context
from deltaserve.runner import model_runner, warmup
from deltaserve.runner.spec_graphs import verify_static_bytes
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run
from tests.runner.test_cuda_paths_on_cpu import BASE, PEAK, TOGETHER, TOTAL, fake_gpu_llm
from tests.support.fake_cuda import fake_cuda

K = 3
MAX_TOKENS = (16, 6, 5, 14, 7)  # rows end at different steps: the batch shrinks below its bucket, to 2 rows
VARIANTS = ("dense", "moe", "next")
ZERO = {"max_batch_tokens": 1}  # k_step 0 at every step with decodes
FLIP = {"max_batch_tokens": 0, "token_cost": 0.5, "probe_interval": 2, "min_samples": 1, "measure_cost": False}  # 0, k


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def mtp(**extra: object) -> dict:
    return {"method": "mtp", "num_speculative_tokens": K, **extra}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    found = {}
    for variant in VARIANTS:
        plain = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8)
        prompts = make_prompts(plain)
        found[variant] = prompts, [list(o.token_ids) for o in run(plain, prompts, params())]
    return found


@pytest.mark.parametrize("policy", [ZERO, FLIP], ids=["zero", "flip"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_all_decode_steps_replay_the_width_one_graphs_exactly(references: dict, variant: str, policy: dict) -> None:
    prompts, expected = references[variant]
    llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8, speculative_config=mtp(k_policy=policy))
    runner = llm.engine.core.runner
    runner._use_spec_graphs(capture=False)
    graphs, spec = runner.spec_decode_graphs, runner.spec
    assert graphs.width == 1 and graphs.draft_counts == tuple(range(K + 1)) and runner.spec_graphs.width == 1 + K
    replay, draft = graphs.run, graphs.draft
    worst: list[float] = []
    eager_steps: list[int] = []  # all-decode steps without verify chunks that did not replay
    handles = []

    def checked_run(layout, inputs, table, block_size):  # noqa: ANN001, ANN202 (VerifyGraphs.run's signature)
        # an eager forward of the same step first: it advances the live GDN slots in place, so put them back
        mixers = [layer.linear_attn for layer in runner.model.layers if not layer.is_full_attention]
        saved = [(m.conv_states.clone(), m.ssm_states.clone()) for m in mixers]
        with forward_context(inputs.ctx):
            hidden = runner.model(inputs.input_ids, inputs.positions)
        for m, (conv, ssm) in zip(mixers, saved, strict=True):
            m.conv_states.copy_(conv)
            m.ssm_states.copy_(ssm)
        expected_logits = runner.model.compute_logits(hidden)  # [B, V]: every row samples
        hidden_graph, logits = replay(layout, inputs, table, block_size)
        worst.append(float((logits - expected_logits).abs().max()))
        return hidden_graph, logits

    def checked_draft(seq_tokens, tokens, num_emitted, num_decodes, num_drafts):  # noqa: ANN001, ANN202 (draft's)
        # the eager drafter on the step's gathered copies first (its MTP KV writes are the replay's, rewritten)
        handle = handles[-1]
        rows = handle.step_layout.rows
        rows_dev = torch.from_numpy(rows)
        spec.propose(handle, runner.table, runner.block_size, rows, rows_dev, seq_tokens)
        eager = spec.draft_tokens.index_select(0, rows_dev)[:, :num_drafts]
        draft(seq_tokens, tokens, num_emitted, num_decodes, num_drafts)
        assert tokens is None and num_decodes == len(rows)
        assert torch.equal(spec.draft_tokens.index_select(0, rows_dev)[:, :num_drafts], eager)

    graphs.run, graphs.draft = checked_run, checked_draft
    execute = runner.execute

    def recording_execute(plan, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 (execute's signature)
        before = len(worst)
        handle = execute(plan, *args, **kwargs)
        all_decodes = plan.seqs and plan.num_decodes == len(plan.seqs)
        if all_decodes and len(worst) == before:
            eager_steps.append(plan.step_id)
        return handle

    def keep_handle(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (step_spec_handle's signature)
        handles.append(make_handle(*args, **kwargs))
        return handles[-1]

    make_handle = model_runner.step_spec_handle
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(model_runner, "step_spec_handle", keep_handle)
        runner.execute = recording_execute
        assert [list(o.token_ids) for o in run(llm, prompts, params())] == expected
    assert len(worst) > 0 and not eager_steps, eager_steps
    assert max(worst) < 1e-3, worst  # logits ~10; the padded bucket's matmuls round differently


def test_the_width_one_graphs_capture_and_replay_with_the_cuda_calls_stood_in() -> None:
    # the batch rule alone: 3 decodes x (1 + 1) > 5 drafts none, 2 decodes draft 1, one decode 3
    kwargs = {**BASE, "enable_prefix_caching": False,
              "speculative_config": mtp(k_policy={"max_batch_tokens": 5, "token_cost": 0.0})}  # fmt: skip
    sampling = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 5, 8)]
    prompts = [{"prompt_token_ids": ids} for ids in TOGETHER]
    expected = [list(o.outputs[0].token_ids) for o in LLM(trained_model_dir("dense"), **kwargs).generate(
        prompts, sampling, use_tqdm=False)]  # fmt: skip
    budgets: list[int] = []
    with pytest.MonkeyPatch.context() as monkeypatch, fake_cuda(monkeypatch, TOTAL, PEAK) as cuda:
        llm = fake_gpu_llm(trained_model_dir("dense"), budgets, **kwargs)
        runner = llm.engine.runner
        graphs = runner.spec_decode_graphs
        assert graphs.is_captured and sorted(graphs.graphs) == graphs.sizes
        assert sorted(graphs.post_graphs) == [(s, n) for s in graphs.sizes for n in range(K + 1)]
        assert graphs.pool is runner.spec_graphs.pool  # one memory pool for both widths
        kind, static = warmup.graph_bytes(runner, runner.max_num_seqs)
        drafts: list[tuple[int, int]] = []  # (width, drafts proposed) of each post-sampling replay
        for each in (graphs, runner.spec_graphs):
            draft = each.draft

            def recording_draft(*args: object, each: object = each, draft: object = draft) -> None:
                drafts.append((each.width, args[-1]))
                draft(*args)

            each.draft = recording_draft
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampling, use_tqdm=False)]
    assert got == expected
    # all-decode steps at k 0 replayed width 1 and proposed nothing (3 decodes next) or 1 (2 next); verify steps
    # replayed the verify graphs
    assert {(1, 0), (1 + K, 3)} <= set(drafts) and {w for w, _ in drafts} == {1, 1 + K}, drafts
    assert cuda.replays == 2 * len(drafts)  # each graphed step: its forward and its post-sampling graph
    assert kind == "verify and width-1"
    without = verify_static_bytes(8, 1 + K, runner.vocab_size, runner.model_config.hidden_size,
                                         runner.dtype, True)  # fmt: skip
    assert static == without + verify_static_bytes(8, 1, runner.vocab_size, runner.model_config.hidden_size,
                                                           runner.dtype, True)  # fmt: skip


def test_two_ranks_replay_the_width_one_graphs_alike(references: dict) -> None:
    """Tensor parallelism on the CPU (two ranks over gloo): both ranks pick the same graphs for every step (rank 0's
    plan and flag) and replay the width-1 graphs' code where k is 0, their collectives meet, and the greedy tokens
    equal one rank's without MTP."""
    prompts, expected = references["dense"]
    config = mtp(k_policy={"max_batch_tokens": 5, "token_cost": 0.0})  # 5 decodes: k 0; 2: k 1; 1: k 3
    two = LLM(trained_model_dir("dense"), dtype="float32", device="cpu", max_num_seqs=8, speculative_config=config,
              tensor_parallel_size=2)  # fmt: skip
    try:
        executor = two.engine.runner
        executor.run_on_all_ranks("_use_spec_graphs", False)
        counts = {}
        for name in ("spec_graphs", "spec_decode_graphs"):
            graphs = getattr(executor.driver, name)
            counts[name] = [0]
            replay = graphs.run

            def counting_run(*args: object, count: list[int] = counts[name], replay: object = replay) -> object:
                count[0] += 1
                return replay(*args)

            graphs.run = counting_run
        assert [list(o.token_ids) for o in run(two, prompts, params())] == expected
        assert counts["spec_decode_graphs"][0] > 0 and counts["spec_graphs"][0] > 0, counts
    finally:
        (process,) = two.engine.runner.workers.processes
        two.shutdown()
        assert process.exitcode == 0
