"""benchmarks/decode_step.py on the CPU: the plumbing (model, cache, context, the model's labels, byte counts,
record) on the tiny checkpoints, the cliff check, and the byte model against hand counts. The GPU numbers need the
H200."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> object:
    spec = importlib.util.spec_from_file_location("decode_step", ROOT / "benchmarks" / "decode_step.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["decode_step"] = module
    spec.loader.exec_module(module)
    return module


decode_step = _load()


def test_cpu_run_writes_a_record_with_every_op_labelled(
    tiny_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "record.json"
    argv = ["decode_step.py", "--device", "cpu", "--models", str(tiny_moe.parent), "--shapes", tiny_moe.name,
            "--batches", "1,3", "--context", "20", "--max-model-len", "64", "--variants", "nopdl,model",
            "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert decode_step.main() == 0
    record = json.loads(out.read_text())
    assert not record["errors"]
    variants = {run["variant"]: run for run in record["runs"]}
    assert set(variants) == {"nopdl", "model"}
    for run in variants.values():
        assert [row["batch"] for row in run["rows"]] == [1, 3]
        for row in run["rows"]:
            labels = {op["op"] for op in row["ops"]}
            assert {"gdn.in_proj_qkvzba", "gdn.gdn_decode", "attn.paged_attention", "lm.lm_head"} <= labels, labels
            assert {"attn.attn_preamble", "attn.o_proj", "gdn.out_proj", "layer.rms_norm"} <= labels, labels
            assert "unlabelled" not in labels
            assert not any(label.split(".")[1].isdigit() for label in labels)  # per-layer ranges fold into ops
            assert row["floor_ms"] > 0 and row["eager_ms"] > 0
    # the committed model runs its MoE block as one op, router and shared expert included
    assert "mlp.fused_moe_block" in {op["op"] for op in variants["model"]["rows"][0]["ops"]}
    assert "decode step eager_ms by batch size" in record["summary"]
    # the labels come from the model itself (nothing patched) and are off again after the run
    from deltaserve.model import labels
    from deltaserve.model.layers import mlp

    assert not labels.is_enabled()
    assert mlp.MoEBlock.forward.__module__ == "deltaserve.model.layers.mlp"
    from deltaserve.kernels import linear

    assert mlp.linear is linear


def test_cliffs_report_a_larger_batch_that_is_faster() -> None:
    rows = [{"batch": 1, "t": 4.5}, {"batch": 32, "t": 15.5}, {"batch": 48, "t": 33.2}, {"batch": 128, "t": 28.3}]
    found = decode_step.cliffs(rows, "t")
    assert found == ["B=48 33.20 ms > B=128 28.30 ms"]
    assert decode_step.cliffs([{"batch": 1, "t": 1.0}, {"batch": 2, "t": 0.97}], "t") == []  # within 5 %


def test_byte_model_counts_the_weights_a_decode_token_reads(tiny_moe: Path) -> None:
    from deltaserve.config import ModelConfig

    config = ModelConfig.from_pretrained(tiny_moe)
    costs = decode_step.op_costs(config, batch=1, context=20)
    h, v = config.hidden_size, config.vocab_size
    assert costs["lm.lm_head"][0] == (v * h + h + v) * 2
    assert costs["lm.lm_head"][1] == 2 * v * h
    e, k, i = config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
    assert decode_step.expected_experts(e, k, 1) == pytest.approx(k)
    num_moe = sum(config.moe_layers)
    experts_bytes = k * 3 * i * h * 2 * num_moe
    assert costs["mlp.fused_moe"][0] == pytest.approx(experts_bytes + (h + 4 * k) * 2 * num_moe)
    assert decode_step.expected_experts(256, 8, 10**6) == pytest.approx(256)


def test_every_step_is_timed_before_the_first_profile(
    tiny_moe: Path, tiny_dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once torch.profiler has run, CUPTI stays attached and later CUDA-graph replays pay for it (~0.25 ms a step at
    B = 1 on the H200), so every shape's and variant's timing must come before any profile."""
    assert tiny_moe.parent == tiny_dense.parent
    calls: list[tuple[str, int]] = []
    time_batch, profile_batch = decode_step.time_batch, decode_step.profile_batch

    def timed(*args: object, **kwargs: object) -> dict:
        calls.append(("time", args[3]))
        return time_batch(*args, **kwargs)

    def profiled(*args: object, **kwargs: object) -> None:
        calls.append(("profile", args[3]["batch"]))
        profile_batch(*args, **kwargs)

    monkeypatch.setattr(decode_step, "time_batch", timed)
    monkeypatch.setattr(decode_step, "profile_batch", profiled)
    out = tmp_path / "record.json"
    argv = ["decode_step.py", "--device", "cpu", "--models", str(tiny_moe.parent), "--shapes",
            f"{tiny_moe.name},{tiny_dense.name}", "--batches", "1,2", "--context", "20", "--max-model-len", "64",
            "--variants", "model,nopdl", "--out", str(out)]  # fmt: skip
    monkeypatch.delenv("DELTASERVE_PDL", raising=False)
    monkeypatch.setattr(sys, "argv", argv)
    assert decode_step.main() == 0
    kinds = [kind for kind, _ in calls]
    assert kinds == ["time"] * 8 + ["profile"] * 8, calls
    record = json.loads(out.read_text())
    rows = [row for run in record["runs"] for row in run["rows"]]
    assert len(rows) == 8 and all("eager_ms" in row and row["ops"] for row in rows)
    assert "DELTASERVE_PDL" not in os.environ  # the variant's setting is put back


def test_warmup_pass_times_the_first_variant_unrecorded(
    tiny_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first variant timed in a process read up to 0.14 ms slower at B = 1 on the H200, so (on by default on
    the GPU) the first variant's batches are timed once under its own settings before the recorded passes, and only
    the recorded passes reach the record."""
    from deltaserve import env

    calls: list[tuple[int, bool]] = []
    time_batch = decode_step.time_batch

    def timed(*args: object, **kwargs: object) -> dict:
        calls.append((args[3], env.pdl()))
        return time_batch(*args, **kwargs)

    monkeypatch.setattr(decode_step, "time_batch", timed)
    out = tmp_path / "record.json"
    argv = ["decode_step.py", "--device", "cpu", "--warmup-pass", "--models", str(tiny_moe.parent), "--shapes",
            tiny_moe.name, "--batches", "1,2", "--context", "20", "--max-model-len", "64",
            "--variants", "nopdl,model", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert decode_step.main() == 0
    # warm-up (nopdl: PDL off), then nopdl, then model (PDL on)
    assert calls == [(1, False), (2, False), (1, False), (2, False), (1, True), (2, True)], calls
    record = json.loads(out.read_text())
    assert record["is_warmup_pass"] is True
    assert [(run["variant"], len(run["rows"])) for run in record["runs"]] == [("nopdl", 2), ("model", 2)]


def test_unknown_variant_feature_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A misspelt feature would otherwise time the committed model under the wrong name."""
    argv = ["decode_step.py", "--device", "cpu", "--variants", "model,nopdl+nogemv", "--out", str(tmp_path / "r.json")]
    monkeypatch.setattr(sys, "argv", argv)
    assert decode_step.main() == 2
    assert not (tmp_path / "r.json").exists()


def test_gemv_label_costs_the_projections_it_ran() -> None:
    """The register GEMV's launches escape the projections' ranges: the GEMV's label gets the bytes of the projections
    that were called but claimed no kernel, not of those cuBLAS ran (lm_head) or that were not called (the unfused
    in_proj)."""
    costs = {"gdn.in_proj_qkvzba": (50.0, 5.0), "gdn.in_proj_qkvz": (40.0, 4.0), "gdn.out_proj": (16.0, 1.0),
             "lm.lm_head": (1000.0, 10.0), "layer.rms_norm": (1.0, 0.0)}  # fmt: skip
    by_label = {"lm.lm_head": {}, decode_step.GEMV_LABEL: {}, "layer.rms_norm": {}}
    called = {"gdn.in_proj_qkvzba", "gdn.out_proj", "lm.lm_head"}
    assert decode_step.gemv_cost(by_label, costs, called) == (66.0, 6.0)


def test_model_labels_fold_into_ops() -> None:
    """A layer's own range stands for what it runs outside its ops, by the layer's kind; compute_logits' for the
    logits' upcast; an op label is itself."""
    assert decode_step.op_of("layer.3.full_attention") == "attn.other"
    assert decode_step.op_of("layer.12.linear_attention") == "gdn.other"
    assert decode_step.op_of("lm") == "lm.other"
    assert decode_step.op_of("attn.qkv_proj") == "attn.qkv_proj"
    assert decode_step.op_of("layer.rms_norm") == "layer.rms_norm"


def test_the_default_record_is_filed_with_the_kernel_records() -> None:
    path = decode_step.default_out("decode-step")
    assert path.parent == ROOT / "benchmarks" / "results" / "kernels"
    assert path.name.startswith("decode-step-") and path.suffix == ".json"
