"""oracle-flags on in-process oracles and backend overrides: every spelling found, the registry's rules, mutations."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from deltaserve.gates.oracle_flags import check, scan_file

REPO = Path(__file__).resolve().parents[2]
REGISTRY = "deltaserve/bench/registry.py"

CONSTRUCTIONS = [
    ("import vllm", "llm = vllm.LLM(model='m')"),
    ("import vllm as v", "llm = v.LLM('m', language_model_only=True)"),
    ("from vllm import LLM", "llm = LLM(model='m')"),
    ("from vllm import LLM as Oracle", "llm = Oracle(model='m')"),
    ("from vllm import *", "llm = LLM(model='m')"),
    ("from vllm.entrypoints.llm import LLM", "llm = LLM(model='m')"),
    ("import vllm.entrypoints.llm as entry", "llm = entry.LLM(model='m')"),
    ("from vllm import AsyncLLMEngine, AsyncEngineArgs", "e = AsyncLLMEngine.from_engine_args(AsyncEngineArgs('m'))"),
    ("from vllm.engine.arg_utils import EngineArgs", "args = EngineArgs(model='m')"),
    ("from vllm.v1.engine.async_llm import AsyncLLM", "e = AsyncLLM.from_vllm_config(config)"),
    ("import importlib", "v = importlib.import_module('vllm')\nllm = v.LLM(model='m')"),
    ("import vllm", "make = getattr(vllm, 'LLM')\nllm = make(model='m')"),
    ("import functools, vllm", "make = functools.partial(vllm.LLM, model='m')"),
    ("import vllm", "Oracle = vllm.LLM\nllm = Oracle(model='m')"),
]


def write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def verdicts(path: Path) -> list[tuple[int, str, str]]:
    return [(launch.line, launch.kind, launch.status) for launch in scan_file(path)]


@pytest.mark.parametrize(("imports", "code"), CONSTRUCTIONS)
def test_every_in_process_spelling_bypassing_the_registry_is_a_violation(
    tmp_path: Path, imports: str, code: str
) -> None:
    path = write(tmp_path, "harness.py", f"{imports}\n\n{code}\n")
    found = [launch for launch in scan_file(path) if launch.kind == "in-process"]
    assert [launch.status for launch in found] == ["violation"], found
    assert "without the oracle registry" in found[0].problems[0]
    assert found[0].line == 2 + code.count("\n") + 1


def test_deltaserve_llm_and_unrelated_names_are_not_vllm(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "ours.py",
        """
        from deltaserve import LLM
        from deltaserve.bench import registry

        ours = LLM("m")
        oracle = registry.build_vllm_llm(registry.vllm_engine("m", 160, dtype="bfloat16"))
        EngineArgs = dict
        args = EngineArgs(model="m")
        """,
    )
    assert scan_file(path) == []
    assert check([tmp_path])[0] == 2


def test_setting_language_model_only_or_a_backend_outside_the_registry(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "override.py",
        """
        from deltaserve.bench import registry

        engine = registry.vllm_engine("m", 160)
        engine.kwargs["language_model_only"] = False
        engine.kwargs.update(language_model_only=False)
        kwargs = {**engine.kwargs, "gdn_prefill_backend": "triton"}
        setattr(engine, "language_model_only", False)
        # oracle-exempt: measures the unfused preamble on purpose
        engine.kwargs["language_model_only"] = False
        """,
    )
    assert verdicts(path) == [
        (4, "in-process", "violation"),
        (5, "in-process", "violation"),
        (6, "in-process", "violation"),
        (7, "in-process", "violation"),
        (9, "in-process", "exempt"),
    ]
    assert "a backend vLLM would choose itself" in scan_file(path)[2].problems[0]


def test_exemption_and_python_inside_shell(tmp_path: Path) -> None:
    py = write(
        tmp_path,
        "exempt.py",
        """
        import vllm

        # oracle-exempt: compares vLLM's eager path with its compiled one
        eager = vllm.LLM(model="m", enforce_eager=True)
        bare = vllm.LLM(model="m")  # oracle-exempt:
        """,
    )
    assert verdicts(py) == [(4, "in-process", "exempt"), (5, "in-process", "violation")]
    sh = write(
        tmp_path,
        "inline.sh",
        """
        python3 - <<'EOF'
        from vllm import LLM
        llm = LLM(model="m")
        EOF
        python3 -c "import vllm; vllm.LLM('m', language_model_only=False)"
        python3 -c "import vllm; print(vllm.__version__)"
        """,
    )
    found = [launch for launch in scan_file(sh) if launch.kind == "in-process"]
    assert [(launch.line, launch.status) for launch in found] == [(3, "violation"), (5, "violation")]
    assert any("sets language_model_only=False" in p for p in found[1].problems)


def test_the_registry_construction_is_the_only_allowed_one() -> None:
    found = [launch for launch in scan_file(REPO / REGISTRY) if launch.kind == "in-process"]
    assert [(launch.spelling, launch.status) for launch in found] == [("vllm.LLM", "ok")]
    gate = [launch for launch in scan_file(REPO / "deltaserve/gates/vllm_reference.py") if launch.kind != "text"]
    assert all(launch.status == "ok" for launch in gate)


def mutate_registry(tmp_path: Path, old: str, new: str) -> list:
    source = (REPO / REGISTRY).read_text()
    assert source.count(old) == 1, old
    write(tmp_path, REGISTRY, source.replace(old, new))
    code, launches, _ = check([tmp_path])
    assert code == 1
    return [launch for launch in launches if launch.status == "violation"]


def test_registry_mutation_dropping_language_model_only_is_caught(tmp_path: Path) -> None:
    (violation,) = mutate_registry(tmp_path, '"language_model_only": is_text_only,', "")
    assert "do not set language_model_only" in violation.problems[0]


def test_registry_mutation_hard_coding_language_model_only_is_caught(tmp_path: Path) -> None:
    (violation,) = mutate_registry(tmp_path, '"language_model_only": is_text_only,', '"language_model_only": False,')
    assert "constant False" in violation.problems[0]


def test_registry_mutation_passing_explicit_kwargs_is_caught(tmp_path: Path) -> None:
    (violation,) = mutate_registry(
        tmp_path, "return vllm.LLM(**engine.kwargs)", "return vllm.LLM(**engine.kwargs, language_model_only=False)"
    )
    assert any("only **kwargs" in p for p in violation.problems)
    assert any("sets language_model_only=False" in p for p in violation.problems)


def test_registry_mutation_blanking_a_deviation_reason_is_caught(tmp_path: Path) -> None:
    deviations = "deltaserve/bench/deviations.py"
    write(tmp_path, REGISTRY, (REPO / REGISTRY).read_text())
    source = (REPO / deviations).read_text()
    start = source.index('"gdn-prefill-triton": Deviation(')
    reason_start = source.index("reason=(", start)
    reason_end = source.index("),\n", reason_start) + 3
    mutant = source[:reason_start] + 'reason="",\n' + source[reason_end:]
    write(tmp_path, deviations, mutant)
    code, launches, _ = check([tmp_path])
    violations = [launch for launch in launches if launch.status == "violation"]
    assert code == 1 and len(violations) == 1 and "without its reason" in violations[0].problems[0]


def test_harness_mutation_in_process_bypass_gives_exactly_one_violation(tmp_path: Path) -> None:
    """The repository's harness tree passes; one added in-process construction in it is exactly one violation."""
    for folder in ("benchmarks", "deltaserve/bench", "deltaserve/gates", "scripts"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    assert check([tmp_path])[0] == 0
    gate = tmp_path / "deltaserve/gates/vllm_reference.py"
    text = gate.read_text()
    needle = "        llm = registry.build_vllm_llm(engine)\n"
    assert text.count(needle) == 1
    gate.write_text(text.replace(needle, "        import vllm\n\n        llm = vllm.LLM(**engine.kwargs)\n"))
    code, launches, _ = check([tmp_path])
    violations = [launch for launch in launches if launch.status == "violation"]
    assert code == 1 and len(violations) == 1 and violations[0].path == str(gate)


# ---- backend overrides (issue 17) ------------------------------------------------------------------------


def test_backend_flags_and_variables_on_a_launch_need_an_exemption(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "backend.sh",
        """
        vllm serve m --language-model-only --gdn-prefill-backend triton
        vllm serve m --language-model-only --attention-backend=FLASHINFER
        VLLM_USE_FLASHINFER_SAMPLER=0 vllm serve m --language-model-only
        # oracle-exempt: FlashInfer is not in the offline bundle
        vllm serve m --language-model-only --gdn-prefill-backend triton
        vllm serve m --language-model-only --port 8000
        """,
    )
    found = scan_file(path)
    assert [(launch.line, launch.status) for launch in found] == [
        (1, "violation"),
        (2, "violation"),
        (3, "violation"),
        (5, "exempt"),
        (6, "ok"),
    ]
    assert "overrides a backend" in found[0].problems[0] and "triton" in found[0].problems[0]
    exported = write(
        tmp_path, "exported.sh", "export VLLM_USE_FLASHINFER_SAMPLER=0\nvllm serve m --language-model-only\n"
    )
    (launch,) = scan_file(exported)
    assert launch.status == "violation" and "VLLM_USE_FLASHINFER_SAMPLER=0" in launch.problems[0]


def test_registry_grid_arm_with_a_backend_override_needs_its_exemption(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "grid.toml",
        """
        [[arms]]
        name = "forced"
        oracle = "vllm"
        extra_args = ["--moe-backend", "triton"]

        [[arms]]
        name = "forced-with-reason"
        oracle = "vllm"
        extra_args = ["--moe-backend", "triton"]
        exemption = "measures the Triton MoE against vLLM's own choice"

        [[arms]]
        name = "env"
        oracle = "vllm"
        env = { VLLM_USE_FLASHINFER_SAMPLER = "0" }
        """,
    )
    assert [(launch.line, launch.status) for launch in scan_file(path)] == [
        (1, "violation"),
        (6, "exempt"),
        (12, "violation"),
    ]


def test_harness_mutation_backend_override_in_the_h200_grid_gives_exactly_one_violation(tmp_path: Path) -> None:
    shutil.copytree(REPO / "benchmarks", tmp_path / "benchmarks")
    write(tmp_path, REGISTRY, (REPO / REGISTRY).read_text())
    grid = tmp_path / "benchmarks/grids/h200_first.toml"
    text = grid.read_text()
    needle = 'extra_args = ["--max-model-len", "4096", "--gpu-memory-utilization", "0.85"]\nstartup_timeout_s = 480\n'
    first = text.index(needle)
    mutated = (
        text[:first]
        + needle.replace('"0.85"]', '"0.85", "--gdn-prefill-backend", "triton"]')
        + text[first + len(needle) :]
    )
    grid.write_text(mutated)
    code, launches, _ = check([tmp_path])
    violations = [launch for launch in launches if launch.status == "violation"]
    assert code == 1 and len(violations) == 1
    assert "(vllm)" in violations[0].spelling and "--gdn-prefill-backend triton" in violations[0].problems[0]
