"""The default step token budget (engine/budget.py): the active-parameter count against the model's own parameters,
and the budgets it gives the H200 dummy shapes (2048 for the 27B, 8192 for 35B-A3B), the CPU and a given flag."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.budget import active_params_per_token, default_max_num_batched_tokens

ROOT = Path(__file__).resolve().parents[2]


def _counted(config: ModelConfig) -> float:
    """The same number from the built model: every weight matrix of the decoder layers, the routed experts' at
    num_experts_per_tok / num_experts (a token reads top-k of them)."""
    from deltaserve.model.qwen3_5 import Qwen35Model

    model = Qwen35Model(config, torch.bfloat16, torch.device("meta"))
    total = 0.0
    for name, param in model.layers.named_parameters():
        if param.dim() < 2 and not name.endswith("shared_expert_gate"):
            continue  # norms, biases, A_log, dt_bias: vectors, not matrix work
        if "conv1d" in name:
            continue  # the depthwise conv: kernel-width taps per channel
        share = config.num_experts_per_tok / config.num_experts if name.split(".")[-1] in ("w13", "w2") else 1.0
        total += param.numel() * share
    return total


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelConfig]:
    spec = importlib.util.spec_from_file_location("make_dummy_models", ROOT / "benchmarks/oracle/make_dummy_models.py")
    assert spec is not None and spec.loader is not None
    dummy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dummy)
    root = tmp_path_factory.mktemp("shapes")
    configs = {}
    for name in dummy.SHAPES:
        dummy.write_config(str(root / name), name)
        configs[name] = ModelConfig.from_pretrained(root / name)
    return configs


def test_active_params_match_the_built_models(shapes: dict[str, ModelConfig], tiny_moe: Path, tiny_dense: Path) -> None:
    configs = {**shapes, "tiny-moe": ModelConfig.from_pretrained(tiny_moe),
               "tiny-dense": ModelConfig.from_pretrained(tiny_dense)}  # fmt: skip
    for name, config in configs.items():
        assert active_params_per_token(config) == pytest.approx(_counted(config), rel=1e-6), name
    assert active_params_per_token(shapes["q35-27b"]) == pytest.approx(24.35e9, rel=1e-3)
    assert active_params_per_token(shapes["q35-35b-a3b"]) == pytest.approx(2.437e9, rel=1e-3)


def test_budgets_of_the_measured_shapes(shapes: dict[str, ModelConfig]) -> None:
    assert default_max_num_batched_tokens(shapes["q35-27b"], on_gpu=True) == 2048
    assert default_max_num_batched_tokens(shapes["q35-35b-a3b"], on_gpu=True) == 8192
    for config in shapes.values():
        assert default_max_num_batched_tokens(config, on_gpu=False) == 2048


def test_the_engine_takes_the_default_and_the_flag(tiny_dense: Path) -> None:
    from deltaserve.engine.core import EngineCore
    from deltaserve.engine_config import EngineConfig

    core = EngineCore(EngineConfig(model=str(tiny_dense), device="cpu"))
    try:
        assert core.info().max_num_batched_tokens == 2048
    finally:
        core.shutdown()
    core = EngineCore(EngineConfig(model=str(tiny_dense), device="cpu", max_num_batched_tokens=512))
    try:
        assert core.info().max_num_batched_tokens == 512
    finally:
        core.shutdown()


def test_step_budgets_lone_prefill(shapes: dict[str, ModelConfig]) -> None:
    from deltaserve.engine.budget import LONE_PREFILL_TOKENS, step_budgets

    dense, moe = shapes["q35-27b"], shapes["q35-35b-a3b"]
    LONG = 65536  # max_model_len: above every budget here (the cap is test_lone_prefill.py's)
    # not given, on a GPU: the default budget, and 8192 for a step that prefills one prompt alone
    assert step_budgets(dense, True, None, None, LONG) == (2048, LONE_PREFILL_TOKENS) == (2048, 8192)
    assert step_budgets(moe, True, None, None, LONG) == (8192, 8192)
    # on the CPU, or with --max-num-batched-tokens given: off (a given budget is a hard cap, as in vLLM)
    assert step_budgets(dense, False, None, None, LONG) == (2048, 2048)
    assert step_budgets(dense, True, 4096, None, LONG) == (4096, 4096)
    # given: as given, 0 off, never below the step budget
    assert step_budgets(dense, True, 4096, 16384, LONG) == (4096, 16384)
    assert step_budgets(dense, False, None, 4096, LONG) == (2048, 4096)
    assert step_budgets(dense, True, None, 0, LONG) == (2048, 2048)
    with pytest.raises(ValueError, match=r"lone_prefill_tokens \(1024\) is below max_num_batched_tokens \(2048\)"):
        step_budgets(dense, True, None, 1024, LONG)
