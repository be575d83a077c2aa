"""benchmarks/mixed_step.py on the CPU: case parsing, the step it builds (a mixed step computes the same logits as
its prefill-only and decode-only halves), and the record's parts / lost columns. GPU times need the H200."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.support.scripts import load_script


def _load() -> object:
    return load_script("mixed_step")


mixed_step = _load()


def test_parse_case() -> None:
    case = mixed_step.parse_case("2x1024+512@32")
    assert case.prompts == (1024, 1024, 512) and case.num_decodes == 32
    assert case.name == "2x1024+512@32"
    assert mixed_step.parse_case("0@8").prompts == ()
    assert mixed_step.parse_case("2048@0").name == "2048@0"
    defaults = mixed_step.parse_cases(mixed_step.build_parser().parse_args(["--out", "x.json"]).cases)
    assert len(defaults) == 13 and mixed_step.Case((2048,), 32) in defaults
    for bad in ("0@0", "1024", "x@3", "1024@-1"):
        with pytest.raises(ValueError):
            mixed_step.parse_case(bad)


def _logits(model: object, config: object, cache: object, case: object, context: int) -> torch.Tensor:
    from deltaserve.model.context import forward_context

    ctx, ids, positions, rows = mixed_step.step_inputs(case, cache, context, config.vocab_size, torch.device("cpu"))
    with torch.inference_mode(), forward_context(ctx):
        hidden = model(ids, positions)
    return model.compute_logits(hidden.index_select(0, rows))


def _real_model(model_dir: Path) -> tuple[object, object]:
    """The tiny checkpoint's own weights (vLLM's dummy scheme, U(-1e-3, 1e-3), makes logits that hardly depend on
    the cache or the state, so a wrong context would pass)."""
    from deltaserve.config import ModelConfig
    from deltaserve.model.loader import load_checkpoint
    from deltaserve.model.qwen3_5 import Qwen35Model

    config = ModelConfig.from_pretrained(model_dir)
    model = Qwen35Model(config, torch.float32, torch.device("cpu"))
    load_checkpoint(model, config, model_dir)
    model.fuse_projections()
    return config, model.eval()


def test_a_mixed_step_computes_what_its_halves_compute(tiny_moe: Path) -> None:
    """The prompts' last-token logits and the decodes' logits of `2x12@3` equal those of `2x12@0` and `0@3` (each
    half from the same cache and state it would see alone): the context the benchmark builds is a real step."""
    ds = mixed_step.ds
    config, model = _real_model(tiny_moe)
    context = 20
    cache = ds.bind_cache(model, config, 5, context, 64, 16)
    gdn = [layer.linear_attn for layer in model.layers if not layer.is_full_attention]
    saved = [(m.conv_states.clone(), m.ssm_states.clone()) for m in gdn]

    def restore() -> None:  # a step updates the decodes' state slots in place
        for m, (conv, ssm) in zip(gdn, saved, strict=True):
            m.conv_states.copy_(conv)
            m.ssm_states.copy_(ssm)

    mixed = _logits(model, config, cache, mixed_step.parse_case("2x12@3"), context)
    restore()
    decodes = _logits(model, config, cache, mixed_step.parse_case("0@3"), context)
    restore()
    assert mixed.shape == (5, config.vocab_size)
    torch.testing.assert_close(mixed[:3], decodes, rtol=1e-3, atol=2e-3)  # fp32 noise at logits of ~15
    # the prompts alone sit in rows 0-1 of the cache, in the mixed step in rows 3-4: same tokens, same logits
    config2, model2 = config, model
    cache2 = ds.bind_cache(model2, config2, 5, context, 64, 16)
    cache2.block_tables[:2] = cache.block_tables[3:5]
    prompts = _logits(model2, config2, cache2, mixed_step.parse_case("2x12@0"), context)
    torch.testing.assert_close(mixed[3:], prompts, rtol=1e-3, atol=2e-3)  # fp32 noise at logits of ~15


def test_a_decode_continues_its_prefill(tiny_moe: Path) -> None:
    """Independent of how the halves are built: prefill 20 tokens of row 0, then decode token 20 of row 0 (the
    context the benchmark builds for decodes, reading the KV blocks and state slot the prefill wrote): its logits
    equal the last logits of one 21-token prefill."""
    ds = mixed_step.ds
    config, model = _real_model(tiny_moe)
    cache = ds.bind_cache(model, config, 2, 21, 64, 16)
    whole = _logits(model, config, cache, mixed_step.parse_case("21@0"), 20)
    _logits(model, config, cache, mixed_step.parse_case("20@0"), 20)
    decode = _logits(model, config, cache, mixed_step.parse_case("0@1"), 20)
    torch.testing.assert_close(decode, whole, rtol=1e-3, atol=2e-3)  # fp32 noise at logits of ~15


def test_cpu_run_records_parts_and_lost(tiny_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "record.json"
    argv = ["mixed_step.py", "--device", "cpu", "--models", str(tiny_moe.parent), "--shapes", tiny_moe.name,
            "--cases", "24@0,0@2,24@2,0@3", "--context", "20", "--max-model-len", "64", "--reps", "1",
            "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert mixed_step.main() == 0
    record = json.loads(out.read_text())
    assert not record["errors"]
    rows = record["shapes"][tiny_moe.name]
    assert set(rows) == {"24@0", "0@2", "24@2", "0@3"}
    mixed = rows["24@2"]
    assert mixed["parts_ms"] == pytest.approx(rows["24@0"]["ms"] + rows["0@2"]["ms"], abs=2e-3)
    assert mixed["lost_ms"] == pytest.approx(mixed["ms"] - mixed["parts_ms"], abs=2e-3)
    assert mixed["lost_us_by_op"] and "gdn.gdn_prefill" in mixed["ops_us"] and "gdn.gdn_decode" in mixed["ops_us"]
    assert "parts_ms" not in rows["24@0"] and "parts_ms" not in rows["0@3"]
    assert rows["24@0"]["flops"] > rows["0@2"]["flops"] > 0
    # the host side: issue time per case (on the CPU the step runs on the host, so it is the step's own time) and
    # one run's functions by own time, largest first
    for row in rows.values():
        assert row["host_ms"] > 0 and 0 < len(row["host_top"]) <= mixed_step.HOST_PROFILE_TOP
        own = [entry["tottime_ms"] for entry in row["host_top"]]
        assert own == sorted(own, reverse=True) and own[0] > 0
