"""The engine core in its own process: aborts reach it, its start-up errors come back as themselves, and its death
ends every open stream with an error and makes the server exit non-zero."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deltaserve.config import ConfigError
from deltaserve.engine.async_engine import AsyncEngine, EngineDeadError
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams
from tests.support.ports import free_port


def test_an_abort_reaches_the_core_process(tiny_dense: Path) -> None:
    async def scenario() -> tuple[int, object]:
        engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=512))
        assert engine.client.pid is not None and engine.client.pid != os.getpid()
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            num_outputs = 0
            async for _ in engine.generate([5, 6, 7], params, "long"):
                num_outputs += 1
                if num_outputs == 3:
                    break  # the consumer goes away: the request must be aborted in the core
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                stats = engine.stats()
                if stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_total_kv_blocks:
                    break
                await asyncio.sleep(0.05)
            return num_outputs, engine.stats()
        finally:
            await engine.stop()

    num_outputs, stats = asyncio.run(scenario())
    assert num_outputs == 3
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
    assert stats.num_free_state_slots == stats.num_total_state_slots


def test_a_start_up_error_comes_back_as_itself(tmp_path: Path, tiny_dense: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((tiny_dense / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="architectures"):
        AsyncEngine.from_config(EngineConfig(model=str(bad), device="cpu"))


def _core_pid(server_pid: int) -> int:
    """The engine-core child of the server process (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            return int(child)
    raise AssertionError(f"no engine-core child among {children}")


def test_killing_the_core_ends_every_stream_and_the_server_exits_non_zero(tiny_dense: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    server = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.cli", "serve", str(tiny_dense), "--device", "cpu", "--port", str(port),
         "--max-model-len", "4096", "--served-model-name", "tiny", "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise AssertionError("the server did not start")
        events: list[list[str]] = [[] for _ in range(4)]

        def stream(index: int) -> None:
            body = {"model": "tiny", "prompt": f"hello {index}", "max_tokens": 3000, "temperature": 0,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events[index].append(line[6:])

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while min(len(e) for e in events) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(len(e) for e in events) >= 3, "the streams did not start"
        os.kill(_core_pid(server.pid), signal.SIGKILL)
        for thread in threads:
            thread.join(30)
        for received in events:
            assert received[-1] == "[DONE]"
            error = json.loads(received[-2])
            assert "error" in error and error["error"]["code"] >= 500
            assert all("error" not in json.loads(e) for e in received[:-2])  # only the last event is the error
        assert server.wait(30) != 0
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)


def test_a_dead_core_refuses_new_requests(tiny_dense: Path) -> None:
    async def scenario() -> None:
        engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=256))
        died = threading.Event()
        engine.on_dead = died.set
        await engine.start()
        try:
            os.kill(engine.client.pid, signal.SIGKILL)
            assert await asyncio.to_thread(died.wait, 20)
            assert engine.is_dead
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate([1, 2], SamplingParams(max_tokens=2), "late"):
                    pass
        finally:
            await engine.stop()

    asyncio.run(scenario())
