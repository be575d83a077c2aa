"""The verify graphs' padded layout (runner/spec_graphs.py), proven on the CPU without capture:

- the padding rule is exact: attention over rows declared 1 + k long with context start + 1 + k gives the real
  positions what the unpadded chunks give, up to the CPU einsum's shape-dependent fp32 rounding (one ulp here; it
  separates eager batches of different shapes alike), while a wrong declaration moves them by O(1); the verify GDN
  kernels give the real rows and the scratch entries a commit can read (<= k_s) bit for bit;
- end to end (fp32, trained tiny dense / MoE / Next checkpoints, their MTP heads drafting): greedy tokens with the
  static-buffer forward equal the eager verify path's and those without speculation, k = 1 and 3, with requests of
  different max_tokens (rows padded below k, the batch shrinking below its bucket); seeded random sampling and
  vLLM's synthetic acceptance give the eager path's tokens; and step by step, the graph path's logits at every
  sampled position equal an eager forward's of the same step (greedy tokens alone are blind to a wrong key at the
  few padded rows a run has).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.kernels.attention import paged_attention_ref
from deltaserve.kernels.gdn_spec import causal_conv1d_verify_ref, gdn_verify_ref, verify_row_width
from deltaserve.model.context import forward_context
from deltaserve.runner.spec_graphs import max_verify_batch
from deltaserve.runner.warmup import graph_bytes, warm_up_verify_sampling
from deltaserve.sampler import Sampler
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run
from tests.engine.test_spec_decode_batching import PROMPT, constrained

STARTS = (5, 12, 30)  # tokens before each row's verify chunk
NUM_DRAFTS = (3, 1, 2)  # k_s of each row; the padded width is 1 + k = 4
WIDTH = 4


def padded_rows() -> list[int]:
    """Each real position's row in the padded layout (row b's tokens start at b·WIDTH)."""
    return [b * WIDTH + j for b, k in enumerate(NUM_DRAFTS) for j in range(k + 1)]


def test_padded_attention_gives_the_real_positions_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks, nkv, nq, d = 4, 32, 2, 4, 16
    # every slot holds a finite value, as in the zero-initialised cache that only real tokens write
    k_cache = torch.randn(num_blocks, block_size, nkv, d, generator=generator, dtype=torch.float32)
    v_cache = torch.randn(num_blocks, block_size, nkv, d, generator=generator, dtype=torch.float32)
    tables = torch.randperm(num_blocks, generator=generator)[:30].view(3, 10).int()
    lengths = torch.tensor([k + 1 for k in NUM_DRAFTS])
    q_real = torch.randn(int(lengths.sum()), nq, d, generator=generator, dtype=torch.float32)
    qsl = torch.cat([torch.zeros(1), lengths.cumsum(0)]).int()
    seq_lens = torch.tensor([s + k + 1 for s, k in zip(STARTS, NUM_DRAFTS, strict=True)], dtype=torch.int32)
    expected = paged_attention_ref(q_real, k_cache, v_cache, qsl, seq_lens, tables, 0.25, max(NUM_DRAFTS) + 1)
    q_padded = torch.randn(3 * WIDTH, nq, d, generator=generator, dtype=torch.float32)  # padded queries: anything
    rows = padded_rows()
    q_padded[rows] = q_real
    uniform = torch.arange(4, dtype=torch.int32) * WIDTH
    declared = torch.tensor([s + WIDTH for s in STARTS], dtype=torch.int32)
    out = paged_attention_ref(q_padded, k_cache, v_cache, uniform, declared, tables, 0.25, WIDTH)
    assert (out[rows] - expected).abs().max() <= 1e-6  # fp32 rounding of values ~1
    # the check has teeth: the unpadded context with the padded query length shifts every real query's keys
    wrong = paged_attention_ref(q_padded, k_cache, v_cache, uniform, seq_lens, tables, 0.25, WIDTH)
    assert (wrong[rows] - expected).abs().max() > 1e-3


def test_padded_verify_kernels_give_the_real_rows_and_committable_states() -> None:
    generator = torch.Generator().manual_seed(1)
    hk, hv, dk, dv, channels, kernel = 2, 4, 8, 8, 12, 4
    lengths = [k + 1 for k in NUM_DRAFTS]
    num_real = sum(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    real = {"q": randn(num_real, hk, dk), "k": randn(num_real, hk, dk), "v": randn(num_real, hv, dv),
            "a": randn(num_real, hv), "b": randn(num_real, hv), "x": randn(num_real, channels)}  # fmt: skip
    rows = padded_rows()
    padded = {}
    for name, value in real.items():
        padded[name] = randn(3 * WIDTH, *value.shape[1:])  # padded rows: anything
        padded[name][rows] = value
    A_log, dt_bias, weight = randn(hv), randn(hv), randn(channels, kernel)
    ssm_states, conv_states = randn(6, hv, dk, dv), randn(6, kernel - 1, channels)
    slots = torch.tensor([4, 1, 3], dtype=torch.int32)
    first = [sum(lengths[:b]) for b in range(3)]  # each row's first token in the unpadded slice
    eager_index = torch.tensor([[first[b] + j if j < n else -1 for j in range(WIDTH)] for b, n in enumerate(lengths)])
    padded_index = torch.tensor([[b * WIDTH + j if j < n else -1 for j in range(WIDTH)] for b, n in enumerate(lengths)])

    def verify(inputs: dict, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        row_scratch = torch.zeros(3, WIDTH, verify_row_width(hk, dk, hv, dv))
        conv_scratch = torch.zeros(3, WIDTH, kernel - 1, channels)
        live = ssm_states.clone()  # read only: the commit replays the accepted rows on it
        core = gdn_verify_ref(inputs["q"], inputs["k"], inputs["v"], inputs["a"], inputs["b"], A_log, dt_bias,
                              live, slots, index, row_scratch)  # fmt: skip
        conv = causal_conv1d_verify_ref(inputs["x"], weight, conv_states, slots, index, conv_scratch)
        return core, conv, row_scratch, conv_scratch, live

    core, conv, row_scratch, conv_scratch, live = verify(real, eager_index)
    core_p, conv_p, row_scratch_p, conv_scratch_p, live_p = verify(padded, padded_index)
    assert torch.equal(core_p[rows], core) and torch.equal(conv_p[rows], conv)
    assert torch.equal(live_p, live) and torch.equal(live, ssm_states)
    for s, k in enumerate(NUM_DRAFTS):  # a commit reads entries 0 .. num_emitted - 1 <= k_s
        assert torch.equal(row_scratch_p[s, : k + 1], row_scratch[s, : k + 1])
        assert torch.equal(conv_scratch_p[s, : k + 1], conv_scratch[s, : k + 1])


def test_buckets_hold_at_most_512_tokens() -> None:
    assert max_verify_batch(3, 1024, 1024) == 128 and max_verify_batch(1, 1024, 1024) == 256
    assert max_verify_batch(3, 8, 1024) == 8 and max_verify_batch(3, 1024, 40) == 40


def test_verify_graphs_static_buffers_join_the_cache_budget() -> None:
    """The 35B-A3B shape at k = 3: 128 rows of 4 tokens, each token a fp32 logits row, a bf16 lm_head row and a
    bf16 hidden row, and each row the drafter's fp32 + bf16 logits (runner/warmup.py graph_bytes), in place of the
    decode graphs' buffers; with a k policy, the width-1 graphs' buffers as well."""
    runner = SimpleNamespace(
        is_graphed=False, is_spec_graphed=True, vocab_size=248320, dtype=torch.bfloat16,
        engine_config=SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3)),
        model_config=SimpleNamespace(hidden_size=2048), spec_draft_counts=None,
    )  # fmt: skip
    verify = (512 + 128) * 248320 * (4 + 2) + 512 * 2048 * 2
    assert graph_bytes(runner, 1024) == ("verify", verify)
    # a k policy adds the width-1 graphs: 512 rows of one token (the capture limit), the drafter's logits per row
    runner.spec_draft_counts = (0, 1, 2, 3)
    assert graph_bytes(runner, 1024) == ("verify and width-1", verify + (512 + 512) * 248320 * 6 + 512 * 2048 * 2)
    runner.is_spec_graphed = False
    assert graph_bytes(runner, 1024) == ("no", 0)


def test_verify_sampling_warm_up_runs_the_random_rule_over_a_bucket() -> None:
    """The start-up warm-up's verify step (runner/warmup.py, run on the GPU before the cache is sized): the sampler
    over S·(1 + k) positions, then the random rule over [S, k, V]; its outputs are a rule's outputs."""
    tokens, num_emitted = warm_up_verify_sampling(Sampler(0), 3, 3, 128, torch.device("cpu"))
    assert tokens.shape == (3, 4) and num_emitted.shape == (3,)
    for row, count in zip(tokens.tolist(), num_emitted.tolist(), strict=True):
        assert 1 <= count <= 4 and all(0 <= t < 128 for t in row[:count]) and all(t == -1 for t in row[count:])


# -- end to end -------------------------------------------------------------------------------------------------------

VARIANTS = ("dense", "moe", "next")
MAX_TOKENS = (9, 17, 6, 20, 12)  # ends mid-run: rows draft fewer than k near the end, the batch shrinks


def greedy() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per variant: prompts and their greedy continuations without speculation."""
    found = {}
    for variant in VARIANTS:
        llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8)
        prompts = make_prompts(llm)[: len(MAX_TOKENS)]
        found[variant] = prompts, [list(o.token_ids) for o in run(llm, prompts, greedy())]
    return found


def spec_llm(variant: str, speculative_config: dict) -> tuple[LLM, list[tuple[int, ...]]]:
    """An eager speculating engine, and a record of each step's emitted counts per sequence: equal records mean
    equal drafts at every step (a draft decides how many tokens its chunk emits)."""
    llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8, speculative_config=speculative_config)
    core = llm.engine.core
    steps: list[tuple[int, ...]] = []
    update = core.scheduler.update

    def recording_update(plan, result):  # noqa: ANN001, ANN202 (the scheduler's own signature)
        steps.append(tuple(len(tokens) for tokens in result.token_ids))
        return update(plan, result)

    core.scheduler.update = recording_update
    return llm, steps


def graph_llm(variant: str, speculative_config: dict) -> tuple[LLM, list[tuple[int, ...]], list[tuple[int, int, int]]]:
    """spec_llm whose verify steps run the verify graphs' static-buffer code uncaptured (the target forward, then
    commit and drafter after the accept step), and a record of each replay: (sequences, bucket, rows drafting
    fewer than k, plain decodes included)."""
    llm, steps = spec_llm(variant, speculative_config)
    runner = llm.engine.core.runner
    runner._use_spec_graphs(capture=False)
    graphs = runner.spec_graphs
    assert graphs.has_drafter
    replays: list[tuple[int, int, int]] = []
    replay = graphs.run

    def recording_run(layout, inputs, table, block_size):  # noqa: ANN001, ANN202 (VerifyGraphs.run's signature)
        num_seqs = len(layout.rows)
        bucket = next(s for s in graphs.sizes if s >= num_seqs)
        short = num_seqs - len(layout.spec.seq_index) + int((layout.spec.num_drafts < graphs.width - 1).sum())
        replays.append((num_seqs, bucket, short))
        return replay(layout, inputs, table, block_size)

    graphs.run = recording_run
    return llm, steps, replays


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_path_greedy_equals_eager_and_no_speculation(references: dict, variant: str, k: int) -> None:
    prompts, expected = references[variant]
    config = {"method": "mtp", "num_speculative_tokens": k}
    eager, eager_steps = spec_llm(variant, config)
    assert eager.engine.core.runner.spec_graphs is None  # the CPU runs eager unless a test asks
    assert [list(o.token_ids) for o in run(eager, prompts, greedy())] == expected
    llm, steps, replays = graph_llm(variant, config)
    assert [list(o.token_ids) for o in run(llm, prompts, greedy())] == expected
    assert steps == eager_steps  # the same drafts, step by step
    assert replays, "no verify step ran the graph path"
    assert any(num_seqs < bucket for num_seqs, bucket, _ in replays)  # bucket padding rows
    assert any(short for _, _, short in replays)  # rows padded to 1 + k (a request's last token: a plain decode)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS[seed % 5], ignore_eos=True)


@pytest.mark.parametrize(
    "extra", [{}, {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.6, 0.3]}]
)
def test_graph_path_seeded_and_synthetic_equal_eager(references: dict, extra: dict) -> None:
    prompts, _ = references["moe"]
    config = {"method": "mtp", "num_speculative_tokens": 3, **extra}
    params = [sampled(seed) for seed in range(len(prompts))]
    eager, eager_steps = spec_llm("moe", config)
    expected = [list(o.token_ids) for o in run(eager, prompts, params)]
    llm, steps, replays = graph_llm("moe", config)
    assert [list(o.token_ids) for o in run(llm, prompts, params)] == expected
    assert steps == eager_steps and replays


def test_graph_logits_equal_eager_logits_at_every_step() -> None:
    """Before each graph step, the eager forward of the same step (it writes the same KV slots and scratch rows,
    which the graph's forward then rewrites; the live GDN slots it advances are restored): the sampled positions'
    logits agree to fp32 rounding."""
    config = {"method": "mtp", "num_speculative_tokens": 3}
    llm, _, replays = graph_llm("dense", config)
    runner = llm.engine.core.runner
    graphs = runner.spec_graphs
    replay = graphs.run
    worst: list[float] = []

    mixers = [layer.linear_attn for layer in runner.model.layers if not layer.is_full_attention]

    def checked_run(layout, inputs, table, block_size):  # noqa: ANN001, ANN202 (VerifyGraphs.run's signature)
        # the eager forward's plain decode rows advance their live slots in place: put them back after it
        saved = [(mixer.conv_states.clone(), mixer.ssm_states.clone()) for mixer in mixers]
        with forward_context(inputs.ctx):
            hidden = runner.model(inputs.input_ids, inputs.positions)
        for mixer, (conv, ssm) in zip(mixers, saved, strict=True):
            mixer.conv_states.copy_(conv)
            mixer.ssm_states.copy_(ssm)
        index = inputs.sample_token_index  # None: every row samples (a verify step of full chunks)
        expected = runner.model.compute_logits(hidden if index is None else hidden.index_select(0, index))
        hidden_graph, logits = replay(layout, inputs, table, block_size)
        worst.append(float((logits - expected).abs().max()))  # [P, V] both
        return hidden_graph, logits

    graphs.run = checked_run
    run(llm, make_prompts(llm)[: len(MAX_TOKENS)], greedy())
    assert len(worst) == len(replays) > 0 and any(short for _, _, short in replays)
    assert max(worst) < 1e-3, worst  # logits of magnitude ~10; a wrong key moves them by O(1)


def test_graph_drafts_equal_eager_drafts_at_every_step() -> None:
    """At each graph step, the eager drafter (SpecDecoder.propose with the MtpDrafter) runs first on the step's
    gathered copies, then the post-sampling code: every row's k drafts agree, plain decode rows included (their
    one emitted token feeds the MTP layer)."""
    llm, _, replays = graph_llm("dense", {"method": "mtp", "num_speculative_tokens": 3})
    runner = llm.engine.core.runner
    graphs, spec = runner.spec_graphs, runner.spec
    handles = []
    accept, draft = spec.accept, graphs.draft

    def recording_accept(handle, *args):  # noqa: ANN001, ANN002, ANN202 (SpecDecoder.accept's signature)
        handles.append(handle)
        return accept(handle, *args)

    checked = {"steps": 0, "decode_rows": 0}

    def checked_draft(seq_tokens, tokens, num_emitted, num_decodes, num_drafts):  # noqa: ANN001, ANN202 (draft's)
        rows = handles[-1].step_layout.rows
        rows_dev = torch.from_numpy(rows)
        spec.propose(handles[-1], runner.table, runner.block_size, rows, rows_dev, seq_tokens)
        expected = spec.draft_tokens.index_select(0, rows_dev)  # [B, k]
        draft(seq_tokens, tokens, num_emitted, num_decodes, num_drafts)
        assert torch.equal(spec.draft_tokens.index_select(0, rows_dev), expected)
        checked["steps"] += 1
        checked["decode_rows"] += num_decodes

    spec.accept, graphs.draft = recording_accept, checked_draft
    run(llm, make_prompts(llm)[: len(MAX_TOKENS)], greedy())
    assert checked["steps"] == len(replays) > 0 and checked["decode_rows"] > 0


def count_calls(graphs: object, name: str) -> list[int]:
    """[n]: how many times graphs.NAME is called from now on (the method still runs)."""
    calls = [0]
    method = getattr(graphs, name)

    def counting(*args):  # noqa: ANN002, ANN202 (the method's own signature)
        calls[0] += 1
        return method(*args)

    setattr(graphs, name, counting)
    return calls


def test_graph_path_at_two_ranks_gives_one_rank_tokens_and_counters(references: dict) -> None:
    """Tensor parallelism on the CPU (two ranks over gloo): both ranks run the graph path uncaptured (rank 0 decides
    which steps; the worker follows the same plan and flag), their collectives meet, and the greedy tokens and
    spec-decode counters equal one rank's eager MTP run."""
    prompts, expected = references["dense"]
    config = {"method": "mtp", "num_speculative_tokens": 3}
    one = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, speculative_config=config)
    assert [list(o.token_ids) for o in run(one, prompts, greedy())] == expected
    two = LLM(trained_model_dir("dense"), dtype="float32", device="cpu", max_num_seqs=8, speculative_config=config,
              tensor_parallel_size=2)  # fmt: skip
    try:
        executor = two.engine.runner
        executor.run_on_all_ranks("_use_spec_graphs", False)
        graphs = executor.driver.spec_graphs
        replays = count_calls(graphs, "run")
        assert [list(o.token_ids) for o in run(two, prompts, greedy())] == expected
        assert replays[0] > 0
        names = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens_per_pos")
        assert [getattr(two.engine.stats(), n) for n in names] == [getattr(one.engine.stats(), n) for n in names]
    finally:
        (process,) = two.engine.runner.workers.processes
        two.shutdown()
        assert process.exitcode == 0


def test_graph_path_with_grammars_equals_eager() -> None:
    """Grammar and bad-words rows make their steps deferred: the forward replays the graph, the commit and the
    drafter run eagerly from the gathered copies (another step may replay before sample()). Tokens and every step's
    emitted counts equal the eager path's."""
    params = constrained()
    prompts = [PROMPT] * len(params)
    config = {"method": "mtp", "num_speculative_tokens": 3}
    eager, eager_steps = spec_llm("dense", config)
    # grammars compile on a thread, so the step a constrained request joins depends on timing; once compiled they
    # are cached and every request of the measured run is admitted at once, in both engines
    eager.generate(prompts, params, use_tqdm=False)
    eager_steps.clear()
    expected = [list(o.outputs[0].token_ids) for o in eager.generate(prompts, params, use_tqdm=False)]
    llm, steps, replays = graph_llm("dense", config)
    llm.generate(prompts, params, use_tqdm=False)
    steps.clear()
    replays.clear()
    graphs = llm.engine.core.runner.spec_graphs
    post = count_calls(graphs, "draft")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected and steps == eager_steps
    assert 0 < post[0] < len(replays)  # some graph steps were deferred: their commit and drafts ran eagerly
