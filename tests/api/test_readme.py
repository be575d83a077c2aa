"""The README's server snippets work: `deltaserve serve` with no MODEL (the built-in tiny checkpoint, saying so,
bound to every interface as `vllm serve` is, and its ready line naming that address), then the README's own curl
and openai-client code, run as written (only the port is changed to a free one). The quick start is two commands a
new user can type: the first installs what the README's examples import, the second installs the test extra's
packages without reinstalling deltaserve and says how long the tests take; CI (.ci/run) runs them as written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def quick_start() -> list[str]:
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_quick_start_is_two_commands_ci_runs() -> None:
    serve, test = quick_start()
    assert "\n" not in serve and "\n" not in test
    assert serve.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install ")
    assert serve.endswith(" && deltaserve serve")
    install = serve.removeprefix("python3 -m venv .venv && . .venv/bin/activate && ").removesuffix(
        " && deltaserve serve"
    )
    assert "[test]" not in install and install.endswith("-e .")
    # The test command adds exactly the `test` extra's packages (no reinstall of deltaserve) and runs pytest.
    packages = test.split("pip install ", 1)[1].split(" && ", 1)[0].split()
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert sorted(packages) == sorted(extra) and "-e" not in test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci and install.replace("pip install ", "pip install -q ") in ci
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"the tests: about \d+ minutes on 2 CPU cores", " ".join(section.split())), section


def test_first_command_installs_what_the_examples_import() -> None:
    serve, _ = quick_start()
    installed = serve.split("pip install ", 1)[1].split(" && ", 1)[0].split()
    imported = {module for block in code_blocks("python")
                for module in re.findall(r"^(?:from|import) (\w+)", block, flags=re.M)}  # fmt: skip
    assert "openai" in imported and "deltaserve" in imported
    missing = [module for module in imported if module not in installed and not (module == "deltaserve" and
               "-e" in installed)]  # fmt: skip
    assert not missing, f"the README's examples import {missing}, which its first command does not install"


@pytest.fixture(scope="module")
def readme_server() -> Iterator[str]:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.cli", "serve", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    threading.Thread(target=lambda: LOG.extend(process.stderr), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert process.poll() is None, "deltaserve serve exited before it was healthy"
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "deltaserve serve did not become healthy"
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


LOG: list[str] = []


def test_quick_start_binds_every_interface_and_says_so(readme_server: str) -> None:
    port = readme_server.rsplit(":", 1)[1]
    line = f"on http://0.0.0.0:{port} "
    deadline = time.monotonic() + 10  # /health can answer just before the ready line is read from the log
    while not any("deltaserve ready" in entry and line in entry for entry in LOG):
        assert time.monotonic() < deadline, "".join(LOG)
        time.sleep(0.05)


def test_quick_start_serves_without_a_model(readme_server: str) -> None:
    with urllib.request.urlopen(readme_server + "/v1/models") as reply:
        body = reply.read().decode()
    assert '"id":"deltaserve-tiny"' in body.replace(" ", "")
    # The server says what it serves when it was given no model.
    assert "no MODEL given: serving the built-in tiny checkpoint" in "".join(LOG)


def test_readme_curl_works(readme_server: str) -> None:
    curl = next(block for block in code_blocks("bash") if block.startswith("curl"))
    if shutil.which("curl") is None:
        pytest.fail("curl is not installed, so the README's curl example cannot be checked")
    command = curl.replace("http://127.0.0.1:8000", readme_server).replace("\\\n", " ")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, check=True)
    assert '"object":"text_completion"' in result.stdout.replace(" ", "")


def test_readme_openai_client_works(readme_server: str) -> None:
    code = next(block for block in code_blocks("python") if "from openai import OpenAI" in block)
    code = code.replace("http://127.0.0.1:8000", readme_server)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
