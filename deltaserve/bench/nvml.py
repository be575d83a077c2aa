"""GPU facts and device-memory sampling through NVML, or None everywhere when NVML is not there.

NVML comes from `pynvml` (the nvidia-ml-py package) when importable, else straight from libnvidia-ml.so.1
through ctypes (the H200 host has the driver library even when no Python binding is installed). On a
machine without an NVIDIA driver every function returns None, so a CPU run records `null`, never a guess.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any

GIB = 1024**3


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Nvml:
    """The four NVML calls the harness uses, over pynvml or raw ctypes."""

    def __init__(self) -> None:
        self._pynvml: Any = None
        self._lib: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._pynvml = pynvml
            return
        except Exception:
            self._pynvml = None
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit_v2 failed")
        self._lib = lib

    def device_count(self) -> int:
        if self._pynvml is not None:
            return int(self._pynvml.nvmlDeviceGetCount())
        count = ctypes.c_uint()
        self._check(self._lib.nvmlDeviceGetCount_v2(ctypes.byref(count)))
        return count.value

    def _handle(self, index: int) -> Any:
        if self._pynvml is not None:
            return self._pynvml.nvmlDeviceGetHandleByIndex(index)
        handle = ctypes.c_void_p()
        self._check(self._lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)))
        return handle

    def used_bytes(self, index: int) -> int:
        if self._pynvml is not None:
            return int(self._pynvml.nvmlDeviceGetMemoryInfo(self._handle(index)).used)
        memory = _Memory()
        self._check(self._lib.nvmlDeviceGetMemoryInfo(self._handle(index), ctypes.byref(memory)))
        return int(memory.used)

    def name(self, index: int) -> str:
        if self._pynvml is not None:
            value = self._pynvml.nvmlDeviceGetName(self._handle(index))
            return value.decode() if isinstance(value, bytes) else str(value)
        buffer = ctypes.create_string_buffer(96)
        self._check(self._lib.nvmlDeviceGetName(self._handle(index), buffer, ctypes.c_uint(96)))
        return buffer.value.decode()

    def driver_version(self) -> str:
        if self._pynvml is not None:
            value = self._pynvml.nvmlSystemGetDriverVersion()
            return value.decode() if isinstance(value, bytes) else str(value)
        buffer = ctypes.create_string_buffer(96)
        self._check(self._lib.nvmlSystemGetDriverVersion(buffer, ctypes.c_uint(96)))
        return buffer.value.decode()

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise OSError(f"NVML call failed with status {status}")


def _open() -> _Nvml | None:
    try:
        return _Nvml()
    except Exception:
        return None


def gpu_info() -> dict[str, Any] | None:
    """{"gpus": [names], "driver": version} or None without NVML."""
    nvml = _open()
    if nvml is None:
        return None
    try:
        return {"gpus": [nvml.name(i) for i in range(nvml.device_count())], "driver": nvml.driver_version()}
    except Exception:
        return None


class MemorySampler:
    """Samples device memory used (summed over the chosen devices) on a thread; `peak_gib` after stop().

    Device memory used includes every process on the device, which is what a server's footprint looks like
    from outside; the harness runs one server at a time on the GPU, so the peak is that server's.
    """

    def __init__(self, interval_s: float = 0.1, device_indices: list[int] | None = None) -> None:
        self.interval_s = interval_s
        self.device_indices = device_indices
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = _open()

    @property
    def is_available(self) -> bool:
        return self._nvml is not None

    def _sample(self) -> None:
        assert self._nvml is not None
        indices = self.device_indices
        if indices is None:
            indices = list(range(self._nvml.device_count()))
        used = sum(self._nvml.used_bytes(i) for i in indices)
        self.peak_bytes = used if self.peak_bytes is None else max(self.peak_bytes, used)

    def _loop(self) -> None:
        while not self._stop.is_set():
            # A transient NVML error must not kill the benchmark; the next sample may work.
            with contextlib.suppress(Exception):
                self._sample()
            self._stop.wait(self.interval_s)

    def start(self) -> MemorySampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> float | None:
        """Stop sampling and return the peak in GiB (None without NVML)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        return self.peak_gib

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / GIB


def sample_used_gib_once() -> float | None:
    """Device memory used right now, summed over devices, in GiB (None without NVML)."""
    sampler = MemorySampler()
    if not sampler.is_available:
        return None
    try:
        sampler._sample()
    except Exception:
        return None
    return sampler.peak_gib


if __name__ == "__main__":
    print({"gpu": gpu_info(), "used_gib": sample_used_gib_once()})
