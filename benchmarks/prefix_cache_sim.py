"""The prefix grid without a GPU: deltaserve's scheduler driven by a fake runner on `prefix_repetition` traffic.

What it answers: for a cache layout (KV blocks, state slots, max_num_seqs, step budget), the hit rate (cached /
prompt tokens, as `/metrics` counts it), the prefill tokens computed and the preemptions of a closed-loop run at
each concurrency (or, with --multi-turn, of the multi-turn grid's conversations, a client per concurrency), under
each eviction policy of the prefix cache (`lru`: least recently used first; `protect`:
checkpoints two sequences have hit are evicted only after every other, scheduler/prefix_cache.py). It models no
time: one step in flight, each collected before the next is planned, every sampled token 7, no warm-ups. The prompts
follow vLLM's `prefix_repetition` layout (num_prefixes x prompts_per_prefix, prefix-major, then shuffled with
`random.Random(seed)`, as deltaserve/bench/dataset_prefix.py does), with random token ids.

The H100 27B layout of session 25 (docs/prefix-caching.md#eviction-order) reproduces the measured hit rate:

    python3 benchmarks/prefix_cache_sim.py --concurrencies 32 --kv-blocks 2172 --slots 19 --max-num-seqs 16

Exit 0; 2 when no point ran.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler import prefix_cache
from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import Sequence
from deltaserve.step import StepResult

POLICIES = {"lru": 1 << 30, "protect": prefix_cache.PROTECT_AFTER_HITTERS}  # hitters before a checkpoint is protected


@dataclass(frozen=True)
class Layout:
    """The cache the scheduler plans over (as the start-up log states it) and the traffic's shape."""

    kv_blocks: int
    slots: int
    max_num_seqs: int
    budget: int  # max_num_batched_tokens
    prefix_len: int
    suffix_len: int
    output_len: int
    num_prefixes: int
    block_size: int = 16
    chunk_size: int = 64
    max_model_len: int = 8192


@dataclass(frozen=True)
class Point:
    policy: str
    concurrency: int
    num_prompts: int
    hit_rate: float
    prefill_tokens: int  # tokens computed by chunks of more than one token
    preemptions: int
    steps: int


def prompts(layout: Layout, num_prompts: int, seed: int) -> list[list[int]]:
    """num_prefixes x (num_prompts // num_prefixes) prompts, prefix-major, shuffled as vLLM shuffles them."""
    rng = random.Random(seed + 1)
    per_prefix = num_prompts // layout.num_prefixes
    out = []
    for _ in range(layout.num_prefixes):
        prefix = [rng.randrange(1, 1 << 17) for _ in range(layout.prefix_len)]
        out += [prefix + [rng.randrange(1, 1 << 17) for _ in range(layout.suffix_len)] for _ in range(per_prefix)]
    random.Random(seed).shuffle(out)
    return out


@contextmanager
def eviction_policy(policy: str) -> Iterator[None]:
    """The prefix cache's protection threshold set to `policy`'s for the block, the served one restored after."""
    saved = prefix_cache.PROTECT_AFTER_HITTERS
    prefix_cache.PROTECT_AFTER_HITTERS = POLICIES[policy]
    try:
        yield
    finally:
        prefix_cache.PROTECT_AFTER_HITTERS = saved


class Run:
    """One simulated run: the scheduler over the layout's cache, the requests sent and the steps it took, each step
    answered by a fake runner (every sampled token 7)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.scheduler = Scheduler(
            BlockManager(layout.kv_blocks, layout.block_size), StateSlotPool(layout.slots), layout.max_num_seqs,
            layout.budget, layout.max_model_len, enable_prefix_caching=True, chunk_size=layout.chunk_size,
        )  # fmt: skip
        self.sent = self.prefill = self.steps = 0

    @property
    def in_flight(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def send(self, tokens: list[int]) -> str:
        """A greedy request for the layout's output_len tokens (ignore_eos); its id."""
        params = SamplingParams(temperature=0.0, max_tokens=self.layout.output_len, ignore_eos=True)
        seq = Sequence(f"r{self.sent}", list(tokens), self.layout.output_len, sampling=params)
        self.scheduler.add(seq)
        self.sent += 1
        return seq.seq_id

    def step(self) -> None:
        plan = self.scheduler.schedule()
        self.prefill += sum(s.num_new_tokens for s in plan.seqs if s.num_new_tokens > 1)
        self.scheduler.update(plan, StepResult(plan.step_id, tuple((7,) if s.needs_sample else () for s in plan.seqs)))
        self.steps += 1

    def point(self, policy: str, concurrency: int) -> Point:
        queries = self.scheduler.prefix_cache_queries
        hit_rate = self.scheduler.prefix_cache_hits / queries if queries else 0.0
        preemptions = self.scheduler.num_preemptions_total
        return Point(policy, concurrency, self.sent, round(hit_rate, 4), self.prefill, preemptions, self.steps)


def simulate(layout: Layout, policy: str, concurrency: int, num_prompts: int, seed: int = 0) -> Point:
    """One closed-loop run: `concurrency` requests in flight until every prompt has finished."""
    with eviction_policy(policy):
        run = Run(layout)
        queue = prompts(layout, num_prompts, seed)
        while run.sent < len(queue) or run.scheduler.has_unfinished():
            while run.sent < len(queue) and run.in_flight < concurrency:
                run.send(queue[run.sent])
            run.step()
    return run.point(policy, concurrency)


@dataclass(frozen=True)
class Conversations:
    """The multi-turn grid's workload (deltaserve/bench/multi_turn.py): one conversation per client, a shared system
    prompt, `turns` turns of `user_len` new tokens and an answer of the layout's output_len, each turn re-sending the
    whole history with the earlier answers."""

    system_len: int = 2000
    turns: int = 12
    user_len: int = 200


def simulate_conversations(layout: Layout, policy: str, clients: int, talk: Conversations, seed: int = 0) -> Point:
    """`clients` conversations at once, each sending its next turn when its previous answer is complete."""
    rng = random.Random(seed + 1)
    with eviction_policy(policy):
        run = Run(layout)
        system = [rng.randrange(1, 1 << 17) for _ in range(talk.system_len)]
        history = {client: list(system) for client in range(clients)}
        turns_left = dict.fromkeys(range(clients), talk.turns)
        talking: dict[str, int] = {}  # request id -> client
        while any(turns_left.values()) or run.scheduler.has_unfinished():
            for client in range(clients):
                if turns_left[client] and client not in talking.values():
                    history[client] += [rng.randrange(1, 1 << 17) for _ in range(talk.user_len)]
                    talking[run.send(history[client])] = client
                    turns_left[client] -= 1
            run.step()
            live = {seq.seq_id for seq in (*run.scheduler.running, *run.scheduler.waiting)}
            for seq_id in [i for i in talking if i not in live]:  # finished: its answer joins the history
                history[talking.pop(seq_id)] += [7] * layout.output_len
    return run.point(policy, clients)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrencies", default="8,32,64")
    parser.add_argument("--policies", default="lru,protect")
    parser.add_argument("--kv-blocks", type=int, required=True, help="KV blocks of 16 tokens (the start-up log)")
    parser.add_argument("--slots", type=int, required=True, help="GDN state slots, live and checkpoints")
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--prefix-len", type=int, default=4224)
    parser.add_argument("--suffix-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prompts-per-concurrency", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--multi-turn",
        action="store_true",
        help="the multi-turn grid's conversations instead (a client per concurrency; --output-len is the answer)",
    )
    parser.add_argument("--system-len", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--user-len", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="a JSON record of the layout and every point")
    args = parser.parse_args(argv)
    layout = Layout(args.kv_blocks, args.slots, args.max_num_seqs, args.budget, args.prefix_len, args.suffix_len,
                    args.output_len, args.num_prefixes, max_model_len=args.max_model_len)  # fmt: skip
    points = []
    for concurrency in [int(c) for c in args.concurrencies.split(",") if c]:
        for policy in [p for p in args.policies.split(",") if p]:
            if policy not in POLICIES:
                parser.error(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
            if args.multi_turn:
                talk = Conversations(args.system_len, args.turns, args.user_len)
                point = simulate_conversations(layout, policy, concurrency, talk, args.seed)
            else:
                point = simulate(layout, policy, concurrency, args.prompts_per_concurrency * concurrency, args.seed)
            points.append(point)
            print(f"c{concurrency} {policy:8s} hit rate {point.hit_rate:6.1%}, prefill {point.prefill_tokens:,} "
                  f"tokens, {point.preemptions} preemptions, {point.steps} steps", flush=True)  # fmt: skip
    if args.out is not None:
        record = {"tool": "prefix_cache_sim", "layout": asdict(layout), "points": [asdict(p) for p in points]}
        if args.multi_turn:
            record["conversations"] = asdict(Conversations(args.system_len, args.turns, args.user_len))
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if points else 2


if __name__ == "__main__":
    sys.exit(main())
