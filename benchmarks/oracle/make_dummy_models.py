"""Write Qwen3.5-shaped checkpoint folders (config + word-level tokenizer, no weights) for --load-format dummy.

Text folders (a copy of shared/tools/vllm-oracle/make_dummy_models.py, restyled for the repository's linters;
shared/ is not sent to the device): q35-35b-a3b and q35-27b with real dimensions, the multimodal config,
image/video processor configs (vLLM needs them without --language-model-only) and a word-level tokenizer of the
real vocabulary size (248,320) whose ids all round-trip, so prompt lengths are exact. Their tokenizer has no added
tokens, so a chat prompt with an image cannot carry its placeholder: they serve text traffic only.

The image-traffic folder q35-35b-a3b-mm (issue 14 item 6): the same text_config as q35-35b-a3b, the vision_config
Qwen3.5/3.6-35B-A3B publishes (every field spelled out: depth 27, hidden 1152, intermediate 4304, 16 heads, patch
16, merge 2, 2304 position embeddings, out_hidden_size 2048, no deepstack), the released preprocessor_config.json
and video_preprocessor_config.json, Qwen's 26 added tokens at their released ids (endoftext 248044, im_start /
im_end 248045-6, vision_start / vision_end 248053-4, image_pad / video_pad 248056-7, think 248068-9; the first 14
special, as released) in the word-level tokenizer, and a chat template that renders an image part as
<|vision_start|><|image_pad|><|vision_end|> (deltaserve/tiny/chat_template.jinja, Qwen3.5's prompt format; vLLM 0.26
detects it as the "openai" content format, so both engines render the same parts in the same order). It is meant
for vLLM (without --language-model-only) and deltaserve, both with --load-format dummy; on the CPU, --check and the
scaled-down copy that `write_multimodal(path, scaled=True)` writes (same files, small dimensions; served end to end
by tests/bench/test_image_grid_cpu.py) stand in until the H200 run serves it with vLLM.

`--check` (after writing) loads q35-35b-a3b-mm as the servers will, with this machine's transformers: AutoConfig,
AutoTokenizer (a chat prompt with one image must encode its text word for word and carry one <|image_pad|> between
the vision delimiters), deltaserve's ModelConfig and MultimodalProcessor (its processor files must match the vision
tower's patch geometry); it prints each check and exits 1 when one fails.

usage: python3 benchmarks/oracle/make_dummy_models.py DIR [--only NAME[,NAME...]] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

CHAT_TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "deltaserve" / "tiny" / "chat_template.jinja"

ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
COMMON: dict[str, Any] = {
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": ROPE,
    "tie_word_embeddings": False,
    "mamba_ssm_dtype": "float32",
    # the released configs' one MTP layer sharing embeddings and lm_head (vLLM's MTP arm builds its draft from it)
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
}
# name -> (config class name, architecture, text_config overrides)
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "q35-35b-a3b": (
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "linear_num_value_heads": 32,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
        },
    ),
    "q35-27b": (
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        {
            "hidden_size": 5120,
            "num_hidden_layers": 64,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "linear_num_value_heads": 48,
            "intermediate_size": 17408,
        },
    ),
}


NUM_CHAR_TOKENS = 94  # ids 0..93: the printable ASCII characters "!".."~", one each


def write_tokenizer(path: str, vocab: int) -> None:
    """Word-level tokenizer: id i < 94 is the single character chr(33 + i), every other id i the word "t{i}",
    except the three Qwen special tokens. The single characters let a grammar be spelled (a JSON schema needs
    "[", "{", '"', ...: with words alone no token can start a JSON value and both engines' structured-output
    masks admit nothing); no whitespace character is a token, so decode-then-encode still returns the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {(chr(33 + i) if i < NUM_CHAR_TOKENS else f"t{i}"): i for i in range(vocab)}
    specials = {248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>"}
    for i, name in specials.items():
        del words[f"t{i}"]
        words[name] = i
    tokenizer = Tokenizer(models.WordLevel(words, unk_token=f"t{NUM_CHAR_TOKENS}"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 262144,
        }
        json.dump(config, f)


def write_processor(path: str, is_released: bool = False) -> None:
    """Image and video processor configs, needed when vLLM keeps the vision path on. `is_released`: the video
    config as Qwen ships it, without fps / min_frames / max_frames (their class defaults are the same 2 / 4 / 768)."""
    common = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
    }
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        image = {"image_processor_type": "Qwen2VLImageProcessorFast"}
        image["size"] = {"longest_edge": 16777216, "shortest_edge": 65536}
        json.dump({**common, **image}, f)
    with open(os.path.join(path, "video_preprocessor_config.json"), "w") as f:
        video: dict[str, Any] = {"video_processor_type": "Qwen3VLVideoProcessor"}
        video["size"] = {"longest_edge": 25165824, "shortest_edge": 4096}
        if not is_released:
            video.update(fps=2, min_frames=4, max_frames=768)
        json.dump({**common, **video}, f)


# Qwen's added tokens in their released order, from <|endoftext|> (248044 in Qwen3.5/3.6) on; the first 14 are special
# (never produced by decoding with skip_special_tokens), the rest are added but plain, as the released
# tokenizer_config.json marks them.
ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)  # fmt: skip
NUM_SPECIAL_ADDED = 14
FIRST_ADDED_ID = 248044
# vision_config of Qwen3.5-35B-A3B / Qwen3.6-35B-A3B as published (multimodal doc §4.1), every field written out so
# no reader falls back to its own defaults.
VISION_35B_A3B: dict[str, Any] = {
    "deepstack_visual_indexes": [],
    "depth": 27,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 4304,
    "model_type": "qwen3_5_moe",
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "out_hidden_size": 2048,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
MULTIMODAL_NAME = "q35-35b-a3b-mm"
MULTIMODAL_BASE = "q35-35b-a3b"  # its text_config is this folder's, unchanged
# The scaled-down copy for CPU tests: the same config fields and files at small dimensions. Its tokenizer is the
# tiny checkpoints' byte-level BPE (deltaserve/tiny/tokenizer.py, Qwen's pipeline and added tokens, 1,300 ids):
# transformers 5.24 (this repository's venv; qwen3_5_moe joined its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) loads
# every qwen3_5_moe folder's tokenizer as Qwen3_5Tokenizer, which rebuilds a byte-level BPE pipeline and reads a
# word-level tokenizer as nothing (it encodes "t5 t6" to []), while 5.17 (the H200's) keeps the declared
# PreTrainedTokenizerFast; the BPE tokenizer loads the same under both.
SCALED_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 8192,
}
SCALED_VISION: dict[str, Any] = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}


def added_token_ids(first_id: int) -> dict[str, int]:
    return {token: first_id + i for i, token in enumerate(ADDED_TOKENS)}


def write_multimodal_tokenizer(path: str, vocab: int, first_id: int) -> None:
    """Word-level tokenizer ("t{i}" for id i) whose added tokens sit at Qwen's ids, registered as added tokens so
    a chat prompt's <|image_pad|> etc. are cut out before the whitespace split; eos <|im_end|>, as released."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    ids = added_token_ids(first_id)
    words = {f"t{i}": i for i in range(vocab)}
    for token, i in ids.items():
        del words[f"t{i}"]
        words[token] = i
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = ADDED_TOKENS[:NUM_SPECIAL_ADDED]
    tokenizer.add_tokens([AddedToken(t, special=t in specials, normalized=False) for t in ADDED_TOKENS])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    decoder = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": t in specials}
        for t, i in ids.items()
    }  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
        "split_special_tokens": False,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"))


def write_scaled_tokenizer(path: str) -> tuple[int, dict[str, int]]:
    """The tiny checkpoints' BPE tokenizer files; returns (padded vocab size, added-token ids)."""
    from deltaserve.tiny.tokenizer import added_token_ids as tiny_token_ids
    from deltaserve.tiny.tokenizer import build_tokenizer, build_tokenizer_config

    tokenizer = build_tokenizer("Qwen3_5Tokenizer")
    ids = tiny_token_ids(tokenizer)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    config = build_tokenizer_config("Qwen3_5Tokenizer", ids, SCALED_TEXT["max_position_embeddings"])
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    # padded like the releases: a multiple of 64 strictly above the tokenizer's size
    return (tokenizer.get_vocab_size(with_added_tokens=True) // 64 + 1) * 64, ids


def write_multimodal(path: str, scaled: bool = False) -> None:
    """The image-traffic checkpoint folder: q35-35b-a3b's text_config (or the scaled one), the published vision
    config, top-level vision token ids, processor configs, tokenizer with added tokens and the chat template."""
    import transformers

    os.makedirs(path, exist_ok=True)
    class_name, architecture, text = SHAPES[MULTIMODAL_BASE]
    text = {**COMMON, **text}
    if scaled:
        vocab, ids = write_scaled_tokenizer(path)
        text = {**text, **SCALED_TEXT, "vocab_size": vocab}
    else:
        ids = added_token_ids(FIRST_ADDED_ID)
        write_multimodal_tokenizer(path, text["vocab_size"], FIRST_ADDED_ID)
    vision = {**VISION_35B_A3B, **(SCALED_VISION if scaled else {}), "out_hidden_size": text["hidden_size"]}
    config = getattr(transformers, class_name)(text_config=text, vision_config={"out_hidden_size": text["hidden_size"]})
    config.architectures = [architecture]
    config.save_pretrained(path)
    declare_mtp_at_top_level(path)
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    data["vision_config"] = vision
    data["image_token_id"] = ids["<|image_pad|>"]
    data["video_token_id"] = ids["<|video_pad|>"]
    data["vision_start_token_id"] = ids["<|vision_start|>"]
    data["vision_end_token_id"] = ids["<|vision_end|>"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    write_processor(path, is_released=True)


def check_multimodal(path: str) -> list[str]:
    """Load the image-traffic folder as vLLM and deltaserve will; returns the failed checks (printing each)."""
    from transformers import AutoConfig, AutoTokenizer

    from deltaserve.config import ModelConfig
    from deltaserve.multimodal import MultimodalProcessor, VisionTokenIds

    failures: list[str] = []

    def check(name: str, is_ok: bool, detail: str) -> None:
        print(f"check {name}: {'ok' if is_ok else 'FAIL'} ({detail})", flush=True)
        if not is_ok:
            failures.append(f"{name}: {detail}")

    config = AutoConfig.from_pretrained(path)
    vision = config.vision_config
    detail = f"{type(config).__name__}, vision depth {vision.depth}, out_hidden_size {vision.out_hidden_size}"
    check("AutoConfig", vision.depth == 27 and vision.out_hidden_size == config.text_config.hidden_size, detail)
    tokenizer = AutoTokenizer.from_pretrained(path)
    words = "t5 t6 t7"
    messages = [{"role": "user", "content": [{"type": "text", "text": words}, {"type": "image"}]}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    vision_ids = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    has_image = any(ids[i : i + 3] == vision_ids for i in range(len(ids)))
    check("AutoTokenizer", tokenizer.encode(words, add_special_tokens=False) == [5, 6, 7] and has_image
          and ids.count(config.image_token_id) == 1,
          f"{type(tokenizer).__name__}: {words!r} -> {tokenizer.encode(words, add_special_tokens=False)}, "
          f"chat prompt ids {ids}")  # fmt: skip
    model = ModelConfig.from_pretrained(path)
    check("deltaserve ModelConfig", model.vision is not None and model.vision.depth == vision.depth,
          f"vision {model.vision}")  # fmt: skip
    if model.vision is not None:
        tokens = VisionTokenIds(model.vision.image_token_id, model.vision.video_token_id,
                                model.vision.vision_start_token_id, model.vision.vision_end_token_id)  # fmt: skip
        processor = MultimodalProcessor.from_model_dir(path, tokens, encode=lambda text: [])
        processor.check_vision_geometry(model.vision.patch_size, model.vision.temporal_patch_size,
                                        model.vision.spatial_merge_size)  # fmt: skip
        check("deltaserve MultimodalProcessor", processor.refusal is None, processor.refusal or "media accepted")
    return failures


def declare_mtp_at_top_level(path: str) -> None:
    """Copies text_config's mtp_num_hidden_layers to the top level of config.json, where vLLM 0.26's speculative
    config looks for it on these composite configs (transformers' composite config class drops the key)."""
    config_path = Path(path) / "config.json"
    written = json.loads(config_path.read_text())
    written["mtp_num_hidden_layers"] = COMMON["mtp_num_hidden_layers"]
    config_path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def write_config(path: str, name: str) -> None:
    """config.json of the SHAPES entry `name` into path (transformers' own config class writes it)."""
    import transformers

    class_name, architecture, text = SHAPES[name]
    config_class = getattr(transformers, class_name)
    config = config_class(text_config={**COMMON, **text}, vision_config={"out_hidden_size": text["hidden_size"]})
    config.architectures = [architecture]
    config.save_pretrained(path)
    declare_mtp_at_top_level(path)


def main(root: str, names: list[str] | None = None) -> None:
    for name in SHAPES:
        if names is not None and name not in names:
            continue
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        write_config(path, name)
        write_tokenizer(path, COMMON["vocab_size"])
        write_processor(path)
        print(name, "written")
    if names is None or MULTIMODAL_NAME in names:
        write_multimodal(os.path.join(root, MULTIMODAL_NAME))
        print(MULTIMODAL_NAME, "written")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default=".models")
    known = [*SHAPES, MULTIMODAL_NAME]
    parser.add_argument("--only", default=None, help=f"comma-separated folders to write, of {', '.join(known)}")
    parser.add_argument("--check", action="store_true", help=f"then load {MULTIMODAL_NAME} as the servers will")
    args = parser.parse_args()
    only = None if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(only or []) - set(known))
    if unknown:
        parser.error(f"unknown folders {unknown}; known: {', '.join(known)}")
    main(args.root, only)
    if args.check:
        problems = check_multimodal(os.path.join(args.root, MULTIMODAL_NAME))
        print(f"{MULTIMODAL_NAME}: {len(problems)} failed checks" + "".join(f"\n  {p}" for p in problems))
        sys.exit(1 if problems else 0)
