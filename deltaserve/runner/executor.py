"""Executors: what the engine core steps, with the ModelRunner's interface (execute / sample / collect / layout /
max_num_seqs / device / dtype / load_report / spec / step_drafts / check_health / shutdown / run_on_all_ranks /
set_step_observer).

--tensor-parallel-size 1 gets the ModelRunner itself: no wrapper, no process, nothing to pay. Above 1,
MultiprocExecutor keeps rank 0's ModelRunner in this process (it samples) and one worker process per other rank
(runner/worker.py), started here with torch.multiprocessing (spawn) or by an outside launcher (torchrun: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). execute() sends the plan to every worker, then runs rank 0's share; the
collectives inside the forward keep the ranks in step, and the sampled tokens (with speculative decoding, the
verify chunks' accepted tokens too: runner/spec_ranks.py) reach the workers over the device group. A worker that
dies makes the next call (execute, or check_health while idle) raise WorkerDiedError; on CUDA the group is aborted
as well, so a collective waiting on the dead rank returns instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing

from deltaserve import env
from deltaserve.config import ModelConfig
from deltaserve.engine_config import EngineConfig
from deltaserve.model.parallel import LocalShapes, TensorParallel
from deltaserve.runner.cache import CacheLayout
from deltaserve.runner.device_setup import resolve_device
from deltaserve.runner.distributed import (
    BroadcastChannel,
    Launch,
    PipeChannel,
    destroy_process_groups,
    init_process_groups,
    open_store,
    resolve_launch,
)
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.runner.observer import StepObserver
from deltaserve.runner.sampling_step import StepHandle
from deltaserve.runner.worker import WorkerSpec, run_external_worker, spawned_worker_main
from deltaserve.step import StepPlan, StepResult

logger = logging.getLogger(__name__)

JOIN_POLL_S = 0.05
_live: weakref.ref[MultiprocExecutor] | None = None  # the one tensor-parallel engine this process may hold


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited; the engine cannot step any more."""


def make_executor(
    model_config: ModelConfig, engine_config: EngineConfig, max_model_len: int, max_num_batched_tokens: int
) -> ModelRunner | MultiprocExecutor:
    if engine_config.tensor_parallel_size == 1:
        return ModelRunner(model_config, engine_config, max_model_len, max_num_batched_tokens)
    return MultiprocExecutor(model_config, engine_config, max_model_len, max_num_batched_tokens)


class _Workers:
    """The spawned worker processes and their pipes; release() (once) stops them and leaves the group. Kept apart
    from the executor so a finalizer can release them without holding the executor alive."""

    def __init__(self) -> None:
        self.processes: list[Any] = []
        self.plans: list[Connection] = []
        self.status: list[Connection] = []
        self.channel: PipeChannel | BroadcastChannel | None = None
        self.is_released = False
        self.is_group_joined = False
        self.is_graceful = True  # release() asks the workers to stop and waits for them; else kills them at once
        # the rendezvous store and this rank's groups, dropped on release: their threads then stop while the
        # interpreter is whole, not in the C++ teardown after it (where a live gloo thread aborts the process)
        self.store: dist.TCPStore | None = None
        self.tp: TensorParallel | None = None

    def spawn(self, launch: Launch, spec: WorkerSpec) -> None:
        context = torch.multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        for rank in range(1, launch.world_size):
            plan_recv, plan_send = context.Pipe(duplex=False)
            status_recv, status_send = context.Pipe(duplex=False)
            worker_launch = Launch(launch.world_size, rank, rank, launch.master_addr, launch.master_port, False)
            process = context.Process(
                target=spawned_worker_main,
                args=(worker_launch, spec, plan_recv, status_send, env.log_level()),
                name=f"deltaserve-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            plan_recv.close()
            status_send.close()
            self.processes.append(process)
            self.plans.append(plan_send)
            self.status.append(status_recv)

    def dead(self) -> list[tuple[int, Any]]:
        """(rank, process) of every worker that has exited."""
        return [(rank, p) for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None]

    def error(self, wait_s: float = 0.0) -> BaseException | None:
        """A worker's own start-up exception, or one naming the worker that exited; None while all are alive."""
        deadline = time.monotonic() + wait_s
        while True:
            for connection in self.status:
                with contextlib.suppress(EOFError, OSError):
                    if connection.poll(0):
                        kind, payload = connection.recv()
                        if kind == "error":
                            return payload
            dead = self.dead()
            if dead:
                rank, process = dead[0]
                return WorkerDiedError(
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                )
            if time.monotonic() >= deadline:
                return None
            time.sleep(JOIN_POLL_S)

    def wait_joined(self, store: dist.TCPStore, launch: Launch) -> None:
        """Waits until every worker has reached the group's rendezvous, raising a worker's failure at once."""
        keys = [f"joined/{rank}" for rank in range(1, launch.world_size)]
        deadline = time.monotonic() + env.dist_timeout_s()
        while not store.check(keys):
            error = self.error()
            if error is not None:
                raise error
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not start within {env.dist_timeout_s():.0f} s")
            time.sleep(JOIN_POLL_S)

    def wait_ready(self) -> None:
        for rank, connection in enumerate(self.status, start=1):
            try:
                kind, payload = connection.recv()
            except (EOFError, OSError):
                raise self.error(wait_s=5.0) or WorkerDiedError(f"tensor-parallel worker rank {rank} exited") from None
            if kind == "error":
                raise payload

    def release(self) -> None:
        if self.is_released:
            return
        self.is_released = True
        if self.channel is not None:
            with contextlib.suppress(Exception):
                self.channel.send(("shutdown",))
        deadline = time.monotonic() + (15 if self.is_graceful and self.channel is not None else 0)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        for connection in (*self.plans, *self.status):
            connection.close()
        if self.is_group_joined:
            with contextlib.suppress(Exception):
                destroy_process_groups()
        if self.tp is not None:
            self.tp.group = self.tp.cpu_group = None
        self.tp = self.store = None


class MultiprocExecutor:
    """Rank 0's ModelRunner here and a worker process per other rank; the ModelRunner's interface."""

    def __init__(
        self, model_config: ModelConfig, engine_config: EngineConfig, max_model_len: int, max_num_batched_tokens: int
    ) -> None:
        launch = resolve_launch(engine_config.tensor_parallel_size)
        if launch.rank > 0:
            # an outside launcher made this process a rank other than 0: it serves rank 0's plans, then exits
            raise SystemExit(run_external_worker(engine_config))
        # a size that does not divide the model is refused by field before any process starts
        LocalShapes.of(model_config, 0, launch.world_size, engine_config.enable_expert_parallel)
        _release_previous()
        device_type = resolve_device(engine_config.device).type
        if device_type == "cuda":
            env.disable_nvlink_multicast()  # before any worker starts: they inherit it
        spec = WorkerSpec(model_config, engine_config, max_model_len, max_num_batched_tokens)
        self.workers = _Workers()
        self._finalizer = weakref.finalize(self, self.workers.release)
        self._failure: str | None = None
        self.is_external = launch.is_external
        try:
            store = None
            if not launch.is_external:
                store, launch = open_store(launch)
                self.workers.store = store
                self.workers.spawn(launch, spec)
                self.workers.wait_joined(store, launch)
            self.tp: TensorParallel = init_process_groups(
                launch, device_type, engine_config.enable_expert_parallel, store
            )
            self.workers.is_group_joined = True
            self.workers.tp = self.tp
            if launch.is_external:
                dist.broadcast_object_list([spec], src=0, group=self.tp.cpu_group)
            self._start_monitor(device_type)
            self.driver = ModelRunner(model_config, engine_config, max_model_len, max_num_batched_tokens, self.tp)
            self.tp.min_over_ranks(1)  # every rank has built its runner
            self.workers.wait_ready()
        except BaseException as exc:
            # A checkpoint or config refusal (ValueError) is rank 0's own and every rank's: raise it at once. Any
            # other failure (a collective whose peer died) is most likely a worker's: take its own error.
            wait_s = 0.0 if isinstance(exc, ValueError) else 5.0
            error = None if launch.is_external else self.workers.error(wait_s)
            self.workers.is_graceful = False
            self._finalizer()
            if error is not None and error is not exc:
                raise error from exc
            raise
        self.workers.channel = (
            BroadcastChannel(self.tp.cpu_group) if launch.is_external else PipeChannel(self.workers.plans)
        )
        global _live
        _live = weakref.ref(self)
        logger.info("tensor parallelism: %d ranks (%s)", launch.world_size,
                    "started by an outside launcher" if launch.is_external else "worker processes spawned")  # fmt: skip

    # -- failures ---------------------------------------------------------------------------------------------------

    def _start_monitor(self, device_type: str) -> None:
        """A thread that notices a worker's exit at once: it records the failure and, on CUDA, aborts the group
        (an NCCL collective waiting on a dead rank would otherwise wait for its timeout). gloo fails by itself."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.workers.processes, start=1)}
        if not sentinels:
            return
        workers = self.workers
        failure = self._set_failure

        def watch() -> None:
            ready = multiprocessing.connection.wait(list(sentinels))
            if workers.is_released:
                return
            rank, process = sentinels[ready[0]]
            process.join(1)
            failure(f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}")
            for other in workers.processes:
                if other.is_alive():
                    other.kill()
            if device_type == "cuda":
                with contextlib.suppress(Exception):
                    dist.distributed_c10d._abort_process_group()

        threading.Thread(target=watch, name="deltaserve-tp-monitor", daemon=True).start()

    def _set_failure(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
            logger.error("%s", message)

    def check_health(self) -> None:
        """Raises WorkerDiedError once a worker has exited (or the executor was shut down)."""
        if self.workers.is_released and self._failure is None:
            raise WorkerDiedError("the tensor-parallel engine has been shut down")
        dead = self.workers.dead()
        if dead and self._failure is None:
            rank, process = dead[0]
            self._set_failure(
                f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
            )
        if self._failure is not None:
            raise WorkerDiedError(self._failure)

    def _raise_failure(self, exc: Exception) -> None:
        """After a step failed: a worker's death (waited for briefly, it is the usual cause) wins over exc."""
        deadline = time.monotonic() + 2.0
        while self._failure is None and not self.workers.dead() and time.monotonic() < deadline:
            time.sleep(JOIN_POLL_S)
        self.check_health()
        raise exc

    # -- the ModelRunner interface -------------------------------------------------------------------------------

    def execute(self, plan: StepPlan, defer_sampling: bool = False) -> StepHandle:
        self.check_health()
        try:
            # the workers never sample: they wait for rank 0's tokens, which sample() broadcasts when deferred; they
            # take the flag to make rank 0's choices (which steps replay the verify graphs: runner/spec_graphs.py)
            self.workers.channel.send(("execute", plan, defer_sampling))
            return self.driver.execute(plan, defer_sampling)
        except Exception as exc:
            self._raise_failure(exc)
            raise  # unreachable: _raise_failure raises

    def sample(
        self, handle: StepHandle, bitmask: np.ndarray | None, bitmask_rows: np.ndarray | None,
        forced: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """Rank 0 samples a deferred step (structured outputs, thinking budgets) and broadcasts its tokens to the
        workers."""
        try:
            self.driver.sample(handle, bitmask, bitmask_rows, forced)
        except Exception as exc:
            self._raise_failure(exc)
            raise

    def collect(self, handle: StepHandle) -> StepResult:
        try:
            return self.driver.collect(handle)
        except Exception as exc:
            self._raise_failure(exc)
            raise

    def step_drafts(self, handle: StepHandle) -> dict[int, list[int]]:
        """A deferred step's drafts (rank 0's; every rank drafted the same)."""
        return self.driver.step_drafts(handle)

    def enable_speculation(self, num_speculative_tokens: int, drafter: Any, *args: object) -> None:
        """Refused: a drafter object lives in one process. Under tensor parallelism every rank builds its own MTP
        drafter from speculative_config."""
        raise ValueError(
            "enable_speculation with a drafter object under tensor parallelism: pass speculative_config "
            '({"method": "mtp", ...}) so that every rank builds its MTP drafter'
        )

    def set_step_observer(self, observer: StepObserver | None) -> None:
        """Rank 0's runner calls it with every collected step (runner/observer.py); the workers collect nothing."""
        self.driver.set_step_observer(observer)

    def run_on_all_ranks(self, method: str, *args: object) -> object:
        """Calls a ModelRunner method on every rank; returns rank 0's result."""
        self.check_health()
        self.workers.channel.send(("call", method, args))
        return getattr(self.driver, method)(*args)

    def shutdown(self) -> None:
        """Stops the workers and leaves the group; later calls raise WorkerDiedError."""
        self._finalizer()

    @property
    def layout(self) -> CacheLayout:
        return self.driver.layout

    @property
    def max_num_seqs(self) -> int:
        return self.driver.max_num_seqs

    @property
    def device(self) -> torch.device:
        return self.driver.device

    @property
    def dtype(self) -> torch.dtype:
        return self.driver.dtype

    @property
    def load_report(self) -> Any:
        return self.driver.load_report

    # rank 0's pieces, for tests, gates and profiles
    @property
    def model(self) -> torch.nn.Module:
        return self.driver.model

    @property
    def table(self) -> Any:
        return self.driver.table

    @property
    def spec(self) -> Any:
        """Rank 0's speculative-decoding state (None without speculation)."""
        return self.driver.spec

    @property
    def graphs(self) -> Any:
        return self.driver.graphs

    @property
    def pids(self) -> list[int]:
        """The spawned workers' process ids (empty under an outside launcher)."""
        return [p.pid for p in self.workers.processes]


def _release_previous() -> None:
    """One tensor-parallel engine per process (torch.distributed has one default group): a previous one still
    alive is shut down first, with a warning."""
    previous = _live() if _live is not None else None
    if previous is not None and not previous.workers.is_released:
        logger.warning("shutting down the previous tensor-parallel engine of this process: one engine per process")
        previous.shutdown()
