"""--kv-cache-memory-bytes (EngineConfig.kv_cache_memory_bytes, the offline LLM(kv_cache_memory_bytes=...)) sizes the
cache as vLLM 0.26 sizes it: that many bytes for the KV blocks and the GDN state slots, whatever
gpu_memory_utilization (on a GPU) or cpu_kv_cache_bytes (on the CPU) would give, and a start-up refusal by name when
it cannot hold one max_model_len sequence. The expected counts are computed here from the tiny dense checkpoint's
shapes (fp32: 16-token KV blocks of 16 KiB, state slots of 33 KiB), not from runner/cache.py's helpers."""

from __future__ import annotations

import logging
import math

import pytest

from deltaserve.config import ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.engine_config import EngineConfig
from deltaserve.runner import memory, warmup
from deltaserve.runner.cuda_graph import buckets, static_bytes
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.support.fake_cuda import fake_cuda

DENSE = trained_model_dir("dense")
FP32 = 4
BLOCK_SIZE = 16
MAX_MODEL_LEN = 64  # 4 blocks


def _sizes() -> tuple[int, int, int, int, int]:
    """(bytes of one KV block, of one GDN state slot, of its conv windows, of its recurrent states, of one verify
    token's delta-rule inputs over the GDN layers) of the tiny dense checkpoint in fp32, from its config."""
    c = ModelConfig.from_pretrained(DENSE)
    block = 2 * BLOCK_SIZE * c.num_key_value_heads * c.head_dim * FP32 * len(c.full_attention_layers)  # K and V
    conv = (c.linear_conv_kernel_dim - 1) * (
        2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    )
    ssm = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim  # fp32 recurrent state
    layers = len(c.linear_attention_layers)
    # a token's k, v, a and b (kernels/gdn_spec.py verify_row_width)
    row = c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * (c.linear_value_head_dim + 2)
    return block, (conv + ssm) * FP32 * layers, conv * FP32 * layers, ssm * FP32 * layers, row * FP32 * layers


BLOCK, SLOT, CONV, SSM, ROW = _sizes()


def verify_row(k: int) -> int:
    """A verify chunk's scratch: the conv window after each of its 1 + k tokens and each token's delta-rule inputs,
    which the commit replays on the live state (kernels/gdn_spec.py): no recurrent state."""
    return (k + 1) * (CONV + ROW)


ONE_SEQUENCE = MAX_MODEL_LEN // BLOCK_SIZE * BLOCK + SLOT  # what vLLM's start-up check asks the budget to hold
FIXED = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE, "max_num_seqs": 4}


def _layout(**kwargs: object) -> tuple[int, int, int, int]:
    """(KV blocks, state slots, checkpoint slots, max_num_seqs) of an engine built with kwargs."""
    runner = LLM(DENSE, **{**FIXED, **kwargs}).engine.runner
    return runner.layout.num_blocks, runner.layout.num_slots, runner.layout.num_checkpoint_slots, runner.max_num_seqs


def test_the_tiny_shapes_are_what_the_expected_counts_assume() -> None:
    assert (BLOCK, SLOT) == (16_384, 33_792)


@pytest.mark.parametrize("budget", [3_000_000, 5 * 2**20 + 123])
def test_block_and_slot_counts_follow_kv_cache_memory_bytes_exactly(budget: int) -> None:
    """Prefix caching off: 4 slots, then every whole block the rest holds; on with 2 checkpoint slots: 6 slots.
    cpu_kv_cache_bytes (the CPU's default budget) is overridden."""
    off = _layout(kv_cache_memory_bytes=budget, enable_prefix_caching=False, cpu_kv_cache_bytes=2**20)
    assert off == ((budget - 4 * SLOT) // BLOCK, 4, 0, 4)
    on = _layout(kv_cache_memory_bytes=budget, num_checkpoint_slots=2, cpu_kv_cache_bytes=2**20)
    assert on == ((budget - 6 * SLOT) // BLOCK, 6, 2, 4)


def test_while_speculating_the_mtp_layer_and_the_verify_scratch_are_inside_it() -> None:
    """MTP (k = 2): a block holds the MTP layer's K/V too (3 attention layers, not 2), a slot the MTP hidden row, and
    the verify scratch (4 rows of 1 + k conv windows and token rows: a quarter of the budget holds more) comes out
    of the budget."""
    budget = 4 * 2**20
    hidden = ModelConfig.from_pretrained(DENSE).hidden_size
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    runner = LLM(DENSE, **FIXED, kv_cache_memory_bytes=budget, enable_prefix_caching=False,
                 speculative_config=mtp).engine.runner  # fmt: skip
    block, slot, scratch = BLOCK * 3 // 2, SLOT + hidden * FP32, 4 * verify_row(2)
    assert runner.spec.max_spec_seqs == 4 and scratch <= budget // 4
    assert (runner.layout.bytes_per_block, runner.layout.bytes_per_slot) == (block, slot)
    assert (runner.layout.num_blocks, runner.layout.num_slots) == ((budget - scratch - 4 * slot) // block, 4)


def test_while_speculating_the_default_max_num_seqs_gives_every_sequence_its_verify_scratch() -> None:
    """max_num_seqs unset, MTP k = 2: vLLM's default capped to the larger of the sequences whose pool slot and
    verify scratch (3 conv windows, 3 token rows) take half of the budget (100 slots' worth: 24) and those the budget
    serves whole, each with a max_model_len sequence's KV (20); the scratch holds a verify chunk for every one of
    them, so no step is larger than the verify graphs (before session 24 the count was capped for the pool alone,
    50, with 8 scratch rows: steps of 9 to 50 sequences ran eager). (Before session 26 the scratch held 1 + k whole
    states and the count was 14; sessions 26-29, k states and 16, the whole-sequence count.)"""
    budget = 100 * SLOT
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    runner = LLM(DENSE, **{**FIXED, "max_num_seqs": None}, kv_cache_memory_bytes=budget, enable_prefix_caching=False,
                 speculative_config=mtp).engine.runner  # fmt: skip
    slot, block = runner.layout.bytes_per_slot, runner.layout.bytes_per_block
    whole = budget // (slot + verify_row(2) + 4 * block)
    half = (budget // 2) // (slot + verify_row(2))
    assert (whole, half) == (20, 24)
    assert (runner.max_num_seqs, runner.spec.max_spec_seqs, runner.layout.num_slots) == (24, 24, 24)
    assert runner.layout.num_blocks == (budget - 24 * verify_row(2) - 24 * slot) // block


def test_while_speculating_a_max_num_seqs_set_past_the_scratch_runs_as_many_as_fit(caplog) -> None:  # noqa: ANN001
    """max_num_seqs 4 set, MTP k = 2, a budget of one max_model_len sequence's KV (4 blocks of 1.5 x BLOCK with the
    MTP layer) and 3.5 sequences of a slot and a verify scratch: 3 run at a time (as vLLM's hybrid cache runs what
    its blocks hold), with a warning; before session 24, 4 ran with a quarter-budget scratch of 1 chunk, and steps
    of 2-4 sequences ran eager."""
    hidden = ModelConfig.from_pretrained(DENSE).hidden_size
    budget = 4 * (BLOCK * 3 // 2) + 7 * (SLOT + hidden * FP32 + verify_row(2)) // 2
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        runner = LLM(DENSE, **FIXED, kv_cache_memory_bytes=budget, enable_prefix_caching=False,
                     speculative_config=mtp).engine.runner  # fmt: skip
    block, slot = runner.layout.bytes_per_block, runner.layout.bytes_per_slot
    fit = (budget - 4 * block) // (slot + verify_row(2))
    assert fit == 3 and (runner.max_num_seqs, runner.spec.max_spec_seqs, runner.layout.num_slots) == (3, 3, 3)
    assert "max_num_seqs 4 while speculating" in caplog.text and "3 run at a time" in caplog.text


def test_under_the_k_policy_the_count_is_sized_as_without_speculation_and_the_scratch_apart() -> None:
    """max_num_seqs unset, MTP k = 2 with the deltaserve-only k policy: the count is the one without speculation
    (50: the pool in half of 100 slots' worth), the scratch a quarter of the budget (25 slots' worth / a chunk's
    scratch = 24 chunks); a step of more than 24 decodes drafts nothing and replays a width-1 graph
    (scheduler/spec_policy.py)."""
    budget = 100 * SLOT
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "k_policy": True}
    engine = LLM(DENSE, **{**FIXED, "max_num_seqs": None}, kv_cache_memory_bytes=budget, enable_prefix_caching=False,
                 speculative_config=mtp).engine  # fmt: skip
    runner = engine.runner
    assert int(budget * 0.25) // verify_row(2) == 24
    assert (runner.max_num_seqs, runner.spec.max_spec_seqs) == (50, 24)
    assert engine.scheduler.spec.policy.max_verifies == 24


def test_without_it_the_cpu_budget_is_cpu_kv_cache_bytes_and_zero_means_not_set() -> None:
    """0 is vLLM's 'not set' (its worker tests the value for truth): the budget stays cpu_kv_cache_bytes."""
    budget = 2 * 2**20
    expected = ((budget - 4 * SLOT) // BLOCK, 4, 0, 4)
    assert _layout(cpu_kv_cache_bytes=budget, enable_prefix_caching=False) == expected
    assert _layout(cpu_kv_cache_bytes=budget, enable_prefix_caching=False, kv_cache_memory_bytes=0) == expected
    assert EngineConfig("m", kv_cache_memory_bytes=0).kv_cache_memory_bytes is None


def test_default_max_num_seqs_and_checkpoints_are_sized_from_it() -> None:
    """max_num_seqs unset: vLLM's default (256 off large GPUs) capped so the slots take at most half of the budget;
    the checkpoint slots a tenth of it (at least 1, at most max_num_seqs)."""
    budget = 100 * SLOT
    blocks, slots, checkpoints, max_num_seqs = _layout(kv_cache_memory_bytes=budget, max_num_seqs=None)
    assert (max_num_seqs, checkpoints, slots) == (50, 10, 60)
    assert blocks == (budget - 60 * SLOT) // BLOCK


def test_a_budget_of_exactly_one_max_model_len_sequence_starts_and_serves() -> None:
    """vLLM starts when the budget holds one max_model_len sequence: so does deltaserve, with the counts sized from
    memory (max_num_seqs, checkpoint slots) shrunk to what leaves that sequence its blocks."""
    exact = _layout(kv_cache_memory_bytes=ONE_SEQUENCE, max_num_seqs=1, enable_prefix_caching=False)
    assert exact == (4, 1, 0, 1)
    llm = LLM(DENSE, **{**FIXED, "max_num_seqs": None, "kv_cache_memory_bytes": ONE_SEQUENCE})
    layout = llm.engine.runner.layout
    assert (layout.num_blocks, layout.num_slots, layout.num_checkpoint_slots, llm.engine.runner.max_num_seqs) == (
        4, 1, 0, 1,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [3, 17, 29, 5]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 60  # the whole max_model_len in the one sequence's blocks


def test_a_budget_short_of_one_sequence_is_refused_by_name() -> None:
    """vLLM's refusal at start-up, with the bytes one sequence needs and the longest the budget holds."""
    with pytest.raises(ValueError, match="kv_cache_memory_bytes") as excinfo:
        _layout(kv_cache_memory_bytes=ONE_SEQUENCE - 1, max_num_seqs=1, enable_prefix_caching=False)
    message = str(excinfo.value)
    assert f"({ONE_SEQUENCE - 1} bytes, 0.00 GiB) is not enough for max_model_len (64)" in message
    assert f"needs {ONE_SEQUENCE} bytes" in message and f"4 KV blocks of {BLOCK} bytes" in message
    assert "it holds one sequence of at most 48 tokens; raise kv_cache_memory_bytes or lower max_model_len" in message
    with pytest.raises(ValueError, match="cpu_kv_cache_bytes .* is not enough for max_model_len"):
        _layout(cpu_kv_cache_bytes=SLOT, max_num_seqs=1)  # without the flag, the error names the CPU's budget


@pytest.mark.parametrize("override", [4, 9, 500])
def test_num_gpu_blocks_override_sets_the_kv_block_count_and_nothing_else(override: int, caplog) -> None:  # noqa: ANN001
    """vLLM's --num-gpu-blocks-override: the computed count replaced (fewer or more), logged in vLLM's words; the
    state slots and checkpoints are sized as without it."""
    budget = 3_000_000
    computed = (budget - 6 * SLOT) // BLOCK
    with caplog.at_level(logging.INFO, logger="deltaserve.runner.memory"):
        layout = _layout(kv_cache_memory_bytes=budget, num_checkpoint_slots=2, num_gpu_blocks_override=override)
    assert layout == (override, 6, 2, 4)
    assert f"Overriding num_gpu_blocks={computed} with num_gpu_blocks_override={override}" in caplog.text


def test_a_small_num_gpu_blocks_override_preempts_and_keeps_the_tokens() -> None:
    """Exactly one max_model_len sequence of blocks for four prompts that need more together (what vLLM users set
    it for): the engine preempts, and the greedy tokens equal those of an unconstrained engine."""
    prompts = [{"prompt_token_ids": [3 + i, 17, 29, 5, 11 + i]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tight = LLM(DENSE, **FIXED, enable_prefix_caching=False, num_gpu_blocks_override=MAX_MODEL_LEN // BLOCK_SIZE)
    wide = LLM(DENSE, **FIXED, enable_prefix_caching=False)
    assert tight.engine.runner.layout.num_blocks == 4 < wide.engine.runner.layout.num_blocks
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in wide.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(tokens) == 40 for tokens in got)
    assert tight.engine.stats().num_preemptions_total > 0


def test_a_num_gpu_blocks_override_short_of_one_sequence_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"num_gpu_blocks_override \(3\) holds 48 tokens, fewer than one max_model_len"
    ):
        _layout(num_gpu_blocks_override=3)
    with pytest.raises(ValueError, match="num_gpu_blocks_override must be a positive integer"):
        EngineConfig("m", num_gpu_blocks_override=0)


@pytest.mark.parametrize("value", [-1, True, 1.5e9, "4G"])
def test_the_config_refuses_what_is_not_a_byte_count(value: object) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be"):
        EngineConfig("m", kv_cache_memory_bytes=value)


def spy_on_cache_budget(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The list that collects what every cache_budget call returns while the patch lasts."""
    budgets: list[int] = []
    cache_budget = warmup.cache_budget

    def spy(runner, *args: int) -> int:  # noqa: ANN001 (the runner under construction)
        budgets.append(cache_budget(runner, *args))
        return budgets[-1]

    # runner/warmup.py defines it; size_caches looks it up in runner/memory.py
    monkeypatch.setattr(memory, "cache_budget", spy)
    return budgets


def test_on_a_gpu_it_overrides_gpu_memory_utilization(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # noqa: ANN001
    """The GPU start-up path (CUDA calls stood in, tests/support/fake_cuda.py): the warm-up still runs, but the
    budget is the flag's bytes, not the engine's share less weights, peak and headroom, even where that share
    (utilization 0.5 of 64 MiB) is smaller than the flag; the start-up log states the resulting sizes."""
    budget = 40 * 2**20
    budgets = spy_on_cache_budget(monkeypatch)
    with fake_cuda(monkeypatch, 64 * 2**20, 3 * 2**20), caplog.at_level(logging.INFO, logger="deltaserve"):
        runner = LLM(DENSE, **FIXED, enforce_eager=True, enable_prefix_caching=False, gpu_memory_utilization=0.5,
                     kv_cache_memory_bytes=budget).engine.runner  # fmt: skip
    assert budgets == [budget] and math.ceil(64 * 2**20 * 0.5) < budget
    assert (runner.layout.num_blocks, runner.layout.num_slots) == ((budget - 4 * SLOT) // BLOCK, 4)
    assert "warm-up: " in caplog.text  # the prefill shapes still compile and autotune before serving
    assert "gpu_memory_utilization 0.5 does not size it" in caplog.text
    blocks = (budget - 4 * SLOT) // BLOCK
    assert f"cache budget {budget} bytes (0.04 GiB, kv_cache_memory_bytes): {blocks} KV blocks" in caplog.text


def test_on_a_gpu_the_verify_warmup_is_sized_from_it(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # noqa: ANN001
    """Speculating on the GPU path (CUDA calls stood in): the warm-up's verify step takes as many rows as the given
    budget's verify scratch affords (4, max_num_seqs), where the faked GPU's share alone would afford 1."""
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    with fake_cuda(monkeypatch, 64 * 2**20, 3 * 2**20), caplog.at_level(logging.INFO, logger="deltaserve"):
        runner = LLM(DENSE, **FIXED, enforce_eager=True, enable_prefix_caching=False, gpu_memory_utilization=0.5,
                     kv_cache_memory_bytes=40 * 2**20, speculative_config=mtp).engine.runner  # fmt: skip
    assert "a verify step of 4 rows of 3 tokens with drafts and the MTP drafter" in caplog.text
    assert runner.spec.max_spec_seqs == 4


def test_a_capped_count_gives_its_unneeded_graph_buffers_back_to_the_cache(
    monkeypatch: pytest.MonkeyPatch,
    caplog,  # noqa: ANN001
) -> None:
    """The measured budget keeps the decode graphs' static buffers for vLLM's default count (here 256; 1,024 on a
    large GPU, whose graphs stop at 512 rows); once the count is capped to what the state pool affords, its graphs
    need fewer rows, and the difference becomes KV blocks (session 25: 1.37 GiB on the H100 27B)."""
    budgets = spy_on_cache_budget(monkeypatch)
    config = {**FIXED, "max_num_seqs": None, "enable_prefix_caching": False, "gpu_memory_utilization": 0.5}
    total = 2 * (warmup.HEADROOM_BYTES + 16 * 2**20)
    with fake_cuda(monkeypatch, total, 3 * 2**20), caplog.at_level(logging.INFO, logger="deltaserve"):
        runner = LLM(DENSE, **config).engine.runner
    upper = memory.default_max_num_seqs(runner.device)
    assert runner.is_graphed and runner.max_num_seqs < upper
    reserved = static_bytes(buckets(upper)[2], runner.vocab_size)
    needed = static_bytes(buckets(runner.max_num_seqs)[2], runner.vocab_size)
    assert warmup.graph_bytes(runner, upper)[1] == reserved and reserved > needed
    layout = runner.layout
    used = layout.num_blocks * layout.bytes_per_block + layout.num_slots * layout.bytes_per_slot
    budget = budgets[0] + reserved - needed
    assert budget - layout.bytes_per_block < used <= budget  # whole blocks out of the larger budget
    assert f"at max_num_seqs {runner.max_num_seqs}" in caplog.text and "more cache budget" in caplog.text
