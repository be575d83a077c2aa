"""The non-streamed completions body, and the bound on the prompt-logprob work one request may ask for.

A request with n choices and prompt logprobs (prompt_logprobs, or echo with logprobs) reports the same prompt
entries in every choice. The engine computes them once per prompt (engine/frontend.py asks only the first of the
n sequences) and this module carries them once: the event loop only records what each engine output adds (text,
token ids, raw logprob entries), and the body is built and rendered on a worker thread, where each prompt's
prompt_logprobs and echoed logprobs are built once and its rendered prompt_logprobs is shared by its n choices
(json_body.RawJSON). Rendering hands json.dumps bounded pieces, so the event loop keeps answering meanwhile.

The bound (check_prompt_logprob_work, docs/limits.md): n x prompt tokens x (prompt_logprobs + 1), plus
(logprobs + 1) per prompt token with echo, summed over a batch's prompts, at most --max-prompt-logprob-entries.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import anyio

from deltaserve.api.errors import bad_request
from deltaserve.api.json_body import JSONPiecesResponse, RawJSON, render_json
from deltaserve.api.logprobs import CompletionLogprobs, TokenNamer, completion_top, prompt_logprobs_json
from deltaserve.api.protocol import CompletionRequest
from deltaserve.api.serving_common import merge_streams
from deltaserve.engine.request import Logprob, RequestOutput

if TYPE_CHECKING:
    from deltaserve.api.serving_completion import ChoiceState, CompletionJob


def prompt_logprob_entries(request: CompletionRequest, num_prompt_tokens: int, prompt_logprobs: int | None) -> int:
    """The logprob entries a response reports for the prompts: per choice and prompt token, prompt_logprobs + 1
    (the token itself and its top-N) in prompt_logprobs, and logprobs + 1 more in the echoed logprobs."""
    per_token = 0
    if prompt_logprobs is not None:
        per_token += prompt_logprobs + 1
    if request.echo and request.logprobs is not None:
        per_token += request.logprobs + 1
    return request.n * num_prompt_tokens * per_token


def check_prompt_logprob_work(
    request: CompletionRequest, num_prompt_tokens: int, prompt_logprobs: int | None, bound: int
) -> None:
    """A 400 naming the fields when the request asks for more prompt-logprob entries than the bound."""
    entries = prompt_logprob_entries(request, num_prompt_tokens, prompt_logprobs)
    if entries <= bound:
        return
    fields = [f"n={request.n}", f"{num_prompt_tokens} prompt tokens"]
    if request.prompt_logprobs is not None:
        fields.append(f"prompt_logprobs={request.prompt_logprobs}")
    if request.echo and request.logprobs is not None:
        fields.append(f"echo with logprobs={request.logprobs}")
    param = "prompt_logprobs" if request.prompt_logprobs is not None else "logprobs"
    raise bad_request(
        f"The request asks for {entries} prompt logprob entries ({', '.join(fields)}), more than this server's "
        f"bound of {bound} (--max-prompt-logprob-entries). Reduce n, the prompt, or the number of logprobs.",
        param,
    )


def record(job: CompletionJob, choice: ChoiceState, seq: Any) -> None:
    """What one engine output adds to a choice, kept raw (on the event loop: no per-token work here)."""
    choice.text.append(seq.text)
    if not job.is_echo_only:
        choice.num_tokens += len(seq.token_ids)
        choice.token_ids.extend(seq.token_ids)
    if seq.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = seq.finish_reason, seq.stop_reason
    if choice.logprobs is not None and not job.is_echo_only:
        entries = seq.logprobs or []
        # a token the engine gave no entry for is reported as an empty one, as CompletionLogprobs.build does
        choice.logprob_entries.extend(entries[: len(seq.token_ids)])
        choice.logprob_entries.extend({} for _ in range(len(seq.token_ids) - len(entries)))


def build_echoed(
    namer: TokenNamer, num_top: int, token_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None] | None
) -> tuple[dict[str, list[Any]], int]:
    """A prompt's logprobs as echo reports them at the head of each choice's logprobs (vLLM: none for the first
    token), and the text offset the generated tokens continue from. The same for every choice of the prompt."""
    builder = CompletionLogprobs(namer, num_top)
    return builder.build(token_ids, list(prompt_logprobs or [])), builder.offset  # the first None shows null


def _merge(head: dict[str, list[Any]], tail: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: head[key] + tail[key] for key in head}


class BodyBuilder:
    """Builds and renders the body on a worker thread; per prompt work is done once and shared by its choices."""

    def __init__(self, job: CompletionJob) -> None:
        self.job = job
        self.rendered_prompt_logprobs: dict[int, RawJSON] = {}

    def _echoed(self, prompt_index: int) -> tuple[dict[str, list[Any]], int]:
        job = self.job
        if prompt_index not in job.echoed:
            job.echoed[prompt_index] = build_echoed(job.namer, job.request.logprobs or 0,
                                                    job.prompts[prompt_index].token_ids,
                                                    job.prompt_logprobs.get(prompt_index))  # fmt: skip
        return job.echoed[prompt_index]

    def _prompt_logprobs(self, prompt_index: int) -> RawJSON:
        if prompt_index not in self.rendered_prompt_logprobs:
            entries = prompt_logprobs_json(self.job.prompt_logprobs.get(prompt_index))
            self.rendered_prompt_logprobs[prompt_index] = RawJSON(render_json(entries))
        return self.rendered_prompt_logprobs[prompt_index]

    def _logprobs(self, choice: ChoiceState) -> dict[str, list[Any]] | None:
        job = self.job
        if choice.logprobs is None:
            return None
        echoed, offset = self._echoed(choice.prompt_index) if job.request.echo else (None, 0)
        if job.is_echo_only:
            return echoed
        generated = CompletionLogprobs(job.namer, completion_top(job.request) or 0, offset).build(
            choice.token_ids, choice.logprob_entries
        )
        return generated if echoed is None else _merge(echoed, generated)

    def choice(self, index: int, choice: ChoiceState) -> RawJSON:
        job = self.job
        prompt = job.prompts[choice.prompt_index]
        text = "".join(choice.text)
        if job.request.echo:
            text = (prompt.text or "") + ("" if job.is_echo_only else text)
        # vLLM's choice model serialised whole: fields not asked for are null, not absent (its clients read them)
        item: dict[str, Any] = {"index": index, "text": text, "logprobs": self._logprobs(choice),
                                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                                "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                                "routed_experts": None}  # fmt: skip
        if job.request.prompt_logprobs is not None or choice.prompt_index in job.prompt_logprobs:
            item["prompt_logprobs"] = self._prompt_logprobs(choice.prompt_index)
        if job.request.return_token_ids:
            item["prompt_token_ids"] = prompt.token_ids
            item["token_ids"] = choice.token_ids
        return RawJSON(render_json(item))  # rendered now: the choice's objects are freed before the next

    def build(self) -> list[bytes]:
        choices = [self.choice(index, choice) for index, choice in sorted(self.job.choices.items())]
        return render_json(self.job.body(choices))


async def full_completion(job: CompletionJob) -> JSONPiecesResponse:
    """Collects the engine outputs (raw, on the event loop), then builds and renders the body on a worker thread."""
    async with contextlib.aclosing(merge_streams(job.streams)) as merged:
        async for prompt_index, output in merged:
            note_prompt(job, prompt_index, output)
            for seq in output.outputs:
                _, choice = job.choice(prompt_index, seq)
                record(job, choice, seq)
    return JSONPiecesResponse(await anyio.to_thread.run_sync(BodyBuilder(job).build))


def note_prompt(job: CompletionJob, prompt_index: int, output: RequestOutput) -> None:
    """Prefix-cache hits and the prompt's logprobs (one list per prompt, whatever its n)."""
    job.note_output(prompt_index, output)
    if output.prompt_logprobs is not None:
        job.prompt_logprobs[prompt_index] = output.prompt_logprobs
