"""The chat-template worker pool: an overrunning render is killed and its worker replaced, errors come back as
TemplateRenderError, and a worker dies with its server (no orphan keeps rendering)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deltaserve.api.template import RenderJob
from deltaserve.api.template_pool import TemplatePool, TemplateRenderError

ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
USER = [{"role": "user", "content": "hi"}]
ROOT = Path(__file__).resolve().parents[2]


def test_overrun_is_killed_and_the_worker_replaced() -> None:
    async def scenario() -> None:
        pool = TemplatePool(num_workers=1, timeout=0.5)
        await pool.start()
        try:
            with pytest.raises(TemplateRenderError, match="took longer than 0.5 s"):
                await pool.render(RenderJob(ENDLESS, USER))
            assert pool.num_killed == 1
            assert await pool.render(RenderJob("[{{ messages[0].content }}]", USER)) == "[hi]"
            with pytest.raises(TemplateRenderError, match="ZeroDivisionError"):
                await pool.render(RenderJob("{{ 1 // 0 }}", USER))
            results = await asyncio.gather(*(pool.render(RenderJob(f"{i}", USER)) for i in range(8)))
            assert results == [str(i) for i in range(8)]
        finally:
            await pool.stop()

    asyncio.run(scenario())


def test_slow_request_templates_leave_a_worker_for_the_servers_own() -> None:
    async def scenario() -> None:
        pool = TemplatePool(num_workers=2, timeout=0.6)
        await pool.start()
        try:
            slow = [asyncio.create_task(pool.render(RenderJob(ENDLESS, USER), is_request_template=True))
                    for _ in range(2)]  # fmt: skip
            await asyncio.sleep(0.05)  # both request templates are in: one renders, one waits for the request slot
            start = time.monotonic()
            assert await pool.render(RenderJob("[{{ messages[0].content }}]", USER)) == "[hi]"
            waited = time.monotonic() - start
            assert waited < 0.3, f"the server's own template waited {waited:.2f} s behind request templates"
            for task in slow:
                with pytest.raises(TemplateRenderError, match="took longer than 0.6 s"):
                    await task
        finally:
            await pool.stop()

    asyncio.run(scenario())


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_worker_dies_with_its_server(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    code = textwrap.dedent(f"""
        import asyncio
        from deltaserve.api.template import RenderJob
        from deltaserve.api.template_pool import TemplatePool

        async def main():
            pool = TemplatePool(num_workers=1, timeout=600)
            await pool.start()
            open({str(pids)!r}, "w").write(" ".join(str(w.process.pid) for w in pool._workers))
            await pool.render(RenderJob({ENDLESS!r}, [{{"role": "user", "content": "x"}}]))

        asyncio.run(main())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 60
    while not pids.exists() or not pids.read_text():
        assert time.monotonic() < deadline and server.poll() is None
        time.sleep(0.05)
    (worker,) = map(int, pids.read_text().split())
    time.sleep(0.5)  # the worker is rendering the endless template now
    server.kill()
    server.wait()
    deadline = time.monotonic() + 10
    while is_running(worker):
        assert time.monotonic() < deadline, "the worker outlived its server"
        time.sleep(0.05)


def test_a_worker_imports_no_torch() -> None:
    """A render worker's address space is capped (RLIMIT_AS): what it imports must stay small. Loading torch (through
    any module the worker's imports reach) takes the cap on its own, and every render fails as "needed more than"."""
    code = "import sys, deltaserve.api.template_pool; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
