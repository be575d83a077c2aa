"""Forming a tensor-parallel group with torch.distributed, and the channel that carries step plans to its workers.

Two ways to launch (both `--distributed-executor-backend mp`):
- spawned: rank 0 is the engine core's process; it opens a TCPStore (MASTER_ADDR / MASTER_PORT when set, else
  127.0.0.1 and a free port) and starts one worker process per other rank (runner/worker.py);
- external: an outside launcher (torchrun, or one command per host) starts every rank with RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so the ranks may sit on several hosts; rank 0 serves, the others run
  only the worker loop.
Collectives go through torch.distributed: the device group is NCCL on GPUs (NVLink multicast off) and gloo on the
CPU; a second, gloo group carries host-side agreement and, for external launches, the plans themselves. Spawned
workers get their plans through a pipe each (no rendezvous per step: rank 0's send does not wait for the
worker). Only plain-data messages cross: ("execute", StepPlan, defer_sampling), ("call", method, args),
("shutdown",).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from deltaserve import env
from deltaserve.model.parallel import TensorParallel

# The host group waits on plans for as long as the engine idles; only a closed connection (a dead rank) ends it.
IDLE_TIMEOUT = timedelta(days=3650)
Message = tuple


@dataclass(frozen=True)
class Launch:
    """Where this process sits in its tensor-parallel group and how the group meets."""

    world_size: int
    rank: int
    local_rank: int  # the GPU of this host this rank uses
    master_addr: str
    master_port: int  # 0: any free port (spawned workers only)
    is_external: bool  # started by an outside launcher (RANK / WORLD_SIZE), not spawned by rank 0


def resolve_launch(tensor_parallel_size: int) -> Launch:
    """The launch this process is part of: external when WORLD_SIZE (> 1) is set, else spawned by rank 0."""
    world = env.dist_world_size()
    if world is None or world == 1:
        return Launch(tensor_parallel_size, 0, 0, env.master_addr() or "127.0.0.1", env.master_port() or 0, False)
    if world != tensor_parallel_size:
        raise ValueError(
            f"WORLD_SIZE={world} (ranks started by an outside launcher) but --tensor-parallel-size "
            f"{tensor_parallel_size}: they must be equal"
        )
    rank, addr, port = env.dist_rank(), env.master_addr(), env.master_port()
    if rank is None or addr is None or port is None:
        raise ValueError("WORLD_SIZE is set, so RANK, MASTER_ADDR and MASTER_PORT must be set too (torchrun sets them)")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    local_rank = env.dist_local_rank()
    return Launch(world, rank, rank if local_rank is None else local_rank, addr, port, True)


def is_external_worker(tensor_parallel_size: int) -> bool:
    """True in a process an outside launcher started as a rank other than 0 (it runs only the worker loop)."""
    return tensor_parallel_size > 1 and resolve_launch(tensor_parallel_size).rank > 0


def open_store(launch: Launch) -> tuple[dist.TCPStore, Launch]:
    """Rank 0 of a spawned group: the rendezvous store (on a free port unless MASTER_PORT), and the launch with its
    actual port, which the workers are given."""
    timeout = timedelta(seconds=env.dist_timeout_s())
    store = dist.TCPStore(
        launch.master_addr, launch.master_port, launch.world_size, is_master=True, wait_for_workers=False,
        timeout=timeout,
    )  # fmt: skip
    return store, replace(launch, master_port=store.port)


def connect_store(launch: Launch) -> dist.TCPStore:
    """A spawned worker's client of rank 0's store."""
    timeout = timedelta(seconds=env.dist_timeout_s())
    return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False, timeout=timeout)


def init_process_groups(
    launch: Launch, device_type: str, is_expert_parallel: bool, store: dist.Store | None = None
) -> TensorParallel:
    """Joins the group (through `store` when spawned, else MASTER_ADDR / MASTER_PORT) and returns this rank's
    TensorParallel: the device group (NCCL on CUDA, gloo on the CPU) and the host gloo group."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process; one tensor-parallel engine per process"
        )
    timeout = timedelta(seconds=env.dist_timeout_s())
    kwargs: dict = {"rank": launch.rank, "world_size": launch.world_size, "timeout": timeout}
    if device_type == "cuda":
        env.disable_nvlink_multicast()
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
        kwargs.update(backend="nccl", device_id=device)
    else:
        kwargs["backend"] = "gloo"
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = f"tcp://{launch.master_addr}:{launch.master_port}"
    dist.init_process_group(**kwargs)
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(
        launch.rank, launch.world_size, launch.local_rank, dist.group.WORLD, cpu_group, is_expert_parallel
    )


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- plan channels ------------------------------------------------------------------------------------------------


class PipeChannel:
    """Rank 0 -> spawned workers: the pickled message written to one pipe per worker."""

    def __init__(self, connections: list[Connection]) -> None:
        self.connections = connections

    def send(self, message: Message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for connection in self.connections:
            connection.send_bytes(data)


class PipeReceiver:
    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def recv(self) -> Message:
        return pickle.loads(self.connection.recv_bytes())


class BroadcastChannel:
    """Rank 0 -> every rank over the host gloo group (external launches, several hosts): one broadcast of a fixed
    buffer (length prefix + pickle) per message, a second one only for a message that does not fit."""

    CAPACITY = 1 << 16

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.buffer = torch.zeros(self.CAPACITY, dtype=torch.uint8)

    def send(self, message: Message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.buffer[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        is_inline = len(data) <= self.CAPACITY - 8
        if is_inline:
            self.buffer[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.broadcast(self.buffer, src=0, group=self.group)
        if not is_inline:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def recv(self) -> Message:
        dist.broadcast(self.buffer, src=0, group=self.group)
        size = int.from_bytes(self.buffer[:8].numpy().tobytes(), "little")
        if size <= self.CAPACITY - 8:
            return pickle.loads(self.buffer[8 : 8 + size].numpy().tobytes())
        payload = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        return pickle.loads(payload.numpy().tobytes())
