"""The `qwen3` reasoning parser: splits generated text into reasoning (`<think>` ... `</think>`) and content.

Qwen3.5's template opens `<think>` inside the prompt, so the output usually holds only `</think>`; older Qwen3
models emit `<think>` themselves, which is stripped. As in vLLM: with enable_thinking false everything is content,
and when thinking is on but `</think>` never comes, everything is reasoning, up to a `<tool_call>`, which
ends reasoning too (vLLM 0.26's qwen3 parser: the call is parsed, not hidden in reasoning). Whether thinking starts
open is read from the rendered prompt (its last turn opens `<think>` without closing it), so templates that think
by default and templates that do not are both handled.

The parser is incremental: feed() takes text deltas and returns (reasoning, content) deltas, holding back any tail
that could be the start of a tag split across deltas; finish() flushes. Non-streaming output is the same feed
over the whole text, so streamed and non-streamed results always agree.
"""

from __future__ import annotations

from deltaserve.reasoning_config import QWEN3_MARKERS

THINK_START, THINK_END = QWEN3_MARKERS
TURN_START = "<|im_start|>"
TOOL_CALL_START = "<tool_call>"  # ends reasoning without </think> (vLLM 0.26's qwen3 engine), and stays content


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the prompt's last turn leaves a `<think>` block open (the generation prompt of a thinking turn)."""
    turn = prompt[prompt.rfind(TURN_START) :] if TURN_START in prompt else prompt
    return turn.rfind(THINK_START) > turn.rfind(THINK_END)


def partial_tag_length(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the tags (held back while streaming)."""
    best = 0
    for tag in tags:
        for length in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:length]):
                best = length
                break
    return best


class Qwen3ReasoningParser:
    """States: 'reasoning' (inside <think>), 'content', and 'start' (not yet known whether the model opens <think>)."""

    def __init__(self, *, is_prompt_thinking: bool, is_thinking_disabled: bool) -> None:
        if is_thinking_disabled:
            self.mode = "content"
        else:
            self.mode = "reasoning" if is_prompt_thinking else "start"
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.pending:
            if self.mode == "content":
                content.append(self.pending)
                self.pending = ""
            elif self.mode == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(THINK_START):
                    self.pending = stripped[len(THINK_START) :]
                    self.mode = "reasoning"
                elif stripped and THINK_START.startswith(stripped):
                    break  # maybe the start of <think>: wait for more text
                elif not stripped:
                    break  # only whitespace so far
                else:
                    self.mode = "content"
            else:
                text = self.pending
                start = text.find(THINK_START)
                end = text.find(THINK_END)
                call = text.find(TOOL_CALL_START)
                if call != -1 and all(i == -1 or call < i for i in (start, end)):
                    reasoning.append(text[:call])
                    self.pending = text[call:]
                    self.mode = "content"
                elif start != -1 and (end == -1 or start < end):
                    # A repeated <think> inside reasoning is dropped, as vLLM strips it from the output.
                    reasoning.append(text[:start])
                    self.pending = text[start + len(THINK_START) :]
                elif end != -1:
                    reasoning.append(text[:end])
                    self.pending = text[end + len(THINK_END) :]
                    self.mode = "content"
                else:
                    keep = partial_tag_length(text, (THINK_START, THINK_END, TOOL_CALL_START))
                    reasoning.append(text[: len(text) - keep])
                    self.pending = text[len(text) - keep :]
                    break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flushes held-back text: it stays in the section it was in."""
        text, self.pending = self.pending, ""
        if self.mode == "reasoning":
            return text, ""
        return "", text
