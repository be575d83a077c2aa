"""Chat content parts read as vLLM's chat parser reads them (api/chat.py, engine/offline_chat.py): a bare string in a
content list is text; "text", "input_text", "output_text", "refusal" and "thinking" parts are text, each from its own
field; a part whose text is missing or empty is dropped (no empty line in the join); other part types are refused
by name. The same rules for the server and the offline LLM.chat."""

from __future__ import annotations

import pytest

from deltaserve.api.chat import content_text, to_template_messages
from deltaserve.api.errors import APIError
from deltaserve.api.protocol import ChatCompletionRequest
from deltaserve.engine.offline_chat import _content

PARTS = [
    "plain",
    {"type": "text", "text": "a"},
    {"type": "text", "text": ""},
    {"type": "text"},
    {"type": "input_text", "text": "b"},
    {"type": "output_text", "text": "c"},
    {"type": "refusal", "refusal": "no"},
    {"type": "thinking", "thinking": "hmm"},
]


def _messages(content: object) -> list:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": content}]}
    ).messages


def test_text_parts_as_vllm_reads_them() -> None:
    (message,) = _messages(PARTS)
    assert content_text(message, 0) == "plain\na\nb\nc\nno\nhmm"
    (rendered,) = to_template_messages([message], "openai")
    assert rendered["content"] == [{"type": "text", "text": t} for t in ("plain", "a", "b", "c", "no", "hmm")]
    assert to_template_messages([message], "string")[0]["content"] == "plain\na\nb\nc\nno\nhmm"
    # the offline LLM.chat takes the same parts as plain dicts
    assert _content(PARTS, 0, "string") == "plain\na\nb\nc\nno\nhmm"
    assert _content(PARTS, 0, "openai") == rendered["content"]


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {}}, {"type": "file", "file": {}}])
def test_other_part_types_are_refused_by_name(part: dict) -> None:
    (message,) = _messages(["x", part])
    with pytest.raises(APIError, match=repr(part["type"])):
        content_text(message, 0)
    with pytest.raises(ValueError, match=repr(part["type"])):
        _content(["x", part], 0, "string")
