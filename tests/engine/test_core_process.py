"""The engine core in its own process: aborts reach it, its start-up errors come back as themselves, and its death
ends every open request with an error and makes the server exit non-zero in bounded time, whatever the clients do."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from deltaserve.api.shutdown import DEAD_ENGINE_DRAIN_S
from deltaserve.config import ConfigError
from deltaserve.engine.async_engine import AsyncEngine, EngineDeadError
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams
from tests.support.serve_process import assert_streams_end_in_an_error, open_streams, start_serve, stuck_upload


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


def test_killing_the_core_ends_every_request_and_the_server_exits_non_zero_in_bounded_time(tiny_dense: Path) -> None:
    """Four streams and one plain request end with a 5xx, a stuck upload does not hold the server, which exits
    non-zero within the dead-engine drain bound; the log has one ERROR line (the death) and no traceback."""
    server = start_serve(tiny_dense)
    base = server.base_url
    try:
        statuses: list[int] = []

        def plain() -> None:
            body = {"model": "tiny", "prompt": "plain", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
            statuses.append(httpx.post(base + "/v1/completions", json=body, timeout=60).status_code)

        plain_thread = threading.Thread(target=plain, daemon=True)
        plain_thread.start()
        upload = stuck_upload(base)
        events, threads = open_streams(base, 4)
        threads.append(plain_thread)
        killed_at = time.monotonic()
        os.kill(server.core_pid(), signal.SIGKILL)
        for thread in threads:
            thread.join(30)
        assert_streams_end_in_an_error(events)
        assert statuses == [503]
        # the drain bound, then the lifespan's shutdown (the core is gone: nothing to wait for) and the exit
        assert server.process.wait(DEAD_ENGINE_DRAIN_S + 8) != 0
        assert time.monotonic() - killed_at < DEAD_ENGINE_DRAIN_S + 8
        upload.close()
        log = server.output()
        assert "Traceback" not in log, log
        errors = [line for line in log.splitlines() if " ERROR " in line or line.startswith("ERROR")]
        assert len(errors) == 1 and "the engine core process exited" in errors[0], log
        assert log.count("stream failed: the engine is dead") == 4, log
        assert log.count("POST /v1/completions failed: the engine is dead") == 1, log
        assert log.count("still open at the shutdown bound") == 1, log
    finally:
        server.close()


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
