"""benchmarks/prefix_cache_sim.py: the prefix grid's traffic through the real scheduler with a fake runner. Where
the state slots are few, protecting checkpoints that two sequences hit keeps the shared prefixes cached (the H100
27B's case, docs/prefix-caching.md#eviction-order); where they are many the two policies plan the same steps."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from deltaserve.scheduler import prefix_cache

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "prefix_cache_sim.py"


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prefix_cache_sim", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def layout(sim: ModuleType, slots: int, max_num_seqs: int):  # noqa: ANN201 - the tool's Layout
    return sim.Layout(kv_blocks=2000, slots=slots, max_num_seqs=max_num_seqs, budget=512, prefix_len=256,
                      suffix_len=32, output_len=4, num_prefixes=4)  # fmt: skip


def test_protecting_shared_prefixes_keeps_them_when_slots_are_few(sim: ModuleType) -> None:
    few = layout(sim, slots=8, max_num_seqs=4)
    lru, protect = sim.simulate(few, "lru", 8, 40), sim.simulate(few, "protect", 8, 40)
    assert (lru.hit_rate, protect.hit_rate) == (0.2, 0.4667)
    assert protect.prefill_tokens < lru.prefill_tokens
    assert prefix_cache.PROTECT_AFTER_HITTERS == 2  # the tool restores the served policy


def test_with_many_slots_the_policies_plan_the_same_steps(sim: ModuleType) -> None:
    many = layout(sim, slots=40, max_num_seqs=16)
    lru, protect = sim.simulate(many, "lru", 8, 40), sim.simulate(many, "protect", 8, 40)
    assert lru.hit_rate == protect.hit_rate == 0.8 and lru.steps == protect.steps


def test_the_prompts_are_vllms_layout(sim: ModuleType) -> None:
    prompts = sim.prompts(layout(sim, 8, 4), 10, seed=0)
    assert len(prompts) == 8 and all(len(p) == 288 for p in prompts)  # 4 prefixes x 10 // 4
    assert sorted(sum(p[:256] == q[:256] for q in prompts) for p in prompts) == [2] * 8


def test_the_command_line_writes_its_record(sim: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim.json"
    argv = ["--concurrencies", "4", "--kv-blocks", "400", "--slots", "8", "--max-num-seqs", "4", "--prefix-len",
            "128", "--suffix-len", "16", "--output-len", "2", "--out", str(out)]  # fmt: skip
    assert sim.main(argv) == 0
    record = json.loads(out.read_text())
    assert [p["policy"] for p in record["points"]] == ["lru", "protect"] and record["layout"]["slots"] == 8
    assert "c4 lru" in capsys.readouterr().out
    assert sim.main([*argv[:1], "", *argv[2:]]) == 2
    talk = ["--multi-turn", "--system-len", "64", "--turns", "2", "--user-len", "16"]
    assert sim.main([*argv, *talk]) == 0
    record = json.loads(out.read_text())
    assert record["conversations"] == {"system_len": 64, "turns": 2, "user_len": 16}
    assert [p["num_prompts"] for p in record["points"]] == [8, 8]  # 4 clients x 2 turns, each policy


def test_each_turn_of_a_conversation_computes_only_what_is_new(sim: ModuleType) -> None:
    """--multi-turn on a roomy layout: the shared system prompt is computed once, and every later turn resumes at its
    previous turn's generation-end checkpoint, computing its user tokens and the previous answer's last token (the
    one the state had not consumed)."""
    roomy = sim.Layout(kv_blocks=2000, slots=40, max_num_seqs=16, budget=512, prefix_len=0, suffix_len=0,
                       output_len=8, num_prefixes=1, max_model_len=1024)  # fmt: skip
    clients, talk = 4, sim.Conversations(system_len=128, turns=4, user_len=32)
    for policy in ("lru", "protect"):
        point = sim.simulate_conversations(roomy, policy, clients, talk)
        assert point.num_prompts == clients * talk.turns and point.preemptions == 0
        new = talk.system_len + clients * talk.user_len + clients * (talk.turns - 1) * (talk.user_len + 1)
        assert point.prefill_tokens == new == 652
