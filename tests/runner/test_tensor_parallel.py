"""Tensor parallelism end to end on the CPU: two ranks over gloo on loopback (rank 0 here, one spawned worker).

Greedy and seeded outputs at TP=2 equal TP=1's in fp32 on the dense, MoE and Qwen3-Next tiny checkpoints (chunked
prefill, async scheduling, logprobs), and with expert parallelism; a transformers-written checkpoint with one KV
head (replicated), attention biases and a vocabulary 2 does not divide matches transformers at TP=2; the token gate
passes at TP=2; ranks started by an outside launcher (torchrun-style environment, the worker as `deltaserve serve`)
give the same tokens; a killed worker fails the LLM and the server cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.gates.tokens import run_gate
from deltaserve.runner.distributed import BroadcastChannel
from deltaserve.runner.executor import MultiprocExecutor, WorkerDiedError
from deltaserve.sampling_params import SamplingParams
from tests.model._hf_tiny import NUM_TOKENS, PROMPTS, build, load_reference, reference_tokens
from tests.support.ports import free_port
from tests.support.serve_process import assert_streams_end_in_an_error, open_streams, start_serve
from tests.support.vision import MAX_TOKENS as VISION_MAX_TOKENS
from tests.support.vision import PROMPTS as VISION_PROMPTS
from tests.support.vision import case_for, generate_together

REPO = Path(__file__).resolve().parents[2]
# lengths 1..100: the 100-token prompt is chunked by max_num_batched_tokens=64
LENGTHS = (1, 3, 17, 40, 64, 100)
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_batched_tokens": 64}


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": [(31 * i + 7 * n) % 1200 + 5 for i in range(n)]} for n in LENGTHS]


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)
    return [greedy, seeded, greedy, seeded, greedy, greedy]


def _generate(model: Path, **engine: object) -> tuple[list[list[int]], list[list[dict]]]:
    llm = LLM(model, **{**ENGINE, **engine})
    try:
        outputs = llm.generate(_prompts(), _params(), use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [o.outputs[0].logprobs or [] for o in outputs]
    return tokens, logprobs


# fp32 logits at TP=2 differ from TP=1's in the last bits (the row-parallel sums are split in two halves); the
# random tiny models amplify that to ~3e-3 in the worst logit, and a logprob moves by at most twice that. A logprob
# from a wrong shard or row would be off by O(1).
LOGPROB_TOLERANCE = 1e-2


def _assert_same(reference: tuple, other: tuple) -> None:
    assert other[0] == reference[0]
    for ours, ref in zip(other[1], reference[1], strict=True):
        for step_ours, step_ref in zip(ours, ref, strict=True):
            assert step_ours.keys() == step_ref.keys()
            for token, entry in step_ref.items():
                assert step_ours[token].rank == entry.rank
                assert abs(step_ours[token].logprob - entry.logprob) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_two_ranks_give_the_tokens_of_one(variant: str, tiny_dirs: dict[str, Path]) -> None:
    model = tiny_dirs[variant]
    _assert_same(_generate(model), _generate(model, tensor_parallel_size=2))


def test_expert_parallel_gives_the_tokens_of_one_rank(tiny_moe: Path) -> None:
    _assert_same(_generate(tiny_moe), _generate(tiny_moe, tensor_parallel_size=2, enable_expert_parallel=True))


def test_replicated_kv_head_biases_and_padded_vocab_match_transformers(tmp_path: Path, tiny_dense: Path) -> None:
    folder = build(
        "next", tmp_path / "mqa", tiny_dense, num_key_value_heads=1, attention_bias=True, vocab_size=1301
    )  # fmt: skip
    reference = load_reference(folder)
    llm = LLM(folder, dtype="float32", device="cpu", tensor_parallel_size=2)
    try:
        assert llm.engine.runner.load_report.unexpected == []
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference_tokens(reference)
        ids = PROMPTS[1]
        with torch.no_grad():
            ref_logits = reference(torch.tensor([ids])).logits[0].float()
        ours = llm.prefill_logits(ids)
        assert ours.shape == ref_logits.shape  # the padding row is cut off
        assert float((ours - ref_logits).norm() / ref_logits.norm()) < 1e-4
    finally:
        llm.shutdown()


def test_images_and_video_at_two_ranks_match_transformers() -> None:
    """The vision tower is replicated on every rank (each encodes the plan's pixels itself); the embeddings replace
    the placeholder rows after the vocab-parallel lookup. Chunks of 40 tokens cut images in two."""
    case = case_for("moe-vl")
    prompts = {name: case.prompt(name) for name in VISION_PROMPTS}
    llm = LLM(case.model_dir, dtype="float32", max_num_batched_tokens=40, max_num_seqs=4, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=VISION_MAX_TOKENS, ignore_eos=True)
        outputs = generate_together(llm, prompts, params)
    finally:
        llm.shutdown()
    for name, (ids, mm) in prompts.items():
        assert outputs[name] == case.reference_generate(ids, mm), name


def test_token_gate_passes_at_two_ranks(tiny_dense: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_gate(tiny_dense, num_prompts=4, max_tokens=6, tensor_parallel_size=2) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 2" in out and "STRICT 4/4" in out


def test_a_size_that_does_not_divide_is_refused_before_any_worker_starts(tiny_dense: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(tiny_dense, device="cpu", tensor_parallel_size=3)
    assert time.monotonic() - started < 5  # no process was spawned
    with pytest.raises(ValueError, match="'ray' is not supported"):
        LLM(tiny_dense, device="cpu", tensor_parallel_size=2, distributed_executor_backend="ray")


def test_ranks_started_by_an_outside_launcher(tiny_next: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's environment: rank 0 is this process's engine, rank 1 is `deltaserve serve` (it serves no HTTP,
    only rank 0's plans, and exits 0 when rank 0 shuts down); the plans travel by broadcast."""
    expected = _generate(tiny_next)
    dist_env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    worker = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.cli", "serve", str(tiny_next), "--device", "cpu", "-tp", "2"],
        env={**os.environ, **dist_env, "RANK": "1", "LOCAL_RANK": "1", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        for name, value in {**dist_env, "RANK": "0", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        llm = LLM(tiny_next, **ENGINE, tensor_parallel_size=2)
        assert isinstance(llm.engine.runner, MultiprocExecutor) and llm.engine.runner.pids == []
        try:
            outputs = llm.generate(_prompts(), _params(), use_tqdm=False)
        finally:
            llm.shutdown()
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected[0]
        assert worker.wait(60) == 0, worker.stdout.read().decode()[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait(10)


# Both peers leave as the engine's ranks do (runner/worker.py): destroy_process_groups, then no reference to a
# group left; a rank whose gloo group object outlived the interpreter could abort in its threads at exit
# ("terminate called without an active exception", rc -6: 3 of 18 runs on the 2-core machine before this).
CHANNEL_PEER = """
import sys
import torch.distributed as dist
from deltaserve.runner.distributed import BroadcastChannel, Launch, destroy_process_groups, init_process_groups
rank, port = int(sys.argv[1]), int(sys.argv[2])
tp = init_process_groups(Launch(2, rank, rank, "127.0.0.1", port, True), "cpu", False)
channel = BroadcastChannel(tp.cpu_group)
if rank == 0:
    for size in SIZES:
        channel.send(("call", "x" * size, (size,)))
    channel.send(("shutdown",))
else:
    while (message := channel.recv())[0] != "shutdown":
        assert message[1] == "x" * message[2][0]
        print(message[2][0], flush=True)
dist.barrier(tp.cpu_group)
destroy_process_groups()
tp.group = tp.cpu_group = channel.group = None  # as the workers do: no group outlives the interpreter
"""


def test_the_broadcast_channel_carries_messages_of_any_size() -> None:
    """Inline in the 64 KiB buffer, exactly at its edge, and past it (a second broadcast)."""
    sizes = [0, 10, BroadcastChannel.CAPACITY - 100, BroadcastChannel.CAPACITY, 300_000, 5]
    code = CHANNEL_PEER.replace("SIZES", repr(sizes))
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    peers = [
        subprocess.Popen([sys.executable, "-c", code, str(rank), port], env=env, stdout=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    outputs = [peer.communicate(timeout=120)[0] for peer in peers]
    assert [peer.returncode for peer in peers] == [0, 0]
    assert outputs[1].split() == [str(size) for size in sizes]


def test_a_killed_worker_fails_the_llm(tiny_dense: Path) -> None:
    llm = LLM(tiny_dense, dtype="float32", device="cpu", max_model_len=4096, tensor_parallel_size=2)
    try:
        (pid,) = llm.engine.runner.pids
        # mid-generation: the step in flight fails, naming the worker
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
        with pytest.raises(WorkerDiedError, match=f"rank 1 \\(pid {pid}\\) exited with code -9"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        with pytest.raises(WorkerDiedError):
            llm.engine.core.check_health()  # and stays failed
    finally:
        llm.shutdown()


def test_a_worker_that_dies_while_the_engine_idles_is_noticed(tiny_dense: Path) -> None:
    """No collective is waiting on the dead rank: the executor's monitor notices the exit by itself, so the
    server's core loop (which asks check_health every turn) stops instead of idling on a broken group."""
    llm = LLM(tiny_dense, **ENGINE, tensor_parallel_size=2)
    try:
        (pid,) = llm.engine.runner.pids
        llm.engine.core.check_health()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.engine.runner._failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.engine.runner._failure == f"tensor-parallel worker rank 1 (pid {pid}) exited with code -9"
        with pytest.raises(WorkerDiedError, match="exited with code -9"):
            llm.engine.core.check_health()
        with pytest.raises(WorkerDiedError):
            llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _spawned_child(pid: int) -> int:
    """The multiprocessing-spawned child of pid (not the resource tracker)."""
    for child in _children(pid):
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return child
    raise AssertionError(f"no spawned child of {pid}")


def test_a_killed_worker_ends_every_stream_and_the_server_exits_non_zero(tiny_dense: Path) -> None:
    """As tests/engine/test_core_process.py does for the core, one level down: the worker of rank 1 is the
    engine core's child."""
    server = start_serve(tiny_dense, "-tp", "2", start_timeout_s=180)
    try:
        events, threads = open_streams(server.base_url, 3)
        worker = _spawned_child(_spawned_child(server.process.pid))
        os.kill(worker, signal.SIGKILL)
        for thread in threads:
            thread.join(30)
        assert_streams_end_in_an_error(events)
        assert server.process.wait(30) != 0
        log = server.output()
        assert f"tensor-parallel worker rank 1 (pid {worker}) exited with code -9" in log, log[-3000:]
    finally:
        server.close()
