"""The step contract between the scheduler and the runner: plain, frozen, picklable data (ints, tuples, strings,
bytes).

The scheduler produces one StepPlan per engine step; the runner (in this process or, later, in tensor-parallel
worker processes that receive a broadcast of it) executes it and answers with a StepResult. Nothing here holds a
tensor or a callable, so either side can be built by hand in a test and sent to another process.

The runner keeps a persistent request table indexed by `row`: a plan's `added` fill rows, its `removed` free them,
and each ScheduledSeq names its row and the blocks it gained this step. Tokens the runner has not been told about
(the token a previous step sampled, still on the device under async scheduling) are taken from the runner's own
record of what it sampled last for that row; everything else comes from the table.

Room is left for what comes next: draft tokens (speculative decoding: k + 1 tokens per decode and per-token
states), checkpoint slots and a read slot that differs from the write slot (hybrid prefix caching), multimodal
spans (image and video placeholders) and a plan that workers receive whole (tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class MultimodalSpan:
    """A placeholder run inside a request's prompt whose embeddings come from an encoder (empty for text)."""

    offset: int  # first prompt position of the span
    length: int  # number of placeholder tokens
    item: int  # index of the image / video item of the request whose encoder output fills it


def window_spans(mm_input: MultimodalInput | None, start: int, end: int) -> tuple[MultimodalSpan, ...]:
    """The spans of the items whose encoder rows a chunk over tokens [start, end) consumes."""
    if mm_input is None:
        return ()
    items = mm_input.items
    return tuple(MultimodalSpan(items[i].offset, items[i].length, i) for i in mm_input.items_in_window(start, end))


@dataclass(frozen=True)
class NewRequest:
    """A request the runner's table gains this step (new, or resumed after a preemption)."""

    row: int
    req_id: str
    prompt_token_ids: tuple[int, ...]
    # Tokens this sequence already produced before a preemption; for the runner they are prompt tokens to compute,
    # but penalties count them as outputs and seeded sampling continues at index len(output_token_ids).
    output_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...]  # eos ids + the request's stop_token_ids: masked while under min_tokens
    # MRoPE positions of the prompt [3][len(prompt)] when they are not the token index (multimodal), and the offset
    # that decode positions add (docs/ARCHITECTURE.md#positions-and-mrope); None for text.
    mrope_positions: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None
    mrope_delta: int = 0
    # Images and videos of the prompt: pixel rows, grids, placeholder spans, and the MRoPE positions they imply
    # (they win over mrope_positions); None for text.
    mm_input: MultimodalInput | None = None


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's work in a step."""

    row: int
    num_computed_tokens: int  # tokens whose KV / state are written before this step
    num_new_tokens: int  # tokens computed this step
    write_slot: int  # the GDN state slot this step leaves its state in
    read_slot: int | None  # the slot to start from; None: a zero state (a fresh prefill)
    new_block_ids: tuple[int, ...]  # KV blocks appended to the sequence's block table this step
    needs_sample: bool  # the chunk reaches the sequence's last token, so a next token is sampled
    num_draft_tokens: int = 0  # speculative draft tokens among num_new_tokens (0 until speculative decoding)
    # (position, slot) pairs: after this step, the GDN state at `position` (tokens [0, position) consumed) is saved
    # into `slot` (a prefix-cache checkpoint, docs/prefix-caching.md). The runner implements the chunk's end
    # (num_computed_tokens + num_new_tokens) and, in a prefill chunk, at most one position strictly inside it on its
    # GDN chunk grid (num_computed_tokens + 64 j, j >= 1: saved during the forward, runner/step_checkpoints.py); it
    # refuses any other.
    checkpoints: tuple[tuple[int, int], ...] = ()
    mm_spans: tuple[MultimodalSpan, ...] = ()  # spans this chunk overlaps (empty until multimodal input)
    return_logits: bool = False  # the runner returns the logits of every token of the chunk (a prefill-only request)
    # planned while a verify chunk of the same sequence was in flight (async verify, scheduler/spec.py):
    # num_computed_tokens assumes that verify accepted every draft; the runner moves the chunk back by the drafts it
    # rejected, on the device (runner/spec_chain.py). Its KV blocks cover the optimistic span, a superset.
    is_chained: bool = False

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.num_computed_tokens > 0 and self.read_slot is not None


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    seqs: tuple[ScheduledSeq, ...]  # decodes first, then prefill chunks
    added: tuple[NewRequest, ...] = ()
    removed: tuple[int, ...] = ()  # rows freed before this step (their requests finished, aborted or preempted)
    # (source, destination) KV blocks copied whole, in every full-attention layer, before the forward: a prefix-cache
    # hit that ends inside a block gets a copy of the checkpoint's partial block (docs/prefix-caching.md)
    block_copies: tuple[tuple[int, int], ...] = ()
    # speculative decoding: the drafts the runner's drafter proposes after this step for each sequence it samples
    # (0 .. k; 0: the drafter's first pass alone, which keeps its own KV up with the target's); a later verify of
    # that sequence uses at most this many. None: k, the configured num_speculative_tokens (vLLM's fixed k, or
    # speculation off)
    num_drafts_next: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.seqs if s.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class StepResult:
    """What a step produced, in the plan's sequence order."""

    step_id: int
    # The accepted tokens of each sequence: one sampled token today (k + 1 at most with speculative decoding),
    # empty for a sequence that did not sample.
    token_ids: tuple[tuple[int, ...], ...]
    # Per sequence, per accepted token: ((token_id, logprob, rank), ...), the sampled token first, then the top-N
    # (N = the request's logprobs) with ranks 1..N; None where the request asked for none.
    logprobs: tuple[tuple[tuple[tuple[int, float, int], ...], ...] | None, ...] = field(default=())
    # Per sequence: prompt logprobs of this step's chunk, (position of its first target token, per target
    # ((token_id, logprob, rank), top-1, ..., top-N)); None where the chunk computed none; () when no sequence did.
    prompt_logprobs: tuple[tuple[int, tuple[tuple[tuple[int, float, int], ...], ...]] | None, ...] = field(default=())
    # Per sequence: the fp32 logits [num_new_tokens, V] of a chunk with return_logits, as row-major raw bytes (plain
    # and cheap to send; torch.frombuffer reads them back); None for the others; () when no sequence asked.
    logits: tuple[bytes | None, ...] = field(default=())
