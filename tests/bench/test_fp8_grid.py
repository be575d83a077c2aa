"""Block FP8 on the H200 (issue 37): the FP8 dummy checkpoints (benchmarks/oracle/make_dummy_models.py) carry the
releases' quantization_config and the real shapes, deltaserve's config and start-up checks accept them, the oracle
registry builds vLLM's production command for them (no --quantization: vLLM reads the method from the config, and a
flag that disagrees is refused), the FP8 grid resolves through the registry, and scripts/h200.sh writes the FP8
dummies before that grid runs (dry run)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from deltaserve.bench import registry, registry_rules
from deltaserve.bench.grid_config import load_config, resolve
from deltaserve.config import ModelConfig
from deltaserve.model.checkpoint_files import FP8_PROJECTION
from deltaserve.model.preflight import preflight
from deltaserve.model.qwen3_5 import Qwen35Model

from .test_h200_runner import runner

REPO = Path(__file__).resolve().parents[2]
GRID = REPO / "benchmarks/grids/h200_fp8.toml"
FP8_NAMES = ("q35-35b-a3b-fp8", "q35-27b-fp8", "q35-122b-a10b-fp8")


def _dummies() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_dummy_models", REPO / "benchmarks/oracle/make_dummy_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fp8_dummies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8-dummies")
    module = _dummies()
    module.write_tokenizer(str(root), module.COMMON["vocab_size"])  # once, copied: the real vocabulary's size
    for name in FP8_NAMES:
        module.write_config(str(root / name), name)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(root / file, root / name / file)
    return root


def test_fp8_dummies_carry_the_release_format_and_the_real_shapes(fp8_dummies: Path) -> None:
    expected = {  # hidden, layers, heads / kv heads, GDN value heads, experts, expert width (docs/fp8.md)
        "q35-35b-a3b-fp8": (2048, 40, 16, 2, 32, 256, 512),
        "q35-27b-fp8": (5120, 64, 24, 4, 48, 0, 0),
        "q35-122b-a10b-fp8": (3072, 48, 32, 2, 64, 256, 1024),
    }
    for name, shape in expected.items():
        written = json.loads((fp8_dummies / name / "config.json").read_text())
        quant = written["quantization_config"]
        assert {k: v for k, v in quant.items() if k != "modules_to_not_convert"} == {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]
        }  # fmt: skip
        kept = quant["modules_to_not_convert"]
        # never a projection the format quantizes; always what the releases keep unquantized
        assert not [m for m in kept if FP8_PROJECTION.match(m + ".weight")], name
        for module in ("lm_head", "model.language_model.layers.0.linear_attn.in_proj_a", "mtp.fc"):
            assert module in kept, (name, module)
        assert ("model.language_model.layers.0.mlp.gate" in kept) == (shape[5] > 0)
        config = preflight(str(fp8_dummies / name), load_format="dummy", quantization="fp8")
        assert config.fp8 is not None and config.fp8.block_size == (128, 128)
        got = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
               config.linear_num_value_heads, config.num_experts, config.moe_intermediate_size)  # fmt: skip
        assert got == shape, name
        assert registry_rules.inspect_checkpoint(fp8_dummies / name).quantization == "fp8"


def test_the_122b_a10b_weights_deltaserve_builds(fp8_dummies: Path) -> None:
    """The byte count docs/fp8.md's memory plan starts from: deltaserve's 122B-A10B FP8 model, built on the meta
    device (text only, no MTP), against the same count from the shape by hand."""
    config = ModelConfig.from_pretrained(fp8_dummies / "q35-122b-a10b-fp8")
    model = Qwen35Model(config, torch.bfloat16, "meta", build_vision=False)
    built: dict[torch.dtype, int] = {}
    for param in model.parameters():
        built[param.dtype] = built.get(param.dtype, 0) + param.numel() * param.element_size()
    h, vocab, layers, full = 3072, 248320, 48, 12
    attention = (2 * 32 * 256 + 2 * 2 * 256) * h + h * 32 * 256  # q with its gate, k, v; o
    gdn = (2 * 16 * 128 + 2 * 64 * 128) * h + 64 * 128 * h  # qkv and z; out_proj
    moe = 256 * 3 * 1024 * h + 3 * 1024 * h  # routed and shared experts
    fp8 = full * attention + (layers - full) * gdn + layers * moe
    assert built[torch.float8_e4m3fn] == fp8  # one byte a weight: 120.53 GB
    # bf16: embeddings and lm_head, the routers, GDN in_proj_a|b and conv1d; the norms and gates add < 2 MB
    bf16 = (2 * vocab * h + layers * 256 * h + (layers - full) * (2 * 64 * h + (2 * 16 * 128 + 64 * 128) * 4)) * 2
    assert 0 <= built[torch.bfloat16] - bf16 < 2e6
    assert sum(built.values()) / 2**30 == pytest.approx(115.2, abs=0.05)


def test_registry_serves_fp8_without_a_flag_and_refuses_a_disagreeing_one(fp8_dummies: Path, tmp_path: Path) -> None:
    model = str(fp8_dummies / "q35-122b-a10b-fp8")
    launch = registry.vllm_launch(model, 1024)
    assert "--quantization" not in launch.argv and "-q" not in launch.argv
    assert launch.argv[launch.argv.index("--load-format") + 1] == "dummy" and "--language-model-only" in launch.argv
    assert any("no --quantization" in reason and "'fp8'" in reason for reason in launch.reasons)
    assert registry.vllm_launch(model, 1024, extra_args=["--quantization", "fp8"]).argv[-1] == "fp8"  # agrees
    with pytest.raises(ValueError, match="--quantization awq: the checkpoint declares 'fp8'"):
        registry.vllm_launch(model, 1024, extra_args=["--quantization", "awq"])
    bf16 = tmp_path / "bf16"
    _dummies().write_config(str(bf16), "q35-35b-a3b")
    assert registry_rules.inspect_checkpoint(bf16).quantization is None
    with pytest.raises(ValueError, match="--quantization fp8: the checkpoint is unquantized"):
        registry.vllm_launch(str(bf16), 1024, extra_args=["--quantization", "fp8"])


def test_fp8_grid_resolves_through_the_registry(fp8_dummies: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASERVE_MODELS", str(fp8_dummies))
    config = load_config(GRID)
    assert [a.name for a in config.arms] == ["deltaserve", "vllm"]
    assert [m.name for m in config.models] == list(FP8_NAMES)
    assert config.concurrencies == [1, 8, 32, 64] and config.lengths == [(1024, 128)]
    for model in config.models:
        ours, peer = (resolve(arm, model, config) for arm in config.arms)
        assert ours.argv[:5] == [sys.executable, "-m", "deltaserve.cli", "serve", str(fp8_dummies / model.name)]
        assert peer.argv[4] == str(fp8_dummies / model.name) and peer.exemption is None
        for launch in (ours, peer):  # the same memory settings on both arms
            argv = launch.argv
            assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.95"
            assert argv[argv.index("--max-num-seqs") + 1] == "64" and "--language-model-only" in argv
            assert "--quantization" not in argv


def test_the_long_fp8_grid_is_the_fp8_grid_at_16384_tokens(fp8_dummies: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37's second length: h200_fp8_long.toml holds the same arms, models and memory settings as h200_fp8.toml,
    16384/128 prompts and --max-model-len 17408 on both arms (the 1024/128 grid keeps 4096)."""
    monkeypatch.setenv("DELTASERVE_MODELS", str(fp8_dummies))
    short, long = load_config(GRID), load_config(GRID.with_name("h200_fp8_long.toml"))
    assert [a.name for a in long.arms] == [a.name for a in short.arms]
    assert [m.name for m in long.models] == list(FP8_NAMES)
    assert long.concurrencies == [1, 8, 32, 64] and long.lengths == [(16384, 128)]
    for model in long.models:
        for arm, short_arm in zip(long.arms, short.arms, strict=True):
            argv, short_argv = resolve(arm, model, long).argv, resolve(short_arm, model, short).argv
            assert argv[argv.index("--max-model-len") + 1] == "17408", (arm.name, argv)
            assert short_argv[short_argv.index("--max-model-len") + 1] == "4096"
            for flag in ("--gpu-memory-utilization", "--max-num-seqs"):
                assert argv[argv.index(flag) + 1] == short_argv[short_argv.index(flag) + 1]
    out = runner(fp8_dummies, "grid", "fp8_long", "--models", "q35-27b-fp8", "--record-name", "r1").stdout
    assert "make_dummy_models.py" in out and "bench grid benchmarks/grids/h200_fp8_long.toml" in out, out


def test_runner_writes_the_fp8_dummies_before_the_fp8_grid(tmp_path: Path) -> None:
    out = runner(tmp_path, "grid", "fp8", "--models", "q35-122b-a10b-fp8", "--record-name", "r1").stdout
    assert "make_dummy_models.py" in out and "--only q35-122b-a10b-fp8,q35-27b-fp8,q35-35b-a3b-fp8" in out, out
    assert "bench grid benchmarks/grids/h200_fp8.toml" in out
    plain = runner(tmp_path, "grid", "core2", "--models", "q35-27b").stdout
    assert "-fp8" not in plain


def test_deltaserve_serves_an_fp8_dummy_with_dummy_weights(tmp_path: Path) -> None:
    """The FP8 dummy's config as written (composite config, top-level quantization_config naming the releases'
    modules) at scaled-down widths: deltaserve builds FP8 projections from it with --load-format dummy and serves."""
    from deltaserve.engine.llm import LLM
    from deltaserve.kernels.fp8 import Fp8Weight
    from deltaserve.sampling_params import SamplingParams

    module = _dummies()
    path = tmp_path / "scaled"
    module.write_config(str(path), "q35-35b-a3b-fp8")
    vocab, _ = module.write_scaled_tokenizer(str(path))
    config = json.loads((path / "config.json").read_text())
    text = {**config["text_config"], **module.SCALED_TEXT, "vocab_size": vocab}
    text["layer_types"] = text["layer_types"][: text["num_hidden_layers"]]
    config["text_config"] = text
    config["vision_config"]["out_hidden_size"] = text["hidden_size"]
    config["quantization_config"] = module.fp8_quantization_config(text)
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(path, dtype="float32", device="cpu", load_format="dummy", language_model_only=True, quantization="fp8")
    model = llm.engine.runner.model
    assert isinstance(model.layers[3].self_attn.qkv_proj, Fp8Weight) and isinstance(model.layers[0].mlp.w13, Fp8Weight)
    assert not isinstance(model.layers[0].linear_attn.in_proj_ba, Fp8Weight)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
