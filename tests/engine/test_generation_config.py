"""Generation defaults from a checkpoint folder: sampling fields, eos ids (generation_config, then config.json),
and the user-wins merge."""

from __future__ import annotations

import json
from pathlib import Path

from deltaserve.engine.generation_config import apply_defaults, load_eos_token_ids, load_generation_defaults
from deltaserve.sampling_params import SamplingParams


def _write(folder: Path, name: str, data: object) -> None:
    (folder / name).write_text(json.dumps(data))


def test_sampling_defaults_from_generation_config(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "generation_config.json",
        {
            "do_sample": True,
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
            "min_p": None,
            "presence_penalty": 1.5,
            "repetition_penalty": 1,
            "eos_token_id": [5, 7],
            "max_new_tokens": 100,
        },
    )
    defaults = load_generation_defaults(tmp_path)
    assert defaults == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "presence_penalty": 1.5,
        "repetition_penalty": 1.0,
        "max_tokens": 100,
    }
    assert isinstance(defaults["top_k"], int) and isinstance(defaults["repetition_penalty"], float)
    SamplingParams(**defaults)  # every key is a SamplingParams field


def test_missing_or_broken_generation_config_gives_no_defaults(tmp_path: Path) -> None:
    assert load_generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert load_generation_defaults(tmp_path) == {}


def test_eos_ids_from_generation_config_int_or_list(tmp_path: Path) -> None:
    _write(tmp_path, "config.json", {"eos_token_id": 1})
    _write(tmp_path, "generation_config.json", {"eos_token_id": [7, 5, 7]})
    assert load_eos_token_ids(tmp_path) == [7, 5]
    _write(tmp_path, "generation_config.json", {"eos_token_id": 9})
    assert load_eos_token_ids(tmp_path) == [9]


def test_eos_ids_fall_back_to_config(tmp_path: Path) -> None:
    _write(tmp_path, "generation_config.json", {"temperature": 0.7})
    _write(tmp_path, "config.json", {"eos_token_id": [3, 4]})
    assert load_eos_token_ids(tmp_path) == [3, 4]
    _write(tmp_path, "config.json", {"text_config": {"eos_token_id": 6}})
    assert load_eos_token_ids(tmp_path) == [6]
    (tmp_path / "config.json").unlink()
    assert load_eos_token_ids(tmp_path) == []


def test_user_fields_win_and_none_means_unset() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    merged = apply_defaults({"temperature": 0.0, "top_k": None, "max_tokens": 5}, defaults)
    assert merged == {"temperature": 0.0, "top_k": 20, "top_p": 0.95, "max_tokens": 5}
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def test_generation_config_max_tokens_is_a_cap() -> None:
    assert apply_defaults({"max_tokens": 500}, {"max_tokens": 100})["max_tokens"] == 100
    assert apply_defaults({"max_tokens": 50}, {"max_tokens": 100})["max_tokens"] == 50
    assert apply_defaults({}, {"max_tokens": 100})["max_tokens"] == 100
