"""The step contract's prefix-cache checkpoints, on the runner alone (docs/prefix-caching.md): a chunk that ends at a
checkpoint position saves its GDN state into the checkpoint slot; a second sequence that shares the first's KV
blocks for [0, P) and reads that slot continues exactly as the first did (fp32, tiny dense / moe / next); and what
the runner does not implement is refused by name, never ignored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import NewRequest, ScheduledSeq, StepPlan
from deltaserve.tiny.trained import trained_model_dir

TOKENS = [(11 * i + 5) % 400 + 7 for i in range(100)]
P = 64  # the checkpoint position: a multiple of the GDN chunk and of the KV block


@pytest.fixture(scope="module", params=["dense", "moe", "next"])
def llm(request: pytest.FixtureRequest, tiny_dense: Path, tiny_moe: Path, tiny_next: Path) -> LLM:
    path = {"dense": tiny_dense, "moe": tiny_moe, "next": tiny_next}[request.param]
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, async_scheduling=False)


def _logits(result_logits: bytes | None, size: int) -> torch.Tensor:
    assert result_logits is not None
    return torch.frombuffer(bytearray(result_logits), dtype=torch.float32).view(size, -1)


@contextlib.contextmanager
def _held(
    llm: LLM, num_rows: int, num_slots: int, block_lists: list[tuple[int, int]]
) -> Iterator[tuple[list[int], list[int], list[list[int]]]]:
    """Rows, state slots and KV blocks (one list per (tokens, cached blocks) entry) taken from the scheduler's pools
    for a test that drives the runner by hand; on leaving, the rows are removed from the runner and all goes back."""
    scheduler, runner = llm.engine.scheduler, llm.engine.runner
    blocks = [scheduler.blocks.allocate(scheduler.blocks.blocks_needed(n, cached)) for n, cached in block_lists]
    slots = [scheduler.slots.allocate() for _ in range(num_slots)]
    rows = [scheduler.rows.allocate() for _ in range(num_rows)]
    try:
        yield rows, slots, blocks
    finally:
        runner.run(StepPlan(-1, (), removed=tuple(rows)))
        scheduler.blocks.free([block for one in blocks for block in one])
        for slot in slots:
            scheduler.slots.free(slot)
        for row in rows:
            scheduler.rows.free(row)


def test_a_checkpoint_restores_the_state_at_its_position(llm: LLM) -> None:
    engine = llm.engine
    scheduler, runner = engine.scheduler, engine.runner
    block_size = scheduler.blocks.block_size
    assert P % block_size == 0
    params = SamplingParams(temperature=0.0, max_tokens=1)
    tail = len(TOKENS) - P
    with _held(llm, 2, 3, [(len(TOKENS), 0), (len(TOKENS), P // block_size)]) as held:
        (row_a, row_b), (slot_a, slot_b, checkpoint), (blocks_a, blocks_b) = held
        # A: [0, P) saving its state at P, then [P, L) from its own slot
        add_a = (NewRequest(row_a, "a", tuple(TOKENS), (), params, ()),)
        head = ScheduledSeq(row_a, 0, P, slot_a, None, tuple(blocks_a), False, checkpoints=((P, checkpoint),))
        runner.run(StepPlan(-1, (head,), add_a))
        rest = ScheduledSeq(row_a, P, tail, slot_a, slot_a, (), False, return_logits=True)
        expected = _logits(runner.run(StepPlan(-1, (rest,))).logits[0], tail)
        # B: the same tokens; KV blocks of [0, P) shared with A, the state read from the checkpoint, written to its
        # own slot: the checkpoint is never written (B runs twice from it)
        add_b = (NewRequest(row_b, "b", tuple(TOKENS), (), params, ()),)
        shared = tuple(blocks_a[: P // block_size]) + tuple(blocks_b)
        for index in range(2):
            if index:  # run the same chunk again from a fresh row: the checkpoint slot must be unchanged
                runner.run(StepPlan(-1, (), removed=(row_b,)))
            seq = ScheduledSeq(row_b, P, tail, slot_b, checkpoint, shared, False, return_logits=True)
            result = runner.run(StepPlan(-1, (seq,), add_b))
            assert torch.equal(_logits(result.logits[0], tail), expected), f"run {index} from the checkpoint"


def test_a_checkpoint_without_a_restore_differs(llm: LLM) -> None:
    """The check above can fail: B started from a zero state (read_slot None) at P gives other logits."""
    engine = llm.engine
    scheduler, runner = engine.scheduler, engine.runner
    block_size = scheduler.blocks.block_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    tail = len(TOKENS) - P
    with _held(llm, 1, 1, [(len(TOKENS), 0)]) as ((row,), (slot,), (blocks,)):
        add = (NewRequest(row, "a", tuple(TOKENS), (), params, ()),)
        runner.run(StepPlan(-1, (ScheduledSeq(row, 0, P, slot, None, tuple(blocks), False),), add))
        warm = _logits(runner.run(StepPlan(-1, (ScheduledSeq(row, P, tail, slot, slot, (), False,
                                                             return_logits=True),))).logits[0], tail)  # fmt: skip
        runner.run(StepPlan(-1, (), removed=(row,)))
        add = (NewRequest(row, "b", tuple(TOKENS), (), params, ()),)
        cold_seq = ScheduledSeq(row, P, tail, slot, None, tuple(blocks[: -(-len(TOKENS) // block_size)]), False,
                                return_logits=True)  # fmt: skip
        cold = _logits(runner.run(StepPlan(-1, (cold_seq,), add)).logits[0], tail)
        assert not torch.equal(cold, warm)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"checkpoints": ((32, 9),)}, r"checkpoints: position 32 is neither this chunk's end \(64\)"),
        ({"checkpoints": ((64, 0),)}, r"checkpoints: slot 0 is the sequence's own read or write slot"),
        # a draft on a prefill chunk: a verify chunk is a decode of 1 + k tokens
        ({"num_draft_tokens": 1}, r"a verify chunk computes 1 \+ k tokens from its own slot and samples: got 64"),
    ],
)
def test_what_the_runner_does_not_implement_is_refused(llm: LLM, fields: dict, message: str) -> None:
    runner = llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with _held(llm, 1, 0, [(P, 0)]) as ((row,), _, (blocks,)):
        seq = ScheduledSeq(row, 0, P, 0, None, tuple(blocks), False, **fields)
        with pytest.raises(ValueError, match=message):
            runner.run(StepPlan(-1, (seq,), (NewRequest(row, "r", tuple(TOKENS[:P]), (), params, ()),)))


@pytest.mark.parametrize("copies", [True, False])
def test_a_hit_inside_a_block_continues_in_a_copy_of_the_partial_block(llm: LLM, copies: bool) -> None:
    """StepPlan.block_copies: B shares A's full blocks of [0, 64), gets a copy of A's block holding [64, 72) and
    reads A's checkpoint at 72; its logits over [72, L) equal A's. Without the copy (its block holds no KV for
    [64, 72)) they differ: the check can fail."""
    engine = llm.engine
    scheduler, runner = engine.scheduler, engine.runner
    block_size = scheduler.blocks.block_size
    position, num_full = 72, 72 // block_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    tail = len(TOKENS) - position
    with _held(llm, 2, 3, [(len(TOKENS), 0), (len(TOKENS), num_full)]) as held:
        (row_a, row_b), (slot_a, slot_b, checkpoint), (blocks_a, blocks_b) = held
        add_a = (NewRequest(row_a, "a", tuple(TOKENS), (), params, ()),)
        head = ScheduledSeq(
            row_a, 0, position, slot_a, None, tuple(blocks_a), False, checkpoints=((position, checkpoint),)
        )
        runner.run(StepPlan(-1, (head,), add_a))
        rest = ScheduledSeq(row_a, position, tail, slot_a, slot_a, (), False, return_logits=True)
        expected = _logits(runner.run(StepPlan(-1, (rest,))).logits[0], tail)
        add_b = (NewRequest(row_b, "b", tuple(TOKENS), (), params, ()),)
        table = tuple(blocks_a[:num_full]) + tuple(blocks_b)
        seq = ScheduledSeq(row_b, position, tail, slot_b, checkpoint, table, False, return_logits=True)
        block_copies = ((blocks_a[num_full], blocks_b[0]),) if copies else ()
        got = _logits(runner.run(StepPlan(-1, (seq,), add_b, block_copies=block_copies)).logits[0], tail)
        assert torch.equal(got, expected) == copies


def test_two_ranks_hit_the_cache_as_one_rank_computes_without_it() -> None:
    """Tensor parallelism: every rank applies the same state and block copies to its own shard, so a hit inside a
    block (the base prompt's end checkpoint at 200) gives the tokens of one rank without the cache."""
    model = trained_model_dir("dense")
    corpus = (Path(__file__).parents[2] / "deltaserve" / "tiny" / "corpus.txt").read_text()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    for name, kwargs in (("one", {"enable_prefix_caching": False}), ("two", {"tensor_parallel_size": 2})):
        llm = LLM(model, dtype="float32", device="cpu", max_model_len=256, **kwargs)
        try:
            ids = llm.get_tokenizer().encode(corpus[:4000])
            prompts = [ids[:200], ids[:200] + ids[300:310]]
            tokens[name] = [list(llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids)
                            for p in prompts]  # fmt: skip
            if name == "two":
                assert llm.engine.scheduler.prefix_cache_hits >= 200
        finally:
            llm.shutdown()
    assert tokens["two"] == tokens["one"]
