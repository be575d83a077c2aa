"""The off-loop tokenizer front (tokens.py) gives exactly what the tokenizer gives, and the template sandbox
(template.py) renders exactly what transformers' apply_chat_template renders, within its bounds."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from deltaserve.api import tokens as tokens_module
from deltaserve.api.template import RenderJob, RenderLimitError, RenderLimits, TemplateCache, render
from deltaserve.api.tokens import Tokens, json_int_list, longest_token_chars

TEXTS = ["Hello world", "", "  spaced  out  ", "<|im_start|>user\nhi<|im_end|>", "東京 and émigré", "a" * 500,
         "tabs\tand\nnewlines\r\n", "<think>x</think>", "🙂🙃" * 20]  # fmt: skip


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_the_tokenizer(tokenizer: PreTrainedTokenizerFast, text: str, add_special_tokens: bool) -> None:
    front = Tokens(tokenizer)
    ids, count = run(front.encode(text, add_special_tokens=add_special_tokens))
    assert ids == tokenizer.encode(text, add_special_tokens=add_special_tokens) and count == len(ids)
    assert run(front.decode(ids)) == tokenizer.decode(ids)
    assert run(front.decode(ids, skip_special_tokens=True)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_sliced_conversion_and_truncation(tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_module, "SLICE_TOKENS", 7)  # many slices, and truncation longer than a slice
    text = " ".join(f"word{i}" for i in range(200))
    full = tokenizer.encode(text, add_special_tokens=False)
    front = Tokens(tokenizer)
    ids, count = run(front.encode(text, add_special_tokens=False))
    assert ids == full and count == len(full)
    kept, count = run(front.encode(text, add_special_tokens=False, truncate=50))
    assert kept == full[-50:] and count == len(full)
    kept, _ = run(front.encode(text, add_special_tokens=False, truncate=50, truncation_side="right"))
    assert kept == full[:50]
    assert json.loads(json_int_list(full)) == full


def test_text_that_cannot_fit_is_refused_before_tokenising(tokenizer: PreTrainedTokenizerFast) -> None:
    front = Tokens(tokenizer)
    bound = 10 * longest_token_chars(tokenizer)
    with pytest.raises(Exception, match="characters"):
        run(front.encode("x" * (bound + 1), add_special_tokens=False, max_input_tokens=10))
    # With truncation the text is cut to the bound from the truncated side, and the kept tokens are right.
    text = "y" * (bound + 500) + " the end"
    kept, _ = run(front.encode(text, add_special_tokens=False, max_input_tokens=10, truncate=3))
    assert kept == tokenizer.encode(text, add_special_tokens=False)[-3:]


CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": True}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {"add_generation_prompt": True}),
    ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": True, "enable_thinking": False}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
      {"role": "user", "content": "Weather?"}], {"add_generation_prompt": True}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}],
     {"continue_final_message": True}),
    ([{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [
      {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "sunny", "tool_call_id": "1"}], {"add_generation_prompt": True}),
    ([{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
     {"add_generation_prompt": True}),
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("with_tools", [False, True])
def test_render_matches_transformers(tokenizer: PreTrainedTokenizerFast, index: int, with_tools: bool) -> None:
    messages, options = CONVERSATIONS[index]
    options = dict(options)
    add_generation_prompt = options.pop("add_generation_prompt", False)
    continue_final_message = options.pop("continue_final_message", False)
    tools = TOOLS if with_tools else None
    expected = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, **options,
    )  # fmt: skip
    job = RenderJob(tokenizer.chat_template, json.loads(json.dumps(messages)), tools, None, add_generation_prompt,
                    continue_final_message, {**tokenizer.special_tokens_map, **options})  # fmt: skip
    assert render(TemplateCache(RenderLimits()), job) == expected


@pytest.mark.parametrize(
    "source",
    ["{{ 'x' * 2000 }}", "{{ 'x'.ljust(2000) }}", "{{ 'x'|center(2000) }}", "{{ '%2000d' % 1 }}",
     "{{ '{:>2000}'.format(1) }}", "{% for i in range(300) %}{{ 'abcdefghij' }}{% endfor %}",
     "{{ ('ab' * 500) ~ ('ab' * 500) }}{{ ('ab' * 500) + ('ab' * 500) }}", "{{ 'aaaa'|replace('a', 'b' * 600) }}"],
)  # fmt: skip
def test_size_bounds(source: str) -> None:
    limits = RenderLimits(max_output_chars=2500, max_value_chars=1500)
    job = RenderJob(source, [{"role": "user", "content": "x"}])
    with pytest.raises(RenderLimitError):
        render(TemplateCache(limits), job)
    generous = RenderLimits(max_output_chars=10**6, max_value_chars=10**6)
    render(TemplateCache(generous), job)  # the same template renders when the bounds allow it
