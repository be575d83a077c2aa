"""`gate tokens --reference vllm` on the CPU, against a fake `vllm` module: the registry builds the oracle, the
record states what the (fake) engine reports, margins come from its top-k raw logits; without vLLM the gate
refuses clearly. The real run is on the H200 (the lead's device plan)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from deltaserve.bench import registry, registry_types
from deltaserve.gates import tokens
from deltaserve.gates.references import load_transformers
from deltaserve.gates.tokens import run_gate


class FakeLayer(torch.nn.Module):
    def __init__(self, **facts: Any) -> None:
        super().__init__()
        for name, value in facts.items():
            setattr(self, name, value)


def fake_vllm(model_dir: Path, built: list[dict[str, Any]], is_fused: bool) -> types.ModuleType:
    """A `vllm` module whose LLM runs transformers' fp32 greedy loop and reports top-20 raw logits per step."""
    module = types.ModuleType("vllm")
    module.__version__ = "0.26.0-fake"

    class SamplingParams:
        def __init__(self, **kwargs: Any) -> None:
            self.__dict__.update(kwargs)

    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            built.append(kwargs)
            multimodal = types.SimpleNamespace(language_model_only=kwargs["language_model_only"])
            self.llm_engine = types.SimpleNamespace(
                vllm_config=types.SimpleNamespace(
                    model_config=types.SimpleNamespace(
                        dtype=kwargs["dtype"], max_model_len=4096, enforce_eager=kwargs["enforce_eager"],
                        logprobs_mode=kwargs["logprobs_mode"], multimodal_config=multimodal,
                    ),
                    cache_config=types.SimpleNamespace(
                        mamba_ssm_cache_dtype=kwargs["mamba_ssm_cache_dtype"], cache_dtype="auto",
                        enable_prefix_caching=kwargs["enable_prefix_caching"],
                    ),
                    scheduler_config=types.SimpleNamespace(
                        max_num_batched_tokens=kwargs["max_num_batched_tokens"], max_num_seqs=256,
                        async_scheduling=True,
                    ),
                    compilation_config=types.SimpleNamespace(mode="VLLM_COMPILE", cudagraph_mode="FULL_AND_PIECEWISE",
                                                             cudagraph_capture_sizes=[1, 2, 4]),
                    attention_config=types.SimpleNamespace(backend=None),
                    additional_config={"gdn_prefill_backend": kwargs.get("gdn_prefill_backend")},
                ),
                engine_core=types.SimpleNamespace(shutdown=lambda: built.append({"shutdown": True})),
            )  # fmt: skip
            self.model, _ = load_transformers(model_dir, torch.float32, "cpu")

        def apply_model(self, func: Any) -> list[Any]:
            model = torch.nn.Sequential(
                FakeLayer(use_fused_qk_norm_rope_gate=is_fused),
                FakeLayer(use_fused_qk_norm_rope_gate=is_fused),
                FakeLayer(gdn_prefill_backend="triton"),
            )
            return [func(model)]

        def generate(self, prompts: list[dict], params: SamplingParams, use_tqdm: bool = False) -> list[Any]:
            outputs = []
            for prompt in prompts:
                ids = list(prompt["prompt_token_ids"])
                tokens, steps = [], []
                with torch.no_grad():
                    for _ in range(params.max_tokens):
                        logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1]
                        top = torch.topk(logits, params.logprobs)
                        pairs = zip(top.values.tolist(), top.indices.tolist(), strict=True)
                        steps.append({t: types.SimpleNamespace(logprob=v) for v, t in pairs})
                        ids.append(int(torch.argmax(logits)))
                        tokens.append(ids[-1])
                completion = types.SimpleNamespace(token_ids=tokens, logprobs=steps)
                outputs.append(types.SimpleNamespace(outputs=[completion]))
            return outputs

    module.LLM = LLM
    module.SamplingParams = SamplingParams
    return module


@pytest.mark.parametrize("is_fused", [True, False])
def test_vllm_reference_goes_through_the_registry_and_records_what_vllm_reports(
    tiny_dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, is_fused: bool
) -> None:
    built: list[dict[str, Any]] = []
    applied: list[dict[str, str]] = []
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(tiny_dense, built, is_fused))
    monkeypatch.setattr(registry, "apply_environment", applied.append)
    record_path = tmp_path / "gate.json"
    code = run_gate(tiny_dense, reference="vllm", num_prompts=3, max_tokens=4, record_path=record_path)
    assert code == 0
    kwargs, shutdown = built
    assert shutdown == {"shutdown": True}  # the oracle gives the device back before deltaserve runs
    assert kwargs == registry.vllm_engine(str(tiny_dense), 160, dtype="float32", seed=0).kwargs
    assert kwargs["language_model_only"] is True and kwargs["enforce_eager"] is False
    assert applied[0]["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    record = json.loads(record_path.read_text())
    config = record["reference_config"]
    assert record["strict"] == {"num_exact": 3, "num_prompts": 3}
    assert config["is_fused_preamble"] is is_fused and config["gdn_prefill_kernel"] == "triton"
    assert config["language_model_only"] is True and config["compilation_mode"] == "VLLM_COMPILE"
    assert config["registry"]["deviations"] == ["gdn-prefill-triton", "flashinfer-sampler-off"]
    assert "gdn-prefill-triton" in config["registry"]["denominator_note"]
    assert record["output"][0].startswith("STRICT 3/3 against vllm 0.26.0-fake (float32)")
    assert any("over vLLM's top-20 logits per step" in line for line in record["output"])


def test_vllm_reference_margin_of_a_mismatch_comes_from_its_top_k(
    tiny_dense: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from deltaserve.engine import llm as llm_module

    built: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(tiny_dense, built, True))
    monkeypatch.setattr(registry, "apply_environment", lambda env: None)
    generate = llm_module.LLM.generate

    def one_wrong_token(self: object, *args: object, **kwargs: object) -> object:
        outputs = generate(self, *args, **kwargs)
        # a padding id past the tokenizer: its logit is exactly 0, far below the random model's top 20
        outputs[0].outputs[0].token_ids[1] = 1320
        return outputs

    monkeypatch.setattr(llm_module.LLM, "generate", one_wrong_token)
    assert run_gate(tiny_dense, reference="vllm", num_prompts=2, max_tokens=3) == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  prompt 0"))
    assert "output position 1" in line and "reference margin > " in line and "beyond the near-tie margin" in line


def test_without_vllm_the_gate_refuses_clearly(
    tiny_dense: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it raises ImportError
    assert run_gate(tiny_dense, reference="vllm", num_prompts=2, max_tokens=2) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "vLLM is not importable" in out and "unpack.sh" in out


def test_one_vllm_run_serves_several_deltaserve_configurations(
    tiny_dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(tiny_dense, built, True))
    monkeypatch.setattr(registry, "apply_environment", lambda env: None)
    cache = tmp_path / "vllm-run.json"
    assert run_gate(tiny_dense, reference="vllm", num_prompts=2, max_tokens=3, reference_cache=cache) == 0
    assert run_gate(tiny_dense, reference="vllm", num_prompts=2, max_tokens=3, reference_cache=cache) == 0
    assert len([b for b in built if "model" in b]) == 1
    assert "reference's run comes from" in capsys.readouterr().out
    # another prompt set does not reuse it
    assert run_gate(tiny_dense, reference="vllm", num_prompts=2, max_tokens=3, seed=1, reference_cache=cache) == 0
    assert len([b for b in built if "model" in b]) == 2


def test_reference_only_runs_share_the_gpu_then_the_gate_reads_the_cache(
    tiny_dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from deltaserve.engine import llm as llm_module

    built: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(tiny_dense, built, True))
    monkeypatch.setattr(registry, "apply_environment", lambda env: None)
    engines: list[dict[str, Any]] = []
    init = llm_module.LLM.__init__

    def recording_init(self: object, *args: object, **kwargs: Any) -> None:
        engines.append(kwargs)
        init(self, *args, **kwargs)

    monkeypatch.setattr(llm_module.LLM, "__init__", recording_init)
    cache = tmp_path / "vllm-run.json"
    options = {"num_prompts": 2, "max_tokens": 3, "reference_cache": cache, "share_gpu": True}
    assert run_gate(tiny_dense, reference="vllm", is_reference_only=True, **options) == 0
    assert cache.is_file() and engines == []  # the reference ran alone: no deltaserve engine, no verdict
    out = capsys.readouterr().out
    assert "--reference-only" in out and "no verdict" in out and "STRICT" not in out
    kwargs = next(b for b in built if "model" in b)
    assert kwargs["gpu_memory_utilization"] == registry_types.SHARED_GPU_ENGINE_KWARGS["gpu_memory_utilization"][0]
    assert kwargs["kv_cache_memory_bytes"] == 2**30 and kwargs["enforce_eager"] is False
    assert run_gate(tiny_dense, reference="vllm", **options) == 0  # the gate proper: from the cache
    assert len([b for b in built if "model" in b]) == 1
    assert engines[0]["gpu_memory_utilization"] == tokens.SHARED_GPU_UTILIZATION
    out = capsys.readouterr().out
    assert "reference's run comes from" in out and "STRICT 2/2 against vllm" in out
    # without --share-gpu the oracle is the production configuration: no cache-size settings
    assert "kv_cache_memory_bytes" not in registry.vllm_engine(str(tiny_dense), 160).kwargs
