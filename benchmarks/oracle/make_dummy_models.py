"""Write Qwen3.5-shaped checkpoint folders (config + word-level tokenizer, no weights) for --load-format dummy.

A copy of shared/tools/vllm-oracle/make_dummy_models.py (shared/ is not sent to the device), restyled for the
repository's linters; it writes the same folders: q35-35b-a3b and q35-27b with real dimensions, the multimodal
config, image/video processor configs (vLLM needs them without --language-model-only) and a word-level
tokenizer of the real vocabulary size (248,320) whose ids all round-trip, so prompt lengths are exact.

usage: python3 benchmarks/oracle/make_dummy_models.py DIR
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

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


def write_processor(path: str) -> None:
    """Image and video processor configs, needed when vLLM keeps the vision path on."""
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
        video.update(fps=2, min_frames=4, max_frames=768)
        json.dump({**common, **video}, f)


def main(root: str) -> None:
    import transformers

    for name, (class_name, architecture, text) in SHAPES.items():
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        config_class = getattr(transformers, class_name)
        config = config_class(text_config={**COMMON, **text}, vision_config={"out_hidden_size": text["hidden_size"]})
        config.architectures = [architecture]
        config.save_pretrained(path)
        write_tokenizer(path, COMMON["vocab_size"])
        write_processor(path)
        print(name, "written")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".models")
