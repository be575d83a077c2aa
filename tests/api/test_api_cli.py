"""`deltaserve serve`: vLLM's flags parse into EngineConfig and ServerSettings, and the real command serves."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from deltaserve import default_model
from deltaserve.api import cli
from deltaserve.api.compat import check_compat
from tests.support.ports import free_port


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deltaserve serve")
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults() -> None:
    args = parse("some/model")
    # max_num_seqs None: vLLM's default for the GPU, sized to the state memory by the runner
    assert (args.host, args.port, args.max_num_seqs, args.block_size, args.seed) == (None, 8000, None, 16, 0)
    assert args.async_scheduling is True and parse("m", "--no-async-scheduling").async_scheduling is False
    config = cli.build_engine_config(args, *cli.resolve_model(args))
    assert config.model == "some/model" and config.device == "auto" and config.generation_config == "auto"
    settings = cli.build_settings(args, "some/model")
    assert settings.served_model_names == ["some/model"] and settings.api_keys == []


def test_qwen35_recipe_command_line_parses() -> None:
    args = parse(
        "Qwen/Qwen3.5-27B-FP8", "--language-model-only", "--reasoning-parser", "qwen3", "--enable-prefix-caching",
        "--max-model-len", "32k", "--max-num-batched-tokens", "16384", "--tool-call-parser", "qwen3_coder",
        "--enable-auto-tool-choice", "--trust-remote-code", "--async-scheduling", "--mamba-ssm-cache-dtype",
        "bfloat16", "-tp", "1", "--gpu-memory-utilization", "0.85", "--served-model-name", "qwen", "q",
        "--api-key", "k", "--generation-config", "vllm", "--dtype", "bfloat16", "--enforce-eager",
        "--default-chat-template-kwargs", '{"enable_thinking": false}', "--uvicorn-log-level", "warning",
    )  # fmt: skip
    check_compat(args)
    config = cli.build_engine_config(args, *cli.resolve_model(args))
    assert (config.max_model_len, config.max_num_batched_tokens, config.gpu_memory_utilization) == (32000, 16384, 0.85)
    assert (config.dtype, config.enforce_eager, config.generation_config) == ("bfloat16", True, "vllm")
    settings = cli.build_settings(args, config.model)
    assert settings.served_model_names == ["qwen", "q"] and settings.model_root == "Qwen/Qwen3.5-27B-FP8"
    assert settings.default_chat_template_kwargs == {"enable_thinking": False}
    assert (settings.reasoning_parser, settings.tool_call_parser, settings.enable_auto_tool_choice) == (
        "qwen3",
        "qwen3_coder",
        True,
    )


def test_refusals_and_bad_values() -> None:
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2: .*tensor parallelism is the only"):
        check_compat(parse("m", "--pipeline-parallel-size", "2"))
    with pytest.raises(ValueError, match="tool-call-parser"):
        cli.build_settings(parse("m", "--enable-auto-tool-choice"), "m")
    for argv in (["--default-chat-template-kwargs", "[1]"], ["--tool-call-parser", "mistral"], ["--port", "x"]):
        with pytest.raises(SystemExit):
            parse("m", *argv)
    assert cli.run(parse("m", "-dp", "4")) == 2


def test_max_logprobs_minus_one_is_accepted_and_below_is_refused() -> None:
    """vLLM's ModelConfig.max_logprobs is ge=-1: -1 lifts the cap to the vocabulary, -2 is refused at startup."""
    assert cli.build_settings(parse("m", "--max-logprobs", "-1"), "m").max_logprobs == -1
    assert cli.build_settings(parse("m", "--max-logprobs", "0"), "m").max_logprobs == 0
    with pytest.raises(ValueError, match=r"--max-logprobs must be -1 \(no cap: the vocabulary\) or more, got -2"):
        cli.build_settings(parse("m", "--max-logprobs", "-2"), "m")


def test_bad_port_or_host_is_one_error_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("m", "--port", "70000")
    assert exit_info.value.code == 2
    assert "argument --port: must be a port number in 0-65535, got 70000" in capsys.readouterr().err
    missing = str(tmp_path / "no-model")  # the listen check comes first: nothing is read or loaded
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.run(parse(missing, "--port", str(port))) == 2
    errors = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert errors == [f"--host 0.0.0.0 --port {port}: cannot listen there: Address already in use"]  # every interface
    caplog.clear()
    # an address of no interface here (TEST-NET-1): the bind fails at once, with no name lookup
    assert cli.run(parse(missing, "--host", "192.0.2.1", "--port", "0")) == 2
    (error,) = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert error == "--host 192.0.2.1 --port 0: cannot listen there: Cannot assign requested address"


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1M", 2**20), ("auto", None), ("-1", None), ("1.5k", 1500),
     ("2t", 2 * 10**12), ("1T", 2**40)],
)  # fmt: skip
def test_human_int(text: str, value: int | None) -> None:
    """vLLM's human_readable_int_or_auto: lowercase suffixes decimal (fractions allowed), uppercase binary."""
    assert cli.human_int(text) == value


@pytest.mark.parametrize(("text", "error"), [("1.5K", "did you mean 1.5k"), ("4GiB", "not an integer"),
                                             ("32 k", "not an integer"), ("-5", "not a count")])  # fmt: skip
def test_human_int_refuses_what_vllm_refuses(text: str, error: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=error):
        cli.human_int(text)


def test_chat_template_file_or_inline(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert cli.read_chat_template(str(path)) == "{{ messages[0].content }}"
    assert cli.read_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    # vLLM's rule (its test_chat_template): any brace or newline makes the text the template itself
    assert cli.read_chat_template("{# note #}hello") == "{# note #}hello"
    assert cli.read_chat_template("hello\nworld") == "hello\nworld"
    for missing in (str(tmp_path / "missing.jinja"), "../../examples/does_not_exist", str(tmp_path)):
        with pytest.raises(ValueError, match="looks like a file path"):
            cli.read_chat_template(missing)


def test_no_model_serves_the_tiny_checkpoint_on_cpu() -> None:
    model, device = cli.resolve_model(parse())
    assert device == "cpu" and Path(model) == default_model.model_dir() and (Path(model) / "config.json").is_file()
    assert cli.default_served_names(parse(), model) == ["deltaserve-tiny", model]
    assert cli.resolve_model(parse("--device", "cuda")) == (model, "cuda")


def test_deltaserve_serve_command(tiny_dense: Path) -> None:
    """The real command: starts, logs the ready line, answers the openai client (with the key VLLM_API_KEY set),
    stops cleanly on SIGINT."""
    port = free_port()
    command = [
        sys.executable, "-m", "deltaserve.cli", "serve", str(tiny_dense), "--port", str(port), "--device", "cpu",
        "--max-model-len", "512", "--served-model-name", "tiny", "--reasoning-parser", "qwen3",
        "--tool-call-parser", "qwen3_xml", "--enable-auto-tool-choice", "--language-model-only",
        "--enable-prefix-caching", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_API_KEY": "sk-from-env"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    is_ready = threading.Event()

    def read_log() -> None:
        for line in process.stderr:
            lines.append(line)
            if "deltaserve ready" in line:
                is_ready.set()

    threading.Thread(target=read_log, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not is_ready.wait(0.2):
            assert process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "no ready line:\n" + "".join(lines)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-from-env", max_retries=0)
        assert client.models.list().data[0].id == "tiny"
        completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=3)
        assert completion.usage.completion_tokens == 3
    finally:
        process.send_signal(signal.SIGINT)
        exit_code = process.wait(timeout=30)
    assert exit_code == 0, "".join(lines)
