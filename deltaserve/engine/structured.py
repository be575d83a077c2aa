"""StructuredOutputManager: the engine core's owner of every constraint whose mask depends on the tokens already
sampled (grammars, and bad words of more than one token), beside the scheduler.

Compilation is asynchronous: a request with a grammar is parked here (not in the scheduler) while a worker thread
compiles it, and admitted once ready, so the step loop never waits on a compile; compiled grammars are shared
between requests with the same constraint (an LRU cache). Why the core compiles and not the front end: the compiled
grammar carries a token-mask cache of the tokenizer's whole vocabulary (megabytes for a 248k vocabulary), which
the front end would have to serialise, pipe and the core deserialise synchronously, on its critical path, for
every request; compiling here costs the pipe nothing, shares one cache across requests, and the front end still
refuses a malformed constraint up front by parsing it (engine/grammar.py), which needs no tokenizer.

Each step: `needs_mask(plan)` tells the core to launch the step with deferred sampling; after the core collected
the previous step and fed its tokens in (`accept`), `fill(plan, owners)` writes the bitmask rows of the step's
constrained sampling rows, and the core hands them to runner.sample(). A constraint with `start_after_token_id`
(a reasoning model's </think>) masks nothing until that token is generated.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaserve.engine.grammar import GrammarMatcher, StructuredOutputsConfig, XGrammarBackend, cache_key
from deltaserve.engine.thinking_budget import ThinkingBudget, ThinkingStart
from deltaserve.sampler.logits_processors import bitmask_width
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import StepPlan

logger = logging.getLogger(__name__)

NUM_CACHED_GRAMMARS = 256


@dataclass
class ConstraintState:
    """One sequence's history constraints."""

    params: SamplingParams
    matcher: GrammarMatcher | None = None
    is_active: bool = True  # False until start_after_token_id is generated
    last_mask: torch.Tensor | None = None  # int32 [W]: the row of the last bitmask filled (read on a rejection)
    outputs: list[int] = field(default_factory=list)  # for multi-token bad words
    bad_words: list[list[int]] = field(default_factory=list)
    budget: ThinkingBudget | None = None  # a thinking-token budget: forces the reasoning end once it is spent


class StructuredOutputManager:
    def __init__(
        self, model_dir: Path, tokenizer: str | None, vocab_size: int, config: StructuredOutputsConfig,
        lookahead: int = 2,
    ) -> None:  # fmt: skip
        """lookahead: the most positions of a sequence that a step launched now could sample before the core has
        seen the tokens it depends on (the steps in flight and its own, verify positions included): a budgeted
        request's step is deferred only when a force may fall within them."""
        self.model_dir = model_dir
        self.lookahead = lookahead
        self.tokenizer_name = tokenizer
        self.vocab_size = vocab_size
        self.config = config
        self.width = bitmask_width(vocab_size)
        self._backend: XGrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._compiling: dict[str, tuple[str, Future]] = {}  # request id -> (its grammar's cache key, the compile)
        # cache key -> the compile running or queued for it: shared by every request that waits for the same
        # grammar, and kept when they all abort, so that a compile that could not be stopped (one that started)
        # still lands in the cache and a retry of the request finds it there
        self._inflight: dict[str, Future] = {}
        self.states: dict[str, ConstraintState] = {}
        self.row_owner: dict[int, str] = {}

    # -- requests -------------------------------------------------------------------------------------

    def add(
        self, request_id: str, params: SamplingParams, stop_token_ids: frozenset[int],
        thinking: ThinkingStart | None = None,
    ) -> bool:  # fmt: skip
        """Registers a request; True when it is ready now (no grammar, or one already compiled). thinking: the
        front end's markers and prompt section of a request with a thinking_token_budget."""
        if not params.needs_history_mask:
            return True  # nothing here: its steps are not deferred
        spec = params.structured_outputs
        state = ConstraintState(params, bad_words=[list(w) for w in params.bad_words_token_ids or [] if len(w) > 1])
        if params.thinking_token_budget is not None:
            if thinking is None:
                raise ValueError(f"request {request_id}: a thinking_token_budget needs the front end's markers")
            state.budget = ThinkingBudget(thinking, params.thinking_token_budget)
        if spec is not None:
            state.is_active = spec.start_after_token_id is None
        self.states[request_id] = state
        if spec is None:
            return True
        key = cache_key(spec, self.config.disable_any_whitespace)
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            state.matcher = self._get_backend(stop_token_ids).matcher(compiled)
            return True
        future = self._inflight.get(key)
        if future is None or future.cancelled():
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
            future = self._executor.submit(self._compile, key, params, stop_token_ids)
            self._inflight[key] = future
        self._compiling[request_id] = (key, future)
        return False

    def _get_backend(self, stop_token_ids: frozenset[int]) -> XGrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from deltaserve.model.preflight import load_tokenizer

                tokenizer = load_tokenizer(self.model_dir, self.tokenizer_name)
                self._backend = XGrammarBackend(tokenizer, self.vocab_size, sorted(stop_token_ids), self.config)
            return self._backend

    def _compile(self, key: str, params: SamplingParams, stop_token_ids: frozenset[int]) -> Any:
        backend = self._get_backend(stop_token_ids)
        return backend.compile(params.structured_outputs)

    def take_ready(self) -> tuple[list[str], list[tuple[str, str]]]:
        """(request ids whose grammar compiled, (request id, error) of those that failed), finished ones only."""
        for key, future in list(self._inflight.items()):
            if future.done():
                del self._inflight[key]
                if not future.cancelled() and future.exception() is None:
                    self._cache[key] = future.result()  # also when every request that waited for it aborted
                    self._cache.move_to_end(key)
                    if len(self._cache) > NUM_CACHED_GRAMMARS:
                        self._cache.popitem(last=False)
        ready, failed = [], []
        for request_id, (_key, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            state = self.states.get(request_id)
            if state is None:
                continue  # aborted meanwhile
            try:
                compiled = future.result()
            except Exception as exc:
                logger.error("request %s: the grammar did not compile: %s", request_id, exc)
                self.states.pop(request_id, None)
                failed.append((request_id, f"the structured-output grammar did not compile: {exc}"))
                continue
            state.matcher = self._backend.matcher(compiled)
            ready.append(request_id)
        return ready, failed

    def wait_any(self, timeout: float) -> None:
        """Blocks until a compile finishes or the timeout passes (an idle core with only parked requests)."""
        futures = [future for _, future in self._compiling.values()]
        if futures:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        entry = self._compiling.pop(request_id, None)
        if entry is not None and not any(key == entry[0] for key, _ in self._compiling.values()):
            entry[1].cancel()  # stops a queued compile nobody waits for; one that started runs on into the cache

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- steps ----------------------------------------------------------------------------------------

    def observe(self, plan: StepPlan) -> tuple[str | None, ...]:
        """Tracks which request holds each row; returns the owners of the plan's sequences, in plan order."""
        for row in plan.removed:
            self.row_owner.pop(row, None)
        for request in plan.added:
            self.row_owner[request.row] = request.req_id
        return tuple(self.row_owner.get(seq.row) for seq in plan.seqs)

    def needs_mask(self, plan: StepPlan, owners: tuple[str | None, ...]) -> bool:
        """Whether the step must wait for the tokens before it to be sampled: a sampling row with a grammar or a
        multi-token bad word, or with a thinking budget that may force a token within the lookahead."""
        if not self.states:
            return False
        for seq, owner in zip(plan.seqs, owners, strict=True):
            state = self.states.get(owner) if seq.needs_sample and owner is not None else None
            if state is None:
                continue
            if state.matcher is not None or state.bad_words or state.params.structured_outputs is not None:
                return True
            if state.budget is not None and state.budget.may_force_within(self.lookahead):
                return True
        return False

    def accept(self, request_id: str, token_ids: list[int]) -> str | None:
        """Feeds a sequence's newly accepted tokens to its constraints; returns why the request must fail when its
        grammar rejects one (never dropped silently: the output would no longer follow the constraint)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        if state.budget is not None:
            state.budget.accept(token_ids)
        spec = state.params.structured_outputs
        for token_id in token_ids:
            state.outputs.append(token_id)
            if state.matcher is None:
                continue
            if not state.is_active:
                state.is_active = token_id == spec.start_after_token_id
                continue
            if state.matcher.is_terminated:
                continue
            if not state.matcher.accept(token_id):
                position = len(state.outputs) - 1
                if state.last_mask is not None and not bool(state.last_mask.any()):
                    message = (
                        f"the structured-output constraint admits no token of this model's vocabulary at output "
                        f"position {position}: the tokenizer cannot spell what the grammar requires next"
                        + (" (or the request's bad_words exclude it)" if state.bad_words else "")
                    )
                else:
                    message = (
                        f"the structured-output grammar rejected sampled token {token_id} at output position "
                        f"{position} (the request's allowed_token_ids or logit_bias may exclude every token the "
                        f"grammar allows)"
                    )
                logger.error("request %s: %s", request_id, message)
                return message
        return None

    def fill(
        self, plan: StepPlan, owners: tuple[str | None, ...], drafts: dict[int, list[int]] | None = None
    ) -> tuple[torch.Tensor | None, np.ndarray, np.ndarray]:
        """(bitmask int32 [C, W], positions [C] in the step's sampling order) of the constrained sampling positions,
        and the forced tokens int64 [F, 2] ((position, token) rows: a spent thinking budget's reasoning end).
        A verify chunk (speculative decoding) samples 1 + k positions: `drafts` (plan index -> its k drafts) gives
        position j the mask after drafts 0 .. j-1, walked through the grammar and rolled back, a grammar waiting for
        its start token masking the positions after that draft only (docs/speculative-decoding.md#the-accept-rules);
        a budget's force at position j is the one after those drafts too."""
        positions: list[int] = []
        rows: list[tuple[ConstraintState, list[int]]] = []  # (state, the drafts before the position)
        forced: list[tuple[int, int]] = []
        position = 0
        for index, (seq, owner) in enumerate(zip(plan.seqs, owners, strict=True)):
            if not seq.needs_sample:
                continue
            state = self.states.get(owner) if owner is not None else None
            run = (drafts or {}).get(index, [])[: seq.num_draft_tokens] if seq.num_draft_tokens else []
            if state is not None and (self._has_mask(state) or self._starts_in(state, run)):
                for j in range(1 + seq.num_draft_tokens):
                    positions.append(position + j)
                    rows.append((state, run[:j]))
            if state is not None and state.budget is not None:
                for j in range(1 + seq.num_draft_tokens):
                    token = state.budget.forced(run[:j])
                    if token is not None:
                        forced.append((position + j, token))
            position += 1 + seq.num_draft_tokens
        forced_rows = np.asarray(forced, dtype=np.int64).reshape(-1, 2)
        if not rows:
            return None, np.zeros(0, dtype=np.int64), forced_rows
        bitmask = torch.full((len(rows), self.width), -1, dtype=torch.int32)
        for index, (state, before) in enumerate(rows):
            walked, is_active = self._walk(state, before)
            if state.matcher is not None and is_active and not state.matcher.is_terminated:
                state.matcher.fill(bitmask, index)
                if not before:  # a view: the bad words below clear their bits in it too; read on a rejection
                    state.last_mask = bitmask[index]
            if state.matcher is not None:
                state.matcher.rollback(walked)
            outputs = state.outputs + before
            for word in state.bad_words:
                prefix = word[:-1]
                if len(outputs) >= len(prefix) and outputs[len(outputs) - len(prefix) :] == prefix:
                    token = word[-1]
                    if 0 <= token < self.vocab_size:
                        word_index, bit = divmod(token, 32)
                        value = int(bitmask[index, word_index]) & ~(1 << bit)
                        # two's complement back into int32
                        bitmask[index, word_index] = value - (1 << 32) if value >= 1 << 31 else value
        return bitmask, np.asarray(positions, dtype=np.int64), forced_rows

    @staticmethod
    def _walk(state: ConstraintState, tokens: list[int]) -> tuple[int, bool]:
        """Feeds drafts to the grammar to fill a later position's mask; returns (how many it took, to roll back;
        whether the grammar is active after them). A draft the grammar refuses stops the walk: the target rejects that
        draft (its mask forbids it), so the positions after it are never emitted. A grammar waiting for its start
        token (a reasoning model's </think>) takes none of the drafts before that token and becomes active after it,
        as `accept` does with the tokens the step emits."""
        if state.matcher is None:
            return 0, False
        is_active, taken = state.is_active, 0
        start = state.params.structured_outputs.start_after_token_id
        for token in tokens:
            if not is_active:
                is_active = token == start
                continue
            if state.matcher.is_terminated or not state.matcher.accept(token):
                break
            taken += 1
        return taken, is_active

    @staticmethod
    def _starts_in(state: ConstraintState, drafts: list[int]) -> bool:
        """A grammar that waits for its start token and finds it among a verify chunk's drafts: the positions after
        that draft are masked as if it had been emitted."""
        if state.matcher is None or state.is_active:
            return False
        return state.params.structured_outputs.start_after_token_id in drafts

    @staticmethod
    def _has_mask(state: ConstraintState) -> bool:
        has_grammar = state.matcher is not None and state.is_active
        return has_grammar or bool(state.bad_words)
