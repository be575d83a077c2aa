"""vLLM's --speculative-config / LLM(speculative_config=...) as deltaserve parses it (deltaserve/speculative_config.py):
every spelling vLLM accepts for MTP on this family, vLLM's defaults, the synthetic-acceptance keys with vLLM's
validation, and every refusal naming the bad key or method."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from deltaserve.engine_config import EngineConfig
from deltaserve.speculative_config import (
    KPolicyConfig,
    SpeculativeConfig,
    SpeculativeConfigError,
    acceptance_length_to_rates,
    parse_speculative_config,
)


@pytest.mark.parametrize(
    ("given", "k"),
    [
        ('{"method": "mtp", "num_speculative_tokens": 3}', 3),
        ({"method": "mtp", "num_speculative_tokens": 1}, 1),
        ({"method": "mtp"}, 1),  # vLLM: the draft config's n_predict (mtp_num_hidden_layers: 1)
        ({"method": "mtp", "num_speculative_tokens": None}, 1),
        ({"method": "qwen3_next_mtp", "num_speculative_tokens": 2}, 2),
        ({"method": "qwen3_5_mtp", "num_speculative_tokens": 4}, 4),
        ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "standard"}, 2),
        ({"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "greedy"}, 2),
    ],
)
def test_accepted_spellings(given: object, k: int) -> None:
    config = parse_speculative_config(given)
    assert config == SpeculativeConfig(method="mtp", num_speculative_tokens=k)
    assert not config.is_synthetic


def test_an_alias_is_rewritten_to_mtp_with_vllms_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_speculative_config({"method": "qwen3_next_mtp"}).method == "mtp"
    assert "method `qwen3_next_mtp` is deprecated and replaced with mtp" in caplog.text


def test_none_is_no_speculative_decoding_and_a_parsed_config_passes_through() -> None:
    assert parse_speculative_config(None) is None
    config = SpeculativeConfig(num_speculative_tokens=2)
    assert parse_speculative_config(config) is config
    assert EngineConfig(model="m").speculative_config is None


def test_engine_config_takes_the_json_a_dict_or_a_parsed_config() -> None:
    expected = SpeculativeConfig(num_speculative_tokens=3)
    for given in ('{"method": "mtp", "num_speculative_tokens": 3}', {"method": "mtp", "num_speculative_tokens": 3},
                  expected):  # fmt: skip
        assert EngineConfig(model="m", speculative_config=given).speculative_config == expected
    with pytest.raises(SpeculativeConfigError, match="`method` 'eagle'"):
        EngineConfig(model="m", speculative_config={"method": "eagle", "num_speculative_tokens": 3})


@pytest.mark.parametrize(
    ("extra", "rates"),
    [
        ({"synthetic_acceptance_rates": [0.917, 0.837, 0.648]}, (0.917, 0.837, 0.648)),
        ({"synthetic_acceptance_rates": [1, 1, 0]}, (1.0, 1.0, 0.0)),
        ({"synthetic_acceptance_rates": [0.5, 0.5, 0.5]}, (0.5, 0.5, 0.5)),
        # the minimum-variance schedule: floor(L - 1) drafts always accepted, then the fraction left, then none
        ({"synthetic_acceptance_length": 2.5}, (1.0, 0.5, 0.0)),
        ({"synthetic_acceptance_length": 1}, (0.0, 0.0, 0.0)),
        ({"synthetic_acceptance_length": 4}, (1.0, 1.0, 1.0)),
        ({"synthetic_acceptance_length": 3.25}, (1.0, 1.0, 0.25)),
    ],
)
def test_synthetic_acceptance(extra: dict, rates: tuple[float, ...]) -> None:
    given = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", **extra}
    config = parse_speculative_config(json.dumps(given))
    assert config.is_synthetic and config.synthetic_acceptance_rates == pytest.approx(rates)
    assert config.to_dict()["synthetic_acceptance_rates"] == pytest.approx(list(rates))
    assert parse_speculative_config(config.to_dict()) == config


def test_acceptance_length_schedule_has_one_rate_per_draft() -> None:
    assert acceptance_length_to_rates(1.93, 1) == pytest.approx((0.93,))
    assert acceptance_length_to_rates(2.0, 1) == (1.0,)
    assert len(acceptance_length_to_rates(2.0, 4)) == 4


SYNTHETIC = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}


@pytest.mark.parametrize(
    ("given", "message"),
    [
        # methods
        ({"method": "eagle", "num_speculative_tokens": 3}, "`method` 'eagle' is not supported"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, "`method` 'eagle3' is not supported"),
        ({"method": "ngram", "num_speculative_tokens": 3}, "`method` 'ngram' is not supported"),
        ({"method": "medusa"}, "`method` 'medusa' is not supported"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "`method` 'draft_model' is not supported"),
        ({"method": "suffix"}, "`method` 'suffix' is not supported"),
        ({"method": "deepseek_mtp"}, "`method` 'deepseek_mtp' names another model family's MTP module"),
        ({"method": "magic"}, "`method` 'magic' is not a speculative decoding method"),
        ({"method": 3}, "`method` must be a string"),
        ({"num_speculative_tokens": 3}, "has no `method`"),
        ({}, "has no `method`"),
        # keys
        ({"method": "mtp", "model": "/some/draft"}, "key `model` is not supported by deltaserve"),
        ({"method": "mtp", "tensor_parallel_size": 2}, "key `tensor_parallel_size` is not supported"),
        ({"method": "mtp", "draft_tensor_parallel_size": 1}, "key `draft_tensor_parallel_size` is not supported"),
        ({"method": "mtp", "num_spec_tokens": 3}, "key `num_spec_tokens` is not a speculative_config field"),
        # num_speculative_tokens
        ({"method": "mtp", "num_speculative_tokens": 0}, "`num_speculative_tokens` must be greater than 0, got 0"),
        ({"method": "mtp", "num_speculative_tokens": -1}, "`num_speculative_tokens` must be greater than 0"),
        ({"method": "mtp", "num_speculative_tokens": 2.5}, "`num_speculative_tokens` must be an integer"),
        ({"method": "mtp", "num_speculative_tokens": "3"}, "`num_speculative_tokens` must be an integer"),
        ({"method": "mtp", "num_speculative_tokens": True}, "`num_speculative_tokens` must be an integer"),
        # sampling methods
        ({"method": "mtp", "rejection_sample_method": "block"}, "`rejection_sample_method` 'block' is not supported"),
        ({"method": "mtp", "draft_sample_method": "probabilistic"}, "`draft_sample_method` 'probabilistic'"),
        # synthetic acceptance
        (SYNTHETIC, "requires exactly one of `synthetic_acceptance_rates` or `synthetic_acceptance_length`"),
        ({**SYNTHETIC, "synthetic_acceptance_rates": [0.9, 0.8, 0.7], "synthetic_acceptance_length": 2},
         "requires exactly one of"),
        ({**SYNTHETIC, "synthetic_acceptance_rates": [0.9, 0.8]}, "`synthetic_acceptance_rates` must have length 3"),
        ({**SYNTHETIC, "synthetic_acceptance_rates": [0.9, 0.95, 0.7]}, "must be non-increasing"),
        ({**SYNTHETIC, "synthetic_acceptance_rates": [1.1, 0.8, 0.7]}, "entries must be in [0, 1]"),
        ({**SYNTHETIC, "synthetic_acceptance_rates": [0.9, 0.8, -0.1]}, "entries must be in [0, 1]"),
        ({**SYNTHETIC, "synthetic_acceptance_rates": 0.9}, "must be a list of numbers"),
        ({**SYNTHETIC, "synthetic_acceptance_rates": [0.9, "x", 0.1]}, "must be a number"),
        ({**SYNTHETIC, "synthetic_acceptance_length": 4.5}, "`synthetic_acceptance_length` must be in [1, 4]"),
        ({**SYNTHETIC, "synthetic_acceptance_length": 0.5}, "`synthetic_acceptance_length` must be in [1, 4]"),
        ({"method": "mtp", "num_speculative_tokens": 1, "synthetic_acceptance_rates": [0.9]},
         "`synthetic_acceptance_rates` is only valid with `rejection_sample_method` 'synthetic'"),
        ({"method": "mtp", "synthetic_acceptance_length": 1.5}, "`synthetic_acceptance_length` is only valid with"),
    ],
)  # fmt: skip
def test_refusals_name_the_key_or_method(given: dict, message: str) -> None:
    with pytest.raises(SpeculativeConfigError) as info:
        parse_speculative_config(given)
    assert message in str(info.value)
    with pytest.raises(SpeculativeConfigError):
        parse_speculative_config(json.dumps(given))  # the CLI's JSON form is refused alike


@pytest.mark.parametrize(("given", "message"), [("{method: mtp}", "not valid JSON"), ("[1, 2]", "a JSON object")])
def test_bad_json_is_refused(given: str, message: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=message):
        parse_speculative_config(given)


def test_llm_takes_speculative_config_and_loads_the_mtp_layer() -> None:
    """LLM(speculative_config=dict), as vLLM's offline API takes it: the runner builds the MTP layer and consumes
    mtp.* (no longer a skipped prefix), and the cache plan gives the layer its own KV."""
    from deltaserve.engine.llm import LLM
    from deltaserve.tiny.trained import trained_model_dir

    engine = {"dtype": "float32", "device": "cpu", "max_model_len": 64, "max_num_seqs": 2}
    llm = LLM(trained_model_dir("dense"), speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              **engine)  # fmt: skip
    runner = llm.engine.runner
    assert llm.engine.config.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    assert runner.model.mtp is not None and "mtp" not in runner.load_report.skipped_by_rule
    assert runner.model.mtp.attention.k_cache.shape[0] == runner.layout.num_blocks
    with pytest.raises(SpeculativeConfigError, match="`method` 'ngram' is not supported"):
        LLM(trained_model_dir("dense"), speculative_config={"method": "ngram"}, **engine)


def test_serve_parses_speculative_config_into_the_engine_config() -> None:
    """`deltaserve serve --speculative-config JSON`, as `vllm serve` takes it: validated while the command line is
    parsed (a refused method or key is named there), then EngineConfig.speculative_config."""
    from deltaserve.api import cli
    from deltaserve.api.cli_args import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["m", "--speculative-config", '{"method": "qwen3_next_mtp", "num_speculative_tokens": 3}'])
    config = cli.build_engine_config(args, "m", "cpu")
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert cli.build_engine_config(parser.parse_args(["m"]), "m", "cpu").speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}'])


def test_the_batch_size_schedule_and_the_k_policy_keys() -> None:
    config = parse_speculative_config(
        '{"method": "mtp", "num_speculative_tokens": 3,'
        ' "num_speculative_tokens_per_batch_size": [[8, 16, 1], [1, 4, 3]],'
        ' "k_policy": {"max_batch_tokens": 48, "token_cost": 0.2}}'
    )
    assert config.num_speculative_tokens_per_batch_size == ((1, 4, 3), (8, 16, 1))  # sorted
    assert config.k_policy == KPolicyConfig(max_batch_tokens=48, token_cost=0.2)
    assert parse_speculative_config(config.to_dict()) == config  # the JSON form carries both
    assert parse_speculative_config({"method": "mtp", "k_policy": True}).k_policy == KPolicyConfig()
    for off in (False, None):
        assert parse_speculative_config({"method": "mtp", "k_policy": off}).k_policy is None
    plain = parse_speculative_config({"method": "mtp"})
    assert plain.k_policy is None and plain.num_speculative_tokens_per_batch_size is None  # vLLM's fixed k


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"disable_by_batch_size": 8}, "`disable_by_batch_size` was removed from vLLM's SpeculativeConfig"),
        ({"num_speculative_tokens_per_batch_size": []}, "must be a non-empty list"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4]]}, "entries must be [first batch size, last batch size, k]"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, 2.0]]}, "entries must be [first batch size"),
        ({"num_speculative_tokens_per_batch_size": [[2, 4, 2]]}, "the first batch-size range must start at 1"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, 2], [4, 8, 1]]}, "must not overlap"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, "k >= 0"),
        ({"num_speculative_tokens_per_batch_size": [[4, 1, 1]]}, "first <= last"),
        ({"k_policy": "on"}, "`k_policy` must be true, false or an object"),
        ({"k_policy": {"max_batch": 8}}, "`k_policy` key `max_batch` is not one of"),
        ({"k_policy": {"token_cost": -0.1}}, "`k_policy.token_cost` must be >= 0"),
        ({"k_policy": {"probe_interval": 0}}, "`k_policy.probe_interval` must be an integer >= 1"),
        ({"k_policy": {"window": 2.5}}, "`k_policy.window` must be an integer >= 1"),
        ({"k_policy": {"max_batch_tokens": -1}}, "`k_policy.max_batch_tokens` must be an integer >= 0"),
        ({"k_policy": {"measure_cost": "true"}}, "`k_policy.measure_cost` must be true or false, got 'true'"),
        ({"k_policy": {"measure_cost": 1}}, "`k_policy.measure_cost` must be true or false, got 1"),
    ],
)
def test_the_k_policy_keys_are_checked(extra: dict, message: str) -> None:
    with pytest.raises(SpeculativeConfigError) as info:
        parse_speculative_config({"method": "mtp", "num_speculative_tokens": 3, **extra})
    assert message in str(info.value)


def test_async_verify_is_a_boolean_off_by_default() -> None:
    base = {"method": "mtp", "num_speculative_tokens": 2}
    assert parse_speculative_config(base).async_verify is False
    config = parse_speculative_config({**base, "async_verify": True})
    assert config.async_verify and config.to_dict()["async_verify"] is True
    assert parse_speculative_config(json.dumps(config.to_dict())) == config
    assert "async_verify" not in parse_speculative_config(base).to_dict()
    with pytest.raises(SpeculativeConfigError, match="`async_verify` must be true or false, got 'yes'"):
        parse_speculative_config({**base, "async_verify": "yes"})


def test_measure_cost_is_on_by_default_and_either_bool_round_trips() -> None:
    """k_policy.measure_cost (deltaserve only): the policy times its own steps unless it is false."""
    assert KPolicyConfig().measure_cost is True
    assert parse_speculative_config({"method": "mtp", "k_policy": {}}).k_policy.measure_cost is True
    for value in (True, False):
        config = parse_speculative_config({"method": "mtp", "k_policy": {"measure_cost": value, "token_cost": 1}})
        assert config.k_policy == KPolicyConfig(measure_cost=value, token_cost=1.0)
        assert config.to_dict()["k_policy"]["measure_cost"] is value
        assert parse_speculative_config(json.dumps(config.to_dict())) == config
