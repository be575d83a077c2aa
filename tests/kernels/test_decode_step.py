"""benchmarks/decode_step.py on the CPU: the plumbing (model, cache, context, the model's labels, byte counts,
record) on the tiny checkpoints, the cliff check, and the byte model against hand counts. The GPU numbers need the
H200."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

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


def test_fp8_shapes_are_the_dummy_folders() -> None:
    """The FP8 keys of --shapes name the folders make_dummy_models.py writes (what scripts/h200.sh decode-step writes
    before the run), and the bf16 keys stay as they were."""
    spec = importlib.util.spec_from_file_location("make_dummy_models", ROOT / "benchmarks/oracle/make_dummy_models.py")
    dummies = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(dummies)
    fp8 = {key: folder for key, folder in decode_step.SHAPES.items() if key.endswith("-fp8")}
    assert fp8 == {"35b-a3b-fp8": "q35-35b-a3b-fp8", "27b-fp8": "q35-27b-fp8", "122b-a10b-fp8": "q35-122b-a10b-fp8"}
    assert set(fp8.values()) == set(dummies.FP8_SHAPES)
    assert decode_step.SHAPES["35b-a3b"] == "q35-35b-a3b" and decode_step.SHAPES["27b"] == "q35-27b"


def test_cpu_run_counts_fp8_weights_at_one_byte_plus_block_scales(
    tiny_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An FP8 folder runs as the served FP8 model (qkvz and ba as two GEMMs; the MoE block as one op up to
    FP8_BLOCK_MAX_TOKENS rows, as router + fused_moe above) and its projections' bytes are their float8 values at 1
    byte plus their fp32 scales, not 2 bytes an element."""
    from deltaserve.config import ModelConfig
    from deltaserve.kernels.moe import FP8_BLOCK_MAX_TOKENS
    from deltaserve.tiny.fp8 import write_fp8_checkpoint

    folder = write_fp8_checkpoint(tiny_moe, tmp_path / "models" / "moe-fp8")
    out = tmp_path / "record.json"
    argv = ["decode_step.py", "--device", "cpu", "--models", str(folder.parent), "--shapes", folder.name,
            "--batches", f"1,3,{FP8_BLOCK_MAX_TOKENS + 1}", "--context", "20", "--max-model-len", "64",
            "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert decode_step.main() == 0
    record = json.loads(out.read_text())
    assert not record["errors"]
    (run,) = record["runs"]
    assert run["is_fp8"] and "FP8 GEMM rate is not measured" in run["note"] and "NOTE" in record["summary"]
    config = ModelConfig.from_pretrained(folder)
    h, nq, d = config.hidden_size, config.num_attention_heads, config.head_dim
    n, k = h, nq * d  # o_proj [N, K]: whole 128-row blocks, so the scales are [ceil(N/128), ceil(K/128)] fp32
    o_proj = n * k * 1 + math.ceil(n / 128) * math.ceil(k / 128) * 4
    assert run["weight_bytes"]["attn.o_proj"] == o_proj != 2 * n * k
    num_attn, s = len(config.full_attention_layers), 4  # the CPU model's activations are fp32
    for row in run["rows"]:
        ops = {op["op"]: op for op in row["ops"]}
        b = row["batch"]
        assert {"gdn.in_proj_qkvz", "gdn.in_proj_ba"} <= set(ops) and "gdn.in_proj_qkvzba" not in ops, set(ops)
        if b <= FP8_BLOCK_MAX_TOKENS:
            assert "mlp.fused_moe_block" in ops and "mlp.fused_moe" not in ops, set(ops)
        else:
            assert {"mlp.moe_router", "mlp.fused_moe"} <= set(ops) and "mlp.fused_moe_block" not in ops, set(ops)
        assert ops["attn.o_proj"]["bytes"] == num_attn * (o_proj + (b * k + b * n) * s)


def test_fp8_weight_bytes_come_from_the_model_tensors(tiny_moe: Path, tmp_path: Path) -> None:
    """Built in bf16 as on the GPU: block-FP8 projections count 1 byte an element plus their fp32 scales; what the
    FP8 releases keep unquantized (lm_head, the router, in_proj_ba, shared_expert_gate) 2 bytes an element."""
    from deltaserve.tiny.fp8 import write_fp8_checkpoint

    folder = write_fp8_checkpoint(tiny_moe, tmp_path / "moe-fp8")
    config, model = decode_step.build_model(folder, torch.device("cpu"), torch.bfloat16)
    weights = decode_step.model_weight_bytes(model)
    h, v, hv = config.hidden_size, config.vocab_size, config.linear_num_value_heads
    e, i, ish = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    assert weights["lm.lm_head"] == v * h * 2
    assert weights["gdn.in_proj_ba"] == 2 * hv * h * 2
    assert weights["mlp.moe_router"] == e * h * 2 and weights["mlp.shared_gate"] == h * 2
    w13, w2 = model.layers[0].mlp.w13, model.layers[0].mlp.w2
    assert w13.weight.dtype == torch.float8_e4m3fn
    scales = (w13.scale.numel() + w2.scale.numel()) * 4 // e
    assert weights["mlp.expert"] == 3 * i * h + scales
    assert weights["mlp.shared_down"] == h * ish + math.ceil(h / 128) * math.ceil(ish / 128) * 4
    costs = decode_step.op_costs(config, batch=1, context=20, weights=weights)
    plain = decode_step.op_costs(config, batch=1, context=20)
    num_moe = sum(config.moe_layers)
    k = config.num_experts_per_tok
    assert costs["mlp.fused_moe"][0] == pytest.approx(k * (3 * i * h + scales) * num_moe + (h + 4 * k) * 2 * num_moe)
    assert costs["mlp.fused_moe"][1] == plain["mlp.fused_moe"][1]  # FLOPs do not depend on the format


def test_fp8_label_gets_the_fp8_projections_and_the_gemv_the_rest(tiny_moe: Path, tmp_path: Path) -> None:
    """In an FP8 model both the bf16 GEMV (in_proj_ba) and the FP8 GEMM (the quantized projections) escape the
    projections' ranges: each kernel's label gets the bytes of its own projections only; a bf16 model has none."""
    from deltaserve.tiny.fp8 import write_fp8_checkpoint

    folder = write_fp8_checkpoint(tiny_moe, tmp_path / "moe-fp8")
    _, model = decode_step.build_model(folder, torch.device("cpu"), torch.bfloat16)
    fp8 = decode_step.fp8_labels(model)
    assert {"gdn.in_proj_qkvz", "gdn.out_proj", "attn.qkv_proj", "attn.o_proj", "mlp.shared_gate_up",
            "mlp.shared_down"} <= fp8  # fmt: skip
    assert not fp8 & {"gdn.in_proj_ba", "lm.lm_head", "mlp.moe_router", "mlp.shared_gate"}
    _, plain = decode_step.build_model(tiny_moe, torch.device("cpu"), torch.bfloat16)
    assert decode_step.fp8_labels(plain) == set()
    assert decode_step.TRITON_LABELS["_fp8_gemm_kernel"] == decode_step.FP8_LABEL
    assert "_moe_fp8_gemm1_kernel" in decode_step.MOE_KERNELS


@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_bf16_weight_bytes_leave_the_counts_unchanged(tiny_dirs: dict[str, Path], variant: str) -> None:
    """A bf16 model's own tensors give the same counts as the shapes at 2 bytes an element (the records before FP8)."""
    config, model = decode_step.build_model(tiny_dirs[variant], torch.device("cpu"), torch.bfloat16)
    weights = decode_step.model_weight_bytes(model)
    assert {"lm.lm_head", "gdn.in_proj_qkvzba", "gdn.out_proj", "attn.qkv_proj", "attn.o_proj"} <= set(weights)
    for batch in (1, 7, 256):
        assert decode_step.op_costs(config, batch, 20, 2, weights) == decode_step.op_costs(config, batch, 20)


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
