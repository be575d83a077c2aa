"""Stand-ins for the CUDA calls of the runner's start-up and serving paths, so those paths run on the CPU.

fake_cuda() patches runner/device_setup.py's is_cuda (in every module that imported it) to say yes, and replaces
what the CUDA-only branches then call: the memory queries (a GPU of `total_bytes`, `peak_bytes` of warm-up
activations, nothing allocated before), synchronize / empty_cache / events, pinned host memory (plain memory), and
CUDA graphs, and one stream for the device -> pinned host copies (a non-blocking copy into a pinned buffer lands
only when an event recorded after it, or a synchronize, completes; until then the buffer holds -7 / NaN). A
FakeGraph's capture records every aten op the captured body runs (a TorchDispatchMode), and each kernel's `*_ref` twin
as one launch (the twins sync the host where their Triton kernels do not), refusing the ops that sync the host or
index by a boolean mask (illegal while a real stream captures); its replay runs the record again on the same
tensors, copying fresh outputs into the captured ones: like a CUDA graph, it replays fixed addresses and the host
values of capture time, so a body that reads anything but its static buffers replays stale data.

What this cannot show: the Triton kernels themselves (the CPU runs their torch twins), real memory figures, and more
than one stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from deltaserve.runner import device_setup

# ops that wait for the device on CUDA: cudaErrorStreamCaptureUnsupported inside a capture
HOST_SYNCS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.is_nonzero.default,
}

# a boolean-mask index is a nonzero() on the device: a sync, and an output shape that depends on device data
MASK_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default}


def _is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


@dataclass
class FakeCuda:
    """What the fakes saw: captured and replayed graphs, events recorded."""

    total_bytes: int
    peak_bytes: int
    captures: int = 0
    replays: int = 0
    events: int = 0
    capturing: bool = False
    in_kernel: bool = False
    recording: list | None = None  # the ops of the graph being captured
    graphs: list[FakeGraph] = field(default_factory=list)
    pinned: dict[int, weakref.ref] = field(default_factory=dict)  # id -> host tensor made with pin_memory=True
    # the stream's pending device -> pinned host copies (destination, source snapshot), in issue order, and how
    # many have landed
    copies: list = field(default_factory=list)
    landed: int = 0

    def land(self, upto: int) -> None:
        """The copies issued before position `upto` of the stream have run."""
        with torch.inference_mode():  # (the buffers are inference tensors; the host may wait outside that mode)
            for dst, src in self.copies[self.landed : upto]:
                dst.copy_(src)
        self.landed = max(self.landed, upto)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list, state: FakeCuda) -> None:
        super().__init__()
        self.ops = ops
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        kwargs = kwargs or {}
        if self.state.in_kernel:  # a kernel's torch twin: recorded whole by its wrapper (_kernel_stand_in)
            return func(*args, **kwargs)
        if func in HOST_SYNCS:
            raise RuntimeError(f"{func} syncs the host inside a CUDA graph capture (illegal on the GPU)")
        if func in MASK_INDEXING and any(_is_mask(i) for i in tree_leaves(args[1:])):
            raise RuntimeError(
                f"{func} with a boolean mask syncs the host inside a CUDA graph capture (its output "
                "shape is the mask's count: illegal on the GPU)"
            )
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _leaves(out: object) -> list[object]:
    """An op's outputs, tensor by tensor: pytree containers and dataclasses of tensors (kernels/fp8.py's Fp8Rows,
    whose kernels write all three of its tensors) alike."""
    leaves = []
    for leaf in tree_leaves(out):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            leaves += [tensor for f in dataclasses.fields(leaf) for tensor in _leaves(getattr(leaf, f.name))]
        else:
            leaves.append(leaf)
    return leaves


class FakeGraph:
    """torch.cuda.CUDAGraph's stand-in: ops recorded by fake_graph's capture, run again by replay()."""

    def __init__(self, state: FakeCuda) -> None:
        self.state = state
        self.ops: list = []

    def replay(self) -> None:
        if not self.ops:
            raise RuntimeError("replay of a graph that captured nothing")
        self.state.replays += 1
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(_leaves(out), _leaves(fresh), strict=True):
                # an op that allocated its output: the graph's output lives at the captured address
                if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():
                    if old.shape != new.shape:
                        raise RuntimeError(
                            f"{func} replayed a {tuple(new.shape)} output captured as "
                            f"{tuple(old.shape)}: its shape depends on device data"
                        )
                    old.copy_(new)

    def pool(self) -> object:
        return ("pool", id(self))


def _kernel_stand_in(ref: Callable[..., Any], state: FakeCuda) -> Callable[..., Any]:
    """A kernel's torch twin as a captured graph sees its Triton kernel: one launch, recorded whole, that reads its
    tensors when replayed (the twins use host syncs and masks a Triton launch does not)."""

    def launch(*args: Any, **kwargs: Any) -> Any:
        if not state.capturing or state.in_kernel:
            return ref(*args, **kwargs)
        state.in_kernel = True
        try:
            out = ref(*args, **kwargs)
        finally:
            state.in_kernel = False
        state.recording.append((ref, args, kwargs, out))
        return out

    return launch


class FakeEvent:
    def __init__(self, state: FakeCuda, **_: Any) -> None:
        self.state = state
        self.mark = 0

    def record(self, stream: object = None) -> None:
        self.state.events += 1
        self.mark = len(self.state.copies)  # the event completes after the copies issued before it

    def synchronize(self) -> None:
        self.state.land(self.mark)

    def query(self) -> bool:
        self.state.land(self.mark)
        return True


@contextlib.contextmanager
def fake_cuda(monkeypatch: pytest.MonkeyPatch, total_bytes: int, peak_bytes: int) -> Iterator[FakeCuda]:
    """Patches the CUDA-only calls (see the module docstring) for the duration of the block."""
    state = FakeCuda(total_bytes, peak_bytes)
    original = device_setup.is_cuda
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("deltaserve") and getattr(module, "is_cuda", None) is original:
            monkeypatch.setattr(module, "is_cuda", lambda device: True)

    def synchronize(device: object = None) -> None:
        if state.capturing:
            raise RuntimeError("torch.cuda.synchronize inside a CUDA graph capture (illegal on the GPU)")
        state.land(len(state.copies))

    @contextlib.contextmanager
    def graph(cuda_graph: FakeGraph, pool: object = None, **_: Any) -> Iterator[None]:
        if state.capturing:
            raise RuntimeError("nested CUDA graph capture")
        state.capturing = True
        try:
            state.recording = cuda_graph.ops
            with _Recorder(cuda_graph.ops, state):
                yield
        finally:
            state.capturing, state.recording = False, None
        state.captures += 1
        state.graphs.append(cuda_graph)

    empty = torch.empty

    def unpinned_empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        tensor = empty(*args, **kwargs)
        if pin_memory:  # what a pinned buffer holds until its copy lands: never a plausible token
            tensor.fill_(-7 if not tensor.is_floating_point() else float("nan"))
            state.pinned[id(tensor)] = weakref.ref(tensor)
        return tensor

    copy_ = torch.Tensor.copy_

    def stream_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        # a non-blocking copy into pinned host memory runs on the stream: it lands when an event recorded after it,
        # or a synchronize, completes (the host reads the buffer's old contents before that)
        is_pinned = id(self) in state.pinned and state.pinned[id(self)]() is self
        if non_blocking and is_pinned and not state.capturing:
            state.copies.append((self, src.clone()))
            return self
        return copy_(self, src, non_blocking=non_blocking)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("deltaserve.kernels."):
            for name, value in list(vars(module).items()):
                if name.endswith("_ref") and callable(value) and getattr(value, "__module__", "") == module.__name__:
                    stand_in = _kernel_stand_in(value, state)
                    for holder in list(sys.modules.values()):
                        if (
                            getattr(holder, "__name__", "").startswith("deltaserve")
                            and getattr(holder, name, None) is value
                        ):
                            monkeypatch.setattr(holder, name, stand_in)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", synchronize)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (total_bytes, total_bytes))
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: peak_bytes)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    props = SimpleNamespace(total_memory=total_bytes, name="NVIDIA H200", multi_processor_count=132)
    monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(cuda, "is_current_stream_capturing", lambda: state.capturing)
    monkeypatch.setattr(cuda, "Event", lambda **kwargs: FakeEvent(state, **kwargs))
    monkeypatch.setattr(cuda, "CUDAGraph", lambda **kwargs: FakeGraph(state))
    monkeypatch.setattr(cuda, "graph", graph)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self)
    monkeypatch.setattr(torch, "empty", unpinned_empty)
    monkeypatch.setattr(torch.Tensor, "copy_", stream_copy)
    yield state
