"""Structured-output options that vLLM 0.26 accepts and never reads with xgrammar: accepted here too, and logged as
ignored (once per set of names), never dropped without a word; the constraint itself is unchanged by them."""

from __future__ import annotations

import logging

import pytest

from deltaserve.api import structured
from deltaserve.api.protocol import CompletionRequest


def fields_of(**body: object) -> tuple[dict[str, object], str] | None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "p", **body})
    return structured.structured_fields(request, None)


def test_options_without_effect_are_logged_by_name(caplog: pytest.LogCaptureFixture) -> None:
    structured._logged_option_sets.clear()
    so = {"regex": "[0-9]+", "whitespace_pattern": "[ ]?", "disable_additional_properties": True, "backend": "x"}
    with caplog.at_level(logging.WARNING, logger=structured.__name__):
        found = fields_of(structured_outputs=so)
        fields_of(structured_outputs=so)  # the same set again: not logged twice
        fields_of(guided_regex="a+", guided_whitespace_pattern="\\s")
        fields_of(structured_outputs={"regex": "[0-9]+"})  # nothing ignored: nothing logged
    assert found is not None and found[0]["regex"] == "[0-9]+"
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert "{'backend', 'disable_additional_properties', 'whitespace_pattern'}" in lines[0]
    assert "{'guided_whitespace_pattern'}" in lines[1] and "ignored" in lines[1]
