"""deltaserve's table of transformers' config defaults (config.TEXT_DEFAULTS) against the installed transformers
classes, so a transformers release that changes a default fails here instead of being served silently."""

from __future__ import annotations

import pytest

from deltaserve.config import DEFAULT_MROPE_SECTION, TEXT_DEFAULTS

CLASSES = {"qwen3_5": "Qwen3_5TextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig", "qwen3_next": "Qwen3NextConfig"}


@pytest.mark.parametrize("family", sorted(TEXT_DEFAULTS))
def test_defaults_are_transformers_defaults(family: str) -> None:
    import transformers

    config = getattr(transformers, CLASSES[family])()
    for key, value in TEXT_DEFAULTS[family].items():
        if key in ("partial_rotary_factor", "rope_theta"):
            actual = config.rope_parameters[key]
        elif key == "full_attention_interval":
            first_full = config.layer_types.index("full_attention")
            actual = first_full + 1
            expected_types = ["full_attention" if (i + 1) % actual == 0 else "linear_attention"
                              for i in range(config.num_hidden_layers)]  # fmt: skip
            assert config.layer_types == expected_types
        else:
            actual = getattr(config, key)
        assert actual == value, f"{family}.{key}: transformers {actual!r}, deltaserve {value!r}"


def test_mrope_section_default_is_transformers() -> None:
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    source = inspect.getsource(modeling_qwen3_5.Qwen3_5TextRotaryEmbedding.__init__)
    assert f'get("mrope_section", {list(DEFAULT_MROPE_SECTION)})' in source
