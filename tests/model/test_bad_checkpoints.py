"""Issue 15's bad-checkpoint suite: `deltaserve serve BAD --port 0` as a subprocess, for each way a checkpoint folder
or a start-up setting can be broken, must exit 1 with exactly one ERROR line on stderr that names the file and the
field or tensor, and no traceback at the default log level (the traceback only with DELTASERVE_LOG_LEVEL=DEBUG or
--uvicorn-log-level debug).

All servers are started at once by a module fixture and reaped with a timeout (a case that wrongly starts serving
is killed and fails). A bad checkpoint found before the engine is built costs its process about a second (no torch
import); of the cases found only when the weights are read, one runs as that subprocess (the engine core's error
crosses its process boundary and the CLI makes it the one line) and the others run the same command in this
process (`deltaserve.api.cli.run` on the same parsed flags, the engine core on a thread), which reaches the same
loader error for a fraction of a second instead of two torch imports each.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

TIMEOUT_S = 180
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Case:
    id: str
    breaks: Callable[[Path], None]
    names: Callable[[Path], list[str]]  # substrings the one error line must contain (the file first)
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    is_debug: bool = False
    is_in_process: bool = False  # `deltaserve serve`'s run() here, not in a subprocess (see the module docstring)


def _weight_map(ckpt: Path) -> dict[str, str]:
    return json.loads((ckpt / INDEX).read_text())["weight_map"]


def _a_tensor(ckpt: Path, part: str) -> tuple[str, Path]:
    name = next(n for n in sorted(_weight_map(ckpt)) if part in n)
    return name, ckpt / _weight_map(ckpt)[name]


def _rewrite(ckpt: Path, part: str, change: Callable[[dict[str, torch.Tensor], str], None]) -> None:
    name, shard = _a_tensor(ckpt, part)
    tensors = load_file(shard)
    change(tensors, name)
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if n in tensors or s != shard.name}
    index["weight_map"].update(dict.fromkeys(tensors, shard.name))
    save_file(tensors, shard, metadata={"format": "pt"})
    (ckpt / INDEX).write_text(json.dumps(index))


def _edit_json(name: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def breaks(ckpt: Path) -> None:
        data = json.loads((ckpt / name).read_text())
        edit(data)
        (ckpt / name).write_text(json.dumps(data))

    return breaks


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt / name).write_text(text) and None


def _delete(*names: str) -> Callable[[Path], None]:
    return lambda ckpt: [(ckpt / n).unlink() for n in names] and None


def _second_shard(ckpt: Path) -> Path:
    return ckpt / sorted(set(_weight_map(ckpt).values()))[-1]


def _truncate(ckpt: Path) -> None:
    shard = _second_shard(ckpt)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _no_weights(ckpt: Path) -> None:
    for path in [ckpt / INDEX, *ckpt.glob("*.safetensors")]:
        path.unlink()


def _ghost_in_index(ckpt: Path) -> None:
    _edit_json(
        INDEX, lambda i: i["weight_map"].update({"model.language_model.ghost.weight": _second_shard(ckpt).name})
    )(ckpt)


def _poison(tensors: dict[str, torch.Tensor], name: str) -> None:
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[5] = float("nan")


K_PROJ = "layers.3.self_attn.k_proj.weight"
# the quantization_config of Qwen's -FP8 releases, on a checkpoint whose projections are bf16
GDN_IN_PROJ = "layers.0.linear_attn.in_proj_qkv.weight"
FP8_RELEASE = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CASES = [
    Case("config.json missing", _delete("config.json"), lambda c: [str(c / "config.json"), "no config.json"]),
    Case(
        "config.json not JSON",
        _write("config.json", '{"architectures": ['),
        lambda c: [str(c / "config.json"), "not valid JSON"],
    ),  # fmt: skip
    Case("config.json a list", _write("config.json", "[1, 2]"), lambda c: [str(c / "config.json"), "JSON object"]),
    Case(
        "config field refused",
        _edit_json("config.json", lambda d: d["text_config"].update(hidden_act="gelu")),
        lambda c: [str(c / "config.json"), "`text_config.hidden_act`", "'gelu'"],
    ),  # fmt: skip
    Case(
        "FP8 quantization_config on bf16 projections",
        _edit_json("config.json", lambda d: d.update(quantization_config=FP8_RELEASE)),
        lambda c: [str(_a_tensor(c, GDN_IN_PROJ)[1]), "in_proj_qkv", "stored unquantized", "FP8"],
    ),  # fmt: skip
    Case("index not JSON", _write(INDEX, '{"weight_map": {'), lambda c: [str(c / INDEX), "not valid JSON"]),
    Case("index without weight_map", _write(INDEX, '{"metadata": {}}'), lambda c: [str(c / INDEX), "`weight_map`"]),
    Case(
        "shard named by the index missing",
        lambda c: _second_shard(c).unlink(),
        lambda c: [str(c / INDEX), "model-00002-of-00002.safetensors", "not in"],
    ),  # fmt: skip
    Case("truncated shard", _truncate, lambda c: [str(c / "model-00002-of-00002.safetensors"), "truncated"]),
    Case(
        "shard that is not safetensors",
        lambda c: _second_shard(c).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!"),
        lambda c: [str(c / "model-00002-of-00002.safetensors"), "not a safetensors file"],
    ),
    Case(
        "index names a tensor its shard lacks",
        _ghost_in_index,
        lambda c: [str(c / "model-00002-of-00002.safetensors"), "`model.language_model.ghost.weight`"],
    ),  # fmt: skip
    Case(
        "int8 tensor without quantization_config",
        lambda c: _rewrite(c, K_PROJ, lambda t, n: t.update({n: t[n].to(torch.int8)})),
        lambda c: [str(_a_tensor(c, K_PROJ)[1]), f"`{_a_tensor(c, K_PROJ)[0]}`", "I8"],
    ),
    Case("no weights at all", _no_weights, lambda c: [str(c), "no *.safetensors"]),
    Case("no tokenizer files", _delete("tokenizer.json"), lambda c: [str(c), "no tokenizer files", "--tokenizer"]),
    Case(
        "tokenizer_config.json not JSON",
        _write("tokenizer_config.json", "{"),
        lambda c: [str(c / "tokenizer_config.json"), "not valid JSON"],
    ),  # fmt: skip
    Case(
        "generation_config.json not JSON",
        _write("generation_config.json", "{"),
        lambda c: [str(c / "generation_config.json"), "not valid JSON", "--generation-config vllm"],
    ),  # fmt: skip
    Case(
        "generation_config.json field of the wrong type",
        _edit_json("generation_config.json", lambda d: d.update(temperature="hot")),
        lambda c: [str(c / "generation_config.json"), "`temperature`"],
    ),
    Case(
        "--max-model-len above the model's",
        lambda c: None,
        lambda c: [str(c / "config.json"), "max_model_len (100000)", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"],
        args=("--max-model-len", "100000"),
    ),  # fmt: skip
    Case(
        "--tokenizer folder missing",
        lambda c: None,
        lambda c: ["--tokenizer", "/nonexistent/tok"],
        args=("--tokenizer", "/nonexistent/tok"),
    ),  # fmt: skip
    Case("model folder missing", lambda c: shutil.rmtree(c), lambda c: [str(c), "no such checkpoint folder"]),
    # found only when the weights are read (the engine is built): one real load each
    Case(
        "mis-shaped tensor",
        lambda c: _rewrite(c, K_PROJ, lambda t, n: t.update({n: torch.zeros(7, 64)})),
        lambda c: [str(_a_tensor(c, K_PROJ)[1]), f"`{_a_tensor(c, K_PROJ)[0]}`", "[7, 64]"],
        is_in_process=True,
    ),  # fmt: skip
    Case(
        "missing tensor",
        lambda c: _rewrite(c, "layers.2.linear_attn.in_proj_z", lambda t, n: t.pop(n)),
        lambda c: [str(c / INDEX), "`model.language_model.layers.2.linear_attn.in_proj_z.weight`", "missing"],
        is_in_process=True,
    ),
    Case(
        "NaN in a tensor fused into another parameter",
        lambda c: _rewrite(c, K_PROJ, _poison),
        lambda c: [str(_a_tensor(c, K_PROJ)[1]), f"`{_a_tensor(c, K_PROJ)[0]}`", "holds 1 NaN or inf values"],
        is_in_process=True,
    ),
    Case(
        "unexpected tensor",
        lambda c: _rewrite(
            c, K_PROJ, lambda t, n: t.update({"model.language_model.layers.0.mlp.extra_bias": torch.zeros(3)})
        ),
        lambda c: [
            str(_a_tensor(c, K_PROJ)[1]),
            "`model.language_model.layers.0.mlp.extra_bias`",
            "--ignore-unexpected-tensors",
        ],
    ),  # fmt: skip
    # the traceback appears when debugging, and only then
    Case(
        "traceback with DELTASERVE_LOG_LEVEL=DEBUG",
        _write(INDEX, "{"),
        lambda c: [str(c / INDEX)],
        env={"DELTASERVE_LOG_LEVEL": "DEBUG"},
        is_debug=True,
    ),  # fmt: skip
    Case(
        "traceback with --uvicorn-log-level debug",
        _write(INDEX, "{"),
        lambda c: [str(c / INDEX)],
        args=("--uvicorn-log-level", "debug"),
        is_debug=True,
    ),  # fmt: skip
]


def _broken_copy(root: Path, number: int, case: Case, tiny_dense: Path) -> tuple[Path, list[str]]:
    """The case's broken copy of the checkpoint and the substrings its error must name."""
    folder = root / f"case{number:02d}"
    shutil.copytree(tiny_dense, folder)
    expected = case.names(folder)  # before breaking: some cases name a tensor the break removes
    case.breaks(folder)
    return folder, expected


def _serve_argv(folder: Path, case: Case) -> list[str]:
    return [str(folder), "--port", "0", *case.args]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, tiny_dense: Path) -> dict[str, tuple[list[str], int, str]]:
    """case id -> (what the error must name, exit code, stderr) of each subprocess case, every server started at
    once."""
    root = tmp_path_factory.mktemp("bad")
    env = {k: v for k, v in os.environ.items() if k not in ("DELTASERVE_LOG_LEVEL", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    started = {}
    for number, case in enumerate(CASES):
        if case.is_in_process:
            continue
        folder, expected = _broken_copy(root, number, case, tiny_dense)
        command = [sys.executable, "-m", "deltaserve.cli", "serve", *_serve_argv(folder, case)]
        process = subprocess.Popen(
            command, env={**env, **case.env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        started[case.id] = (folder, expected, process)
    results = {}
    for case_id, (_, expected, process) in started.items():
        try:
            _, stderr = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            stderr += f"\n[still running after {TIMEOUT_S} s: killed]"
        results[case_id] = (expected, process.returncode, stderr)
    return results


def _serve_in_process(
    case: Case, folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> tuple[int, str]:
    """(exit code, the log as the subprocess's stderr would show it) of `deltaserve serve` run here."""
    from deltaserve.api import cli as serve_cli

    for name in ("DELTASERVE_LOG_LEVEL", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"DELTASERVE_ENABLE_MULTIPROCESSING": "0", **case.env}.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser(prog="deltaserve serve")
    serve_cli.add_arguments(parser)
    args = parser.parse_args(serve_cli.normalize_argv(_serve_argv(folder, case)))
    with caplog.at_level(logging.INFO):
        returncode = serve_cli.run(args)
    lines = []
    for record in caplog.records:
        lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        if record.exc_info:
            lines.append("".join(traceback.format_exception(*record.exc_info)))
    return returncode, "\n".join(lines)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_checkpoint_is_one_line_naming_the_file(
    case: Case,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    tiny_dense: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture,
) -> None:
    if case.is_in_process:
        folder, expected = _broken_copy(tmp_path, 0, case, tiny_dense)
        returncode, log = _serve_in_process(case, folder, monkeypatch, caplog)
        errors = [line for line in log.splitlines() if line.startswith("ERROR ")]
        # anything printed past the logging (a traceback) counts too
        stderr = log + "\n" + capfd.readouterr().err
    else:
        expected, returncode, stderr = request.getfixturevalue("outcomes")[case.id]
        errors = [line for line in stderr.splitlines() if " ERROR " in line]
    assert returncode == 1, stderr
    assert len(errors) == 1, stderr
    for part in expected:
        assert part in errors[0], f"{part!r} not in {errors[0]!r}"
    assert ("Traceback (most recent call last)" in stderr) == case.is_debug, stderr
