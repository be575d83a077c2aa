"""Tensor-parallel workers: the processes of ranks 1..N-1, each a ModelRunner on its shard that applies every plan
rank 0 sends and runs the same forward (its collectives meet rank 0's); rank 0 alone samples.

A spawned worker (started by runner/executor.py with torch.multiprocessing) dies with its parent, reports its
start-up error to rank 0 as the exception itself, and exits when rank 0 goes away (its pipe closes). A worker an
outside launcher started (RANK > 0 under torchrun) receives rank 0's resolved configuration over the host group
first, then its plans by broadcast.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import pickle
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from deltaserve.config import ModelConfig
from deltaserve.engine_config import EngineConfig
from deltaserve.runner.device_setup import resolve_device
from deltaserve.runner.distributed import (
    BroadcastChannel,
    Launch,
    PipeReceiver,
    connect_store,
    destroy_process_groups,
    init_process_groups,
    resolve_launch,
)
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.runner.threads import apply_serving_threads

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank builds its runner from: rank 0's resolved configuration."""

    model_config: ModelConfig
    engine_config: EngineConfig
    max_model_len: int
    max_num_batched_tokens: int


def serve_worker(runner: ModelRunner, receive: Any) -> None:
    """The worker loop: apply and run every plan rank 0 sends, until it says shutdown."""
    while True:
        message = receive()
        kind = message[0]
        if kind == "execute":
            runner.execute(message[1], message[2])
        elif kind == "call":
            getattr(runner, message[1])(*message[2])
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"tensor-parallel worker: unknown message {kind!r}")


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that spawned it dies, even by SIGKILL (no orphaned GPU
    workers blocked in a collective). Linux ties this to the spawning thread: engines are built on a thread that
    outlives them (the core's main thread, the caller's)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _configure_logging(rank: int, log_level: str) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [tp rank {rank}]: %(message)s")


def spawned_worker_main(
    launch: Launch, spec: WorkerSpec, plans: Connection, status: Connection, log_level: str
) -> None:
    """A worker rank 0 started: join its store and group, build the runner, report, serve."""
    _die_with_parent()
    # Ctrl-C and a group SIGTERM reach us too: the API process drains its streams first, then rank 0 stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _configure_logging(launch.rank, log_level)
    config = spec.engine_config
    try:
        store = connect_store(launch)
        store.set(f"joined/{launch.rank}", "1")
        tp = init_process_groups(launch, resolve_device(config.device).type, config.enable_expert_parallel, store)
        runner = ModelRunner(spec.model_config, config, spec.max_model_len, spec.max_num_batched_tokens, tp)
        tp.min_over_ranks(1)  # every rank has built its runner
    except BaseException as exc:
        logger.debug("tensor-parallel worker failed to start", exc_info=True)
        with contextlib.suppress(OSError):
            status.send(("error", _picklable(exc)))
        sys.exit(1)
    apply_serving_threads(runner.device.type)  # start-up is done: one torch CPU thread on a GPU (as vLLM)
    status.send(("ready", None))
    code = 0
    try:
        serve_worker(runner, PipeReceiver(plans).recv)
    except (EOFError, OSError):
        logger.info("rank 0 is gone: stopping")
    except Exception as exc:
        logger.error("tensor-parallel worker stopped: %s", exc)
        logger.debug("", exc_info=True)
        code = 1
    finally:
        destroy_process_groups()
        tp.group = tp.cpu_group = None  # the groups' threads stop now, not in the C++ teardown after the interpreter
        del store
    sys.exit(code)


def run_external_worker(engine_config: EngineConfig) -> int:
    """A rank > 0 an outside launcher started: join the group, take rank 0's configuration, serve its plans.
    Returns the process's exit code."""
    launch = resolve_launch(engine_config.tensor_parallel_size)
    device_type = resolve_device(engine_config.device).type
    tp = init_process_groups(launch, device_type, engine_config.enable_expert_parallel)
    try:
        received: list[WorkerSpec | None] = [None]
        dist.broadcast_object_list(received, src=0, group=tp.cpu_group)
        spec = received[0]
        assert spec is not None
        logger.info("tensor-parallel rank %d of %d: %s", launch.rank, launch.world_size, spec.engine_config.model)
        runner = ModelRunner(spec.model_config, spec.engine_config, spec.max_model_len, spec.max_num_batched_tokens, tp)
        tp.min_over_ranks(1)
        apply_serving_threads(runner.device.type)
        serve_worker(runner, BroadcastChannel(tp.cpu_group).recv)
    except Exception as exc:
        logger.error("tensor-parallel rank %d stopped: %s", launch.rank, exc)
        logger.debug("", exc_info=True)
        return 1
    finally:
        destroy_process_groups()
        tp.group = tp.cpu_group = None
    return 0
