"""Start-up checks called directly: vLLM's max_model_len rule and override, the tokenizer and generation-config
checks, preflight on a good folder, and the one-line / debug forms of a start-up error."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from deltaserve.config import ModelConfig
from deltaserve.model.preflight import (
    StartupError,
    check_generation_config,
    check_tokenizer_files,
    load_tokenizer,
    preflight,
    report_startup_error,
    resolve_max_model_len,
    startup_error_line,
)


@pytest.fixture()
def config(tiny_dense: Path) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_dense)  # max_position_embeddings 4096


@pytest.fixture(autouse=True)
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "DELTASERVE_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)


def test_max_model_len_defaults_and_fits(config: ModelConfig) -> None:
    assert resolve_max_model_len(config, None) == 4096
    assert resolve_max_model_len(config, -1) == 4096
    assert resolve_max_model_len(config, 4096) == 4096
    assert resolve_max_model_len(config, 1000) == 1000


def test_max_model_len_above_the_model_is_refused_as_vllm_does(config: ModelConfig) -> None:
    with pytest.raises(StartupError) as info:
        resolve_max_model_len(config, 100000)
    message = str(info.value)
    assert message.startswith(f"{config.config_file}: User-specified max_model_len (100000) is greater than the "
                              "derived max_model_len (max_position_embeddings=4096")  # fmt: skip
    assert "set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in message
    with pytest.raises(StartupError, match="must be positive"):
        resolve_max_model_len(config, 0)


@pytest.mark.parametrize("name", ["VLLM_ALLOW_LONG_MAX_MODEL_LEN", "DELTASERVE_ALLOW_LONG_MAX_MODEL_LEN"])
def test_max_model_len_override_warns_and_sizes_the_rope_table(
    config: ModelConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    monkeypatch.setenv(name, "1")
    with caplog.at_level(logging.WARNING):
        assert resolve_max_model_len(config, 100000) == 100000
    assert "extreme caution" in caplog.text
    assert config.with_max_model_len(100000).max_position_embeddings == 100000
    assert config.with_max_model_len(100) is config


def test_tokenizer_model_max_length_caps_the_limit(config: ModelConfig, tiny_dense: Path, tmp_path: Path) -> None:
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    data = json.loads((tiny_dense / "tokenizer_config.json").read_text())
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({**data, "model_max_length": 300}))
    assert resolve_max_model_len(config, None, tokenizer_dir) == 300
    with pytest.raises(StartupError, match=r"max_model_len \(301\)"):
        resolve_max_model_len(config, 301, tokenizer_dir)


def test_tokenizer_elsewhere(tiny_dense: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(StartupError, match="no tokenizer files"):
        check_tokenizer_files(bare, None)
    check_tokenizer_files(bare, str(tiny_dense))
    check_tokenizer_files(bare, "Qwen/Qwen3.5-0.8B")  # a repo id is left to the hub
    with pytest.raises(StartupError, match="no tokenizer files"):
        check_tokenizer_files(tiny_dense, str(bare))


def test_a_tokenizer_that_does_not_build_is_one_error(tiny_dense: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dense, broken)
    (broken / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(StartupError) as info:
        load_tokenizer(broken, None)
    assert str(info.value).startswith(f"{broken}: the tokenizer cannot be loaded")
    assert "\n" not in str(info.value)


def test_generation_config_checks(tiny_dense: Path, tmp_path: Path) -> None:
    check_generation_config(tiny_dense, "auto")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, "2"]}))
    with pytest.raises(StartupError, match="`eos_token_id` must be int or a list of ints"):
        check_generation_config(tiny_dense, str(bad))
    check_generation_config(bad, "vllm")  # not read at all
    check_generation_config(tmp_path, "auto")  # no file: no defaults, as in vLLM
    with pytest.raises(StartupError, match="--generation-config '/no/such': no such folder"):
        check_generation_config(tiny_dense, "/no/such")


def test_preflight_passes_a_good_folder_and_dummy_needs_no_weights(tiny_dense: Path, tmp_path: Path) -> None:
    assert preflight(str(tiny_dense)).family == "qwen3_5"
    shell = tmp_path / "shell"
    shell.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dense / name, shell / name)
    assert preflight(str(shell), load_format="dummy").hidden_size == 64
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        preflight(str(shell))


def test_startup_error_forms(caplog: pytest.LogCaptureFixture) -> None:
    assert startup_error_line(ValueError("a\n  b")) == "a b"
    assert startup_error_line(KeyError("weight_map")) == "KeyError: 'weight_map'"
    log = logging.getLogger("test.startup")
    try:
        raise ValueError("file.json: broken")
    except ValueError as exc:
        with caplog.at_level(logging.ERROR):
            assert report_startup_error(exc, False, log) == 1
        assert "Traceback" not in caplog.text and "file.json: broken" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert report_startup_error(exc, True, log) == 1
        assert "Traceback (most recent call last)" in caplog.text
