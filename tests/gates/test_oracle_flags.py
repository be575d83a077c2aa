"""The static oracle-flags gate: discovery under every spelling, clients ignored, exemptions, mutations."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from deltaserve.gates import oracle_flags
from deltaserve.gates.oracle_flags import check, default_paths, scan_file

REPO = Path(__file__).resolve().parents[2]
GOOD = "--language-model-only --max-num-batched-tokens 2048"

SHELL_SPELLINGS = [
    "vllm serve $M",
    "/opt/venv/bin/vllm serve $M",
    '"$ORACLE" serve "$M"',
    "${VLLM_BIN} serve $M",
    "$VLLM serve $M",
    "$(command -v vllm) serve $M",
    "python3 -m vllm.entrypoints.cli.main serve $M",
    "python -m vllm.entrypoints.openai.api_server --model $M",
    'bash -c "vllm serve $M',  # closed below, with the flags inside the quoted command
]


def write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def launches_in(path: Path) -> list[oracle_flags.Launch]:
    return scan_file(path)


@pytest.mark.parametrize("spelling", SHELL_SPELLINGS)
def test_every_shell_spelling_is_found_and_judged(tmp_path: Path, spelling: str) -> None:
    close = '"' if spelling.startswith("bash -c") else ""
    bad = write(tmp_path, "bad.sh", f"#!/bin/bash\nset -e\n{spelling} --port 8000{close} &\necho done\n")
    found = launches_in(bad)
    assert len(found) == 1 and found[0].status == "violation" and found[0].line == 3
    assert found[0].problems == ["missing --language-model-only"]
    good = write(tmp_path, "good.sh", f"{spelling} {GOOD}{close}\n")
    assert [launch.status for launch in launches_in(good)] == ["ok"]


def test_line_continuations_carry_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "run.sh",
        """
        export X=1
        $V serve "$model" --load-format dummy \\
          --max-model-len 4096 \\
          --language-model-only \\
          --port 8000 > log 2>&1 &
        $V serve "$model" --port 8001
        --language-model-only
        """,
    )
    found = launches_in(path)
    assert [(launch.line, launch.status) for launch in found] == [(2, "ok"), (6, "violation")]


@pytest.mark.parametrize(
    "client",
    [
        "vllm bench serve --model m --language-model-only-not-needed",
        "$V bench serve --backend vllm",
        '"$VLLM" bench serve',
        "python3 -m vllm.entrypoints.cli.main bench serve --dataset-name random",
        "deltaserve bench serve --port 8000",
        "python -m deltaserve.cli serve tiny --port 8000",
    ],
)
def test_clients_and_our_own_server_are_not_launches(tmp_path: Path, client: str) -> None:
    path = write(tmp_path, "client.sh", f"{client}\n# vllm serve in a comment is not a launch\n")
    assert launches_in(path) == []
    assert check([tmp_path])[0] == 2


def test_python_lists_strings_fstrings_and_concatenations(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "harness.py",
        '''
        """Docstrings that mention vllm serve are prose, not launches."""
        import subprocess, sys
        MODEL = "m"
        VLLM = "vllm"
        a = ["vllm", "serve", MODEL, "--language-model-only"]
        b = (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL)
        c = [VLLM, "serve", MODEL] + ["--port", "8000", "--language-model-only"]
        d = f"{VLLM} serve {MODEL} --enforce-eager --language-model-only"
        e = "vllm serve m --max-model-len 4096".split()
        # vllm serve in a comment
        f = ["vllm", "bench", "serve", "--model", MODEL]
        g = [
            "vllm",
            "serve",  # oracle-exempt: measures the vision tower on purpose
            MODEL,
        ]


        def launch() -> None:
            """vllm serve m, described."""
            subprocess.Popen(["vllm", "serve", MODEL, "--language-model-only"])
        ''',
    )
    found = {launch.line: launch for launch in launches_in(path)}
    assert sorted(found) == [5, 6, 7, 8, 9, 13, 21]
    assert found[5].status == "ok" and found[7].status == "ok" and found[21].status == "ok"
    assert found[6].status == "violation" and found[9].status == "violation"
    assert found[8].status == "violation" and "--enforce-eager" in found[8].problems[0]
    assert found[13].status == "exempt" and found[13].exemption == "measures the vision tower on purpose"


def test_toml_and_yaml_configs(tmp_path: Path) -> None:
    toml = write(
        tmp_path,
        "grid.toml",
        """
        [[arms]]
        name = "spelled"
        command = [
            "vllm", "serve", "{model}",
            "--language-model-only",  # the flag on a later line of the array counts
        ]

        [[arms]]
        name = "bare"
        command = ["{vllm}", "serve", "{model}", "--port", "{port}"]

        [[arms]]
        name = "one-string"
        script = "vllm serve m --enforce-eager --language-model-only"

        [[arms]]
        name = "registry-ok"
        oracle = "vllm"

        [[arms]]
        name = "registry-dropped"
        oracle = "vllm"
        drop_flags = ["--language-model-only"]

        [[arms]]
        name = "registry-exempt"
        oracle = "vllm"
        drop_flags = ["--language-model-only"]
        exemption = "shows what the flag changes"
        """,
    )
    found = {(launch.line, launch.kind): launch.status for launch in launches_in(toml)}
    assert found == {
        (4, "text"): "ok",
        (10, "text"): "violation",
        (14, "text"): "violation",
        (16, "registry"): "ok",
        (20, "registry"): "violation",
        (25, "registry"): "exempt",
    }
    yaml = write(
        tmp_path,
        "ci.yaml",
        """
        steps:
          - name: oracle
            command:
              - vllm
              - serve
              - model
              - --port
              - "8000"
          - name: client
            run: vllm bench serve --model m
          - name: script
            run: |
              # oracle-exempt: a smoke test of the bare server
              vllm serve m \\
                --port 8000
        """,
    )
    found = [(launch.line, launch.status) for launch in launches_in(yaml)]
    assert found == [(14, "exempt"), (4, "violation")]


def test_exemption_markers_need_a_reason(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "x.sh",
        """
        # oracle-exempt: text-only checkpoint, --language-model-only decides nothing
        # (a second comment line is still part of the block above the launch)
        vllm serve text-only --port 8000
        vllm serve m --port 8001  # oracle-exempt:
        vllm serve m --port 8002  # oracle-exempt: compares the unfused preamble

        vllm serve m --port 8003
        """,
    )
    found = [(launch.line, launch.status) for launch in launches_in(path)]
    assert found == [(3, "exempt"), (4, "violation"), (5, "exempt"), (7, "violation")]
    assert "without a reason" in launches_in(path)[1].problems[-1]


def test_heredoc_python_is_scanned(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "inline.sh",
        """
        python3 - <<'EOF'
        import subprocess
        subprocess.run(["vllm", "serve", "m"])
        EOF
        echo after
        """,
    )
    found = launches_in(path)
    assert [(launch.line, launch.status) for launch in found] == [(3, "violation")]


def test_empty_tree_exits_2_and_violations_name_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    assert check([tmp_path / "empty"])[0] == 2
    bad = write(tmp_path, "h/bad.sh", "echo start\nvllm serve m --enforce-eager\n")
    code = oracle_flags.run(oracle_flags.argparse.Namespace(paths=[tmp_path / "h"], json=False))
    out = capsys.readouterr().out
    assert code == 1 and f"{bad}:2: vllm serve:" in out and "--enforce-eager" in out
    code = oracle_flags.run(oracle_flags.argparse.Namespace(paths=[tmp_path / "h"], json=True))
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["exit_code"] == 1 and len(report["launches"]) == 1
    assert report["launches"][0]["status"] == "violation" and report["launches"][0]["line"] == 2


def test_the_repository_passes() -> None:
    code, launches, num_files = check(default_paths())
    assert code == 0, [(launch.path, launch.line, launch.problems) for launch in launches]
    assert launches and num_files > 0
    kinds = {(Path(launch.path).name, launch.kind, launch.status) for launch in launches}
    assert ("registry.py", "text", "ok") in kinds
    assert ("h200_first.toml", "registry", "exempt") in kinds


def test_removing_the_flag_from_the_registry_gives_exactly_one_violation(tmp_path: Path) -> None:
    source = (REPO / "deltaserve/bench/registry.py").read_text()
    needle = '        "--language-model-only",\n'
    assert source.count(needle) == 1
    mutant = write(tmp_path, "deltaserve/bench/registry.py", source.replace(needle, ""))
    code, launches, _ = check([tmp_path])
    violations = [launch for launch in launches if launch.status == "violation"]
    assert code == 1 and len(violations) == 1 and violations[0].path == str(mutant)
    assert violations[0].problems == ["missing --language-model-only"]


def test_removing_the_exemption_from_the_h200_grid_gives_exactly_one_violation(tmp_path: Path) -> None:
    shutil.copytree(REPO / "benchmarks", tmp_path / "benchmarks")
    grid = tmp_path / "benchmarks/grids/h200_first.toml"
    lines = grid.read_text().split("\n")
    kept = [line for line in lines if not line.startswith("exemption = ")]
    assert len(kept) == len(lines) - 1
    grid.write_text("\n".join(kept))
    # The registry is recognised by its path (its in-process construction is allowed there only).
    write(tmp_path, "deltaserve/bench/registry.py", (REPO / "deltaserve/bench/registry.py").read_text())
    code, launches, _ = check([tmp_path])
    violations = [launch for launch in launches if launch.status == "violation"]
    assert code == 1 and len(violations) == 1 and "vllm-no-lmo" in violations[0].spelling


def test_an_unparsable_grid_config_is_a_violation(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.toml", '[[arms]]\nname = "vllm"\noracle = "vllm"\noracle = "again"\n')
    (launch,) = launches_in(path)
    assert launch.status == "violation" and "cannot parse" in launch.problems[0]
