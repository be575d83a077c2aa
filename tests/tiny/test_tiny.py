"""Tests of the tiny-checkpoint generator: files, tensor names and layouts, transformers loading, tokenizer, chat
template, determinism, and that the random models give varied, well-separated greedy generations."""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltaserve import default_model
from deltaserve.tiny import make_tiny, trained_model_dir
from deltaserve.tiny.tokenizer import PLAIN_ADDED_TOKENS, SPECIAL_TOKENS

HIDDEN = 64
NUM_LAYERS = 8
LINEAR_LAYERS = [0, 1, 2, 4, 5, 6]
FULL_ATTENTION_LAYERS = [3, 7]
NUM_EXPERTS = 8
MOE_WIDTH = 32
HK, HV, DK, DV = 2, 4, 16, 16

MULTI_BYTE_TEXTS = [
    "Ça fait quarante ans — naïve café, Łódź, Reykjavík.",
    "今天天气很好，我们去公园散步。東京 서울",
    "Emoji: 😀 🚀 👩‍💻 🇵🇹 ❤️ and math ∑ᵢ aᵢ ≈ π",
    'def f(x):\n    return {"k": [1, 2.5, -3e-6]}\n\n',
]


def _checkpoint_files(folder: Path) -> list[Path]:
    index_path = folder / "model.safetensors.index.json"
    if not index_path.exists():
        return [folder / "model.safetensors"]
    weight_map = json.loads(index_path.read_text())["weight_map"]
    return sorted({folder / name for name in weight_map.values()})


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensors[name] = handle.get_tensor(name)
    return tensors


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine their sync costs dominate."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def tensors_by_variant(tiny_dirs: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    return {variant: _read_tensors(folder) for variant, folder in tiny_dirs.items()}


def test_files_index_and_dtypes(tiny_dirs: dict[str, Path]) -> None:
    for variant, folder in tiny_dirs.items():
        names = {path.name for path in folder.iterdir()}
        expected = {
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        }
        assert names == expected, variant
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        total_bytes = 0
        names_in_shards: dict[str, str] = {}
        for path in _checkpoint_files(folder):
            with safe_open(str(path), framework="pt") as handle:
                assert handle.metadata() == {"format": "pt"}
                for name in handle.keys():  # noqa: SIM118
                    assert name not in names_in_shards, f"{name} is in two shards"
                    names_in_shards[name] = path.name
                    tensor_slice = handle.get_slice(name)
                    dtype = tensor_slice.get_dtype()
                    assert dtype == ("F32" if name.endswith(".A_log") else "BF16"), (variant, name, dtype)
                    num_elements = 1
                    for dim in tensor_slice.get_shape():
                        num_elements *= dim
                    total_bytes += num_elements * (4 if dtype == "F32" else 2)
        assert index["weight_map"] == names_in_shards, variant
        assert index["metadata"]["total_size"] == total_bytes
        folder_bytes = sum(path.stat().st_size for path in folder.iterdir())
        assert 500_000 < folder_bytes < 4_000_000, (variant, folder_bytes)


def test_config_values(tiny_dirs: dict[str, Path]) -> None:
    dense = json.loads((tiny_dirs["dense"] / "config.json").read_text())
    moe = json.loads((tiny_dirs["moe"] / "config.json").read_text())
    next_config = json.loads((tiny_dirs["next"] / "config.json").read_text())
    tokenizer_json = json.loads((tiny_dirs["dense"] / "tokenizer.json").read_text())
    ids = {token["content"]: token["id"] for token in tokenizer_json["added_tokens"]}
    assert dense["architectures"] == ["Qwen3_5ForConditionalGeneration"] and dense["model_type"] == "qwen3_5"
    assert moe["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and moe["model_type"] == "qwen3_5_moe"
    assert next_config["architectures"] == ["Qwen3NextForCausalLM"] and next_config["model_type"] == "qwen3_next"
    for config, text_type in ((dense, "qwen3_5_text"), (moe, "qwen3_5_moe_text")):
        text = config["text_config"]
        assert text["model_type"] == text_type
        assert text["layer_types"] == [
            "full_attention" if index in FULL_ATTENTION_LAYERS else "linear_attention" for index in range(NUM_LAYERS)
        ]
        rope = text["rope_parameters"]
        assert (
            rope["mrope_section"] == [2, 1, 1] and sum(rope["mrope_section"]) * 2 == 32 * rope["partial_rotary_factor"]
        )
        assert rope["mrope_interleaved"] is True and rope["rope_theta"] == 1e7
        assert text["mamba_ssm_dtype"] == "float32" and text["mtp_num_hidden_layers"] == 1
        assert config["image_token_id"] == ids["<|image_pad|>"]
        assert config["video_token_id"] == ids["<|video_pad|>"]
        assert config["vision_start_token_id"] == ids["<|vision_start|>"]
        assert config["vision_end_token_id"] == ids["<|vision_end|>"]
        assert text["vocab_size"] % 64 == 0 and text["vocab_size"] > max(ids.values())
    assert dense["tie_word_embeddings"] is True and moe["tie_word_embeddings"] is False
    assert "layer_types" not in next_config and next_config["full_attention_interval"] == 4
    assert next_config["rope_theta"] == 1e7 and next_config["partial_rotary_factor"] == 0.25
    assert next_config["norm_topk_prob"] is True and next_config["tie_word_embeddings"] is False
    generation = json.loads((tiny_dirs["dense"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert (generation["temperature"], generation["top_p"], generation["top_k"]) == (0.6, 0.95, 20)


def test_tensor_names_and_layouts(tensors_by_variant: dict[str, dict[str, torch.Tensor]]) -> None:
    for variant, tensors in tensors_by_variant.items():
        prefix = "model." if variant == "next" else "model.language_model."
        layer = f"{prefix}layers.3."
        assert tensors[f"{layer}self_attn.q_proj.weight"].shape == (2 * 4 * 32, HIDDEN)
        assert tensors[f"{layer}self_attn.k_proj.weight"].shape == (2 * 32, HIDDEN)
        assert tensors[f"{layer}self_attn.o_proj.weight"].shape == (HIDDEN, 4 * 32)
        assert tensors[f"{layer}self_attn.q_norm.weight"].shape == (32,)
        for index in LINEAR_LAYERS:
            gdn = f"{prefix}layers.{index}.linear_attn."
            assert tensors[f"{gdn}conv1d.weight"].shape == (2 * HK * DK + HV * DV, 1, 4)
            assert tensors[f"{gdn}A_log"].dtype == torch.float32 and tensors[f"{gdn}A_log"].shape == (HV,)
            assert tensors[f"{gdn}dt_bias"].shape == (HV,) and tensors[f"{gdn}norm.weight"].shape == (DV,)
            if variant == "next":
                assert tensors[f"{gdn}in_proj_qkvz.weight"].shape == (2 * HK * DK + 2 * HV * DV, HIDDEN)
                assert tensors[f"{gdn}in_proj_ba.weight"].shape == (2 * HV, HIDDEN)
                assert f"{gdn}in_proj_qkv.weight" not in tensors
            else:
                assert tensors[f"{gdn}in_proj_qkv.weight"].shape == (2 * HK * DK + HV * DV, HIDDEN)
                assert tensors[f"{gdn}in_proj_z.weight"].shape == (HV * DV, HIDDEN)
                assert (
                    tensors[f"{gdn}in_proj_b.weight"].shape == tensors[f"{gdn}in_proj_a.weight"].shape == (HV, HIDDEN)
                )
        assert not any(f"{prefix}layers.{index}.linear_attn" in name for name in tensors for index in (3, 7))
        assert ("lm_head.weight" in tensors) == (variant != "dense")
        # Padding rows past the tokenizer's 1300 ids are zero, so their logits are exactly 0.
        assert not tensors[f"{prefix}embed_tokens.weight"][1300:].any()
        assert "lm_head.weight" not in tensors or not tensors["lm_head.weight"][1300:].any()
        assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight"} <= tensors.keys()
        assert tensors["mtp.fc.weight"].shape == (HIDDEN, 2 * HIDDEN)
        assert "mtp.layers.0.self_attn.q_proj.weight" in tensors
        assert any(name.startswith("model.visual.") for name in tensors) == (variant != "next")
    moe = tensors_by_variant["moe"]
    assert moe["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (NUM_EXPERTS, 2 * MOE_WIDTH, HIDDEN)
    assert moe["model.language_model.layers.0.mlp.experts.down_proj"].shape == (NUM_EXPERTS, HIDDEN, MOE_WIDTH)
    assert moe["model.language_model.layers.0.mlp.gate.weight"].shape == (NUM_EXPERTS, HIDDEN)
    assert moe["model.language_model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, HIDDEN)
    assert moe["mtp.layers.0.mlp.experts.gate_up_proj"].shape == (NUM_EXPERTS, 2 * MOE_WIDTH, HIDDEN)
    next_tensors = tensors_by_variant["next"]
    assert next_tensors["model.layers.0.mlp.experts.7.gate_proj.weight"].shape == (MOE_WIDTH, HIDDEN)
    assert next_tensors["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (HIDDEN, MOE_WIDTH)
    assert not any("gate_up_proj" in name for name in next_tensors)


def test_next_layouts_hold_the_moe_weights(tensors_by_variant: dict[str, dict[str, torch.Tensor]]) -> None:
    """One seed gives the same logical weights; undoing Next's group interleave (doc §2.2) must recover them."""
    moe, next_tensors = tensors_by_variant["moe"], tensors_by_variant["next"]
    ratio = HV // HK
    qkvz = next_tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"].view(HK, 2 * DK + 2 * ratio * DV, HIDDEN)
    query, key, value, z = torch.split(qkvz, [DK, DK, ratio * DV, ratio * DV], dim=1)
    flat_qkv = torch.cat([query.reshape(-1, HIDDEN), key.reshape(-1, HIDDEN), value.reshape(-1, HIDDEN)])
    assert torch.equal(flat_qkv, moe["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"])
    assert torch.equal(z.reshape(-1, HIDDEN), moe["model.language_model.layers.0.linear_attn.in_proj_z.weight"])
    ba = next_tensors["model.layers.0.linear_attn.in_proj_ba.weight"].view(HK, 2 * ratio, HIDDEN)
    assert torch.equal(
        ba[:, :ratio].reshape(-1, HIDDEN), moe["model.language_model.layers.0.linear_attn.in_proj_b.weight"]
    )
    assert torch.equal(
        ba[:, ratio:].reshape(-1, HIDDEN), moe["model.language_model.layers.0.linear_attn.in_proj_a.weight"]
    )
    gate_up = moe["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[5, :MOE_WIDTH], next_tensors["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(gate_up[5, MOE_WIDTH:], next_tensors["model.layers.1.mlp.experts.5.up_proj.weight"])


CAUSAL_LM_CLASSES = {"dense": "Qwen3_5ForCausalLM", "moe": "Qwen3_5MoeForCausalLM", "next": "Qwen3NextForCausalLM"}


@pytest.fixture(scope="module")
def causal_lms(tiny_dirs: dict[str, Path]) -> dict[str, tuple[torch.nn.Module, dict]]:
    """Each variant loaded once by its transformers CausalLM class in fp32, with the loading report."""
    import transformers

    loaded = {}
    for variant, class_name in CAUSAL_LM_CLASSES.items():
        model_class = getattr(transformers, class_name)
        model, info = model_class.from_pretrained(tiny_dirs[variant], dtype=torch.float32, output_loading_info=True)
        loaded[variant] = (model.eval(), info)
    return loaded


def test_transformers_loads_every_variant(
    tiny_dirs: dict[str, Path], causal_lms: dict[str, tuple[torch.nn.Module, dict]]
) -> None:
    import transformers

    config_classes = {"dense": "Qwen3_5Config", "moe": "Qwen3_5MoeConfig", "next": "Qwen3NextConfig"}
    for variant, (model, info) in causal_lms.items():
        assert type(transformers.AutoConfig.from_pretrained(tiny_dirs[variant])).__name__ == config_classes[variant]
        assert type(model).__name__ == CAUSAL_LM_CLASSES[variant]
        problems = {key: value for key, value in info.items() if value}
        assert not problems, (variant, problems)
    for variant, class_name in (
        ("dense", "Qwen3_5ForConditionalGeneration"),
        ("moe", "Qwen3_5MoeForConditionalGeneration"),
    ):
        model_class = getattr(transformers, class_name)
        _, info = model_class.from_pretrained(tiny_dirs[variant], dtype=torch.float32, output_loading_info=True)
        problems = {key: value for key, value in info.items() if value}
        assert not problems, (variant, class_name, problems)
    # AutoModelForCausalLM maps the composite qwen3_5 type to the text-only CausalLM class, not the VLM.
    auto_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    assert type(auto_model).__name__ == "Qwen3_5ForCausalLM"


def test_greedy_generations_are_varied_and_well_separated(
    causal_lms: dict[str, tuple[torch.nn.Module, dict]],
) -> None:
    generator = torch.Generator().manual_seed(1234)
    for variant, (model, _) in causal_lms.items():
        prompt = torch.randint(0, 1200, (1, 48), generator=generator)
        with torch.no_grad():
            # Teacher-forced logits over a random prompt: the top-2 margin at every position.
            top_two = model(prompt).logits[0].topk(2, dim=-1).values
            margins = (top_two[:, 0] - top_two[:, 1]).sort().values
            new_tokens = model.generate(
                prompt[:, :9], max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
            )[0, 9:].tolist()
        assert int((margins < 1e-3).sum()) <= 1, (variant, margins[:4])
        assert float(margins.median()) > 0.2, variant
        assert len(set(new_tokens[:4])) > 1, (variant, new_tokens)
        assert len(set(new_tokens)) >= 5, (variant, new_tokens)


def test_moe_and_next_compute_the_same_function(causal_lms: dict[str, tuple[torch.nn.Module, dict]]) -> None:
    """Same seed, same logical weights: Qwen3.5-MoE (flat, fused) and Qwen3-Next (interleaved, per expert) agree."""
    prompt = torch.tensor([[11, 500, 1281, 42, 9, 1000, 77, 3, 250, 64]])
    with torch.no_grad():
        moe_logits = causal_lms["moe"][0](prompt).logits
        next_logits = causal_lms["next"][0](prompt).logits
    torch.testing.assert_close(moe_logits, next_logits, atol=1e-4, rtol=1e-4)


def test_tokenizer_round_trips_and_matches_tokenizers(tiny_dirs: dict[str, Path]) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    for variant in ("dense", "next"):
        folder = tiny_dirs[variant]
        hf_tokenizer = AutoTokenizer.from_pretrained(folder)
        raw_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert len(hf_tokenizer) == raw_tokenizer.get_vocab_size() == 1300
        has_split_character = False
        for text in MULTI_BYTE_TEXTS:
            ids = hf_tokenizer.encode(text, add_special_tokens=False)
            assert ids == raw_tokenizer.encode(text).ids, (variant, text)
            assert hf_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
            # Some token must end inside a multi-byte character, so streaming detokenizers get exercised.
            has_split_character |= any("\ufffd" in raw_tokenizer.decode([token_id]) for token_id in ids)
        assert has_split_character, variant


def test_added_tokens_have_single_ids(tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["dense"])
    ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS]
    assert ids == list(range(1280, 1300))
    for token, token_id in zip(SPECIAL_TOKENS + PLAIN_ADDED_TOKENS, ids, strict=True):
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False)[1:-1] == [token_id], token
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\nx\n</tool_call><|im_end|>"
    decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert decoded == "assistant\n<think>\nhm\n</think>\n\n<tool_call>\nx\n</tool_call>"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_chat_template_thinking_and_tools(tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["dense"])

    def render(messages: list[dict], **kwargs: object) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    user = [{"role": "user", "content": "Hi"}]
    assert (
        render(user, add_generation_prompt=True) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert render(user, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    parts.append({"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]})
    assert render(parts) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAB<|im_end|>\n"

    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Old question"},
        {"role": "assistant", "content": "Old answer", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Weather in Lisbon?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lisbon"}}}],
        },
        {"role": "tool", "content": '{"temperature": 21}'},
    ]
    prompt = render(conversation, tools=TOOLS, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert json.dumps(TOOLS[0]) in prompt
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n" in prompt
    assert "<|im_start|>assistant\nOld answer<|im_end|>\n" in prompt and "old thoughts" not in prompt
    assert prompt.endswith(
        "<|im_start|>user\nWeather in Lisbon?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLisbon\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n<think>\n"
    )


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    def contents(folder: Path) -> dict[str, bytes]:
        return {path.name: path.read_bytes() for path in folder.iterdir()}

    first = contents(make_tiny(tmp_path / "a", "moe", seed=7))
    assert first == contents(make_tiny(tmp_path / "b", "moe", seed=7))
    other = _read_tensors(make_tiny(tmp_path / "c", "moe", seed=8))
    reference = _read_tensors(tmp_path / "a")
    assert other.keys() == reference.keys()
    assert not torch.equal(other["lm_head.weight"], reference["lm_head.weight"])


def test_make_tiny_options(tmp_path: Path) -> None:
    single = make_tiny(tmp_path / "single", "dense", num_shards=1)
    assert (single / "model.safetensors").exists() and not (single / "model.safetensors.index.json").exists()
    moe = make_tiny(tmp_path / "moe", "moe", tie_word_embeddings=True, expert_layout="per_expert", num_shards=3)
    tensors = _read_tensors(moe)
    assert "lm_head.weight" not in tensors and json.loads((moe / "config.json").read_text())["tie_word_embeddings"]
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in tensors
    assert len(_checkpoint_files(moe)) == 3
    fused_next = _read_tensors(make_tiny(tmp_path / "next", "next", expert_layout="fused"))
    assert fused_next["model.layers.0.mlp.experts.gate_up_proj"].shape == (NUM_EXPERTS, 2 * MOE_WIDTH, HIDDEN)
    with pytest.raises(ValueError, match="unknown tiny variant"):
        make_tiny(tmp_path / "bad", "huge")
    with pytest.raises(ValueError, match="expert_layout"):
        make_tiny(tmp_path / "bad", "moe", expert_layout="sideways")


def test_make_tiny_replaces_checkpoints_but_not_other_folders(tmp_path: Path) -> None:
    folder = make_tiny(tmp_path / "ckpt", "dense", num_shards=1)
    make_tiny(folder, "dense", num_shards=3)
    assert not (folder / "model.safetensors").exists() and len(_checkpoint_files(folder)) == 3
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.md").write_text("keep me")
    with pytest.raises(FileExistsError):
        make_tiny(precious, "dense")
    assert (precious / "notes.md").read_text() == "keep me"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt", "precious"]  # no staging leftovers


def test_builtin_model_is_the_trained_dense_checkpoint(tiny_dirs: dict[str, Path]) -> None:
    """`deltaserve serve` with no MODEL serves the shipped trained dense checkpoint: the dense variant as make_tiny
    writes it (config, generation config, tokenizer, chat template, shard index), only its weights trained."""
    folder = default_model.model_dir()
    assert folder == trained_model_dir("dense")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json"):  # fmt: skip
        assert (folder / name).read_bytes() == (tiny_dirs["dense"] / name).read_bytes(), name
    trained, generated = _read_tensors(folder), _read_tensors(tiny_dirs["dense"])
    assert trained.keys() == generated.keys()
    assert not torch.equal(trained["model.language_model.embed_tokens.weight"],
                           generated["model.language_model.embed_tokens.weight"])  # fmt: skip


def test_cli_writes_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deltaserve.cli import main

    out_dir = tmp_path / "cli"
    assert main(["make-tiny", str(out_dir), "--variant", "next", "--no-tie-word-embeddings", "--num-shards", "1"]) == 0
    printed = capsys.readouterr().out
    assert str(out_dir.resolve()) in printed and "MiB" in printed
    assert json.loads((out_dir / "config.json").read_text())["model_type"] == "qwen3_next"
    assert os.access(out_dir / "model.safetensors", os.R_OK)
