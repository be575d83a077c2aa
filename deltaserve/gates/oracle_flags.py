"""`deltaserve check oracle-flags`: a static gate that every oracle server launch in the harness is honest.

It reads harness sources (shell, Python, TOML/YAML grid configs) without running them and discovers every
vLLM server launch: the binary spelled out (`vllm serve`, `/x/bin/vllm serve`), any expansion directly
followed by `serve` (`$VLLM serve`, `"$ORACLE" serve`, `${VLLM_BIN} serve`, `$(which vllm) serve`, a Python
variable or f-string field before "serve", a `{template}` field), `python -m vllm.entrypoints.cli.main serve`
and `python -m vllm.entrypoints.openai.api_server`, in shell commands (continuation lines included), Python
lists, tuples, list concatenations and strings, and TOML/YAML arrays and strings. `vllm bench serve` (any
spelling) is a client, not a launch. Grid-config arms built by the oracle registry (`oracle = "vllm"`) count
as launches too and are checked by their `drop_flags` / `extra_args`, and by prefix caching against their grid's
data: a grid whose prompts share prefixes (`[dataset] name = "prefix_repetition"` or `"multi-turn"`) may leave it
at vLLM's choice or turn it on (`enable_prefix_caching = true`, optionally `prefix_match_unit`), never off; any
other grid's arms keep the registry's --no-enable-prefix-caching.

Each launch must carry the registry's REQUIRED_FLAGS, none of its FORBIDDEN_FLAGS and no BACKEND_FLAGS (a
backend flag, or a BACKEND_ENV variable set for the launch or exported in its file, overrides a choice vLLM's
production defaults would make), or be exempted by a comment `oracle-exempt: <reason>` on the launch line or in
the comment block right above it (a registry grid arm by its `exemption` key). The registry's own site
deviations are named `Deviation`s with a reason, checked in registry.py itself.

In-process constructions of vLLM (`vllm.LLM(...)`, `AsyncLLMEngine`, `EngineArgs(...)`, ... in .py files,
shell heredocs and `python -c` strings; oracle_inprocess.py) are launches too: outside the registry each one
is a violation (it bypasses the registry), and so is setting `language_model_only` or a backend keyword there.

Exit 0 when every discovered launch passes, 1 naming file:line of each violation, 2 when no launch was found.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path

from deltaserve.bench.deviations import BACKEND_ENV, BACKEND_FLAGS
from deltaserve.bench.registry_rules import FORBIDDEN_FLAGS, REQUIRED_FLAGS
from deltaserve.gates.oracle_inprocess import find_inprocess
from deltaserve.gates.oracle_scan import (
    CONFIG_SUFFIXES,
    EXEMPT_RE,
    SHELL_SUFFIXES,
    SKIP_DIRS,
    Launch,
    Source,
    find_launches,
    scan_config,
    scan_python,
    scan_shell,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATHS = ("benchmarks", "deltaserve/bench", "deltaserve/gates", ".ci", "scripts")


def _exemption(source: Source, lines: list[int]) -> str | None:
    """The `oracle-exempt:` reason on any of `lines` or in the comment block right above the first."""
    candidates = list(lines)
    above = min(lines) - 1
    while above in source.comment_only_lines:
        candidates.append(above)
        above -= 1
    for line in candidates:
        match = EXEMPT_RE.search(source.comments.get(line, ""))
        if match:
            return match.group(1).strip()
    return None


def judge(flags: list[str], env: dict[str, str] | None = None) -> list[str]:
    """Problems of a launch's flag words (and the backend variables set for it) against the registry's rules."""
    problems = []
    for flag in REQUIRED_FLAGS:
        if not any(w == flag or w.startswith(flag + "=") for w in flags):
            problems.append(f"missing {flag}")
    for flag, why in FORBIDDEN_FLAGS.items():
        if any(w == flag or w.startswith(flag + "=") for w in flags):
            problems.append(f"{flag} ({why})")
    for i, word in enumerate(flags):
        flag = word.split("=", 1)[0]
        if flag in BACKEND_FLAGS:
            value = word.split("=", 1)[1] if "=" in word else (flags[i + 1] if i + 1 < len(flags) else "")
            problems.append(f"{flag} {value} overrides a backend vLLM's production defaults would pick")
    for name, value in (env or {}).items():
        if name in BACKEND_ENV:
            problems.append(f"{name}={value} overrides a backend vLLM's production defaults would pick")
    return problems


def _assignments(words: list) -> dict[str, str]:
    """NAME=VALUE words (`export X=1`, or a command's `X=1 cmd` prefix)."""
    found = {}
    for word in words:
        name, sep, value = word.text.partition("=")
        if sep and name.isidentifier() and not name.startswith("-"):
            found[name] = value
    return found


def _file_exports(units: list[list]) -> dict[str, str]:
    """Variables a shell file sets for everything after it (`export X=1`, or a bare `X=1` statement)."""
    exported: dict[str, str] = {}
    for words in units:
        if words and words[0].text == "export":
            exported.update(_assignments(words[1:]))
        elif words and all("=" in w.text and w.text.split("=", 1)[0].isidentifier() for w in words):
            exported.update(_assignments(words))
    return exported


def _verdict(launch: Launch, reason: str | None) -> Launch:
    if reason is not None:
        if reason:
            launch.exemption = reason
            launch.status = "exempt"
        else:
            launch.problems.append("oracle-exempt marker without a reason")
            launch.status = "violation"
    elif launch.problems:
        launch.status = "violation"
    return launch


def _prefix_caching_problems(arm: dict, extra: list[str], shares_prefixes: bool) -> list[str]:
    """A registry arm's prefix caching against its grid's data (the registry refuses the same at launch)."""
    last = [f for f in extra if f in ("--enable-prefix-caching", "--no-enable-prefix-caching")]
    is_on = (
        bool(arm.get("enable_prefix_caching")) or "prefix_match_unit" in arm or last[-1:] == ["--enable-prefix-caching"]
    )
    if shares_prefixes and last[-1:] == ["--no-enable-prefix-caching"]:
        return ["--no-enable-prefix-caching: prompts that share prefixes leave prefix caching at vLLM's choice or on"]
    if not shares_prefixes and is_on:
        return ["prefix caching on for data that shares no prefix: the registry keeps --no-enable-prefix-caching"]
    return []


def _registry_arms(path: Path, text: str) -> list[Launch]:
    """Grid arms whose command the registry builds: check their drop_flags / extra_args statically."""
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # A grid file that does not parse hides its arms from the gate; that is a failure, not a pass.
        launch = Launch(str(path), 1, "unparsable TOML", "registry", problems=[f"cannot parse: {exc}"])
        launch.status = "violation"
        return [launch]
    arms = config.get("arms")
    if not isinstance(arms, list):
        return []
    arm_lines = [i for i, raw in enumerate(text.split("\n"), start=1) if raw.strip() == "[[arms]]"]
    dataset = config.get("dataset")
    shares_prefixes = isinstance(dataset, dict) and dataset.get("name") in ("prefix_repetition", "multi-turn")
    launches = []
    for index, arm in enumerate(arms):
        if not isinstance(arm, dict) or "oracle" not in arm:
            continue
        line = arm_lines[index] if index < len(arm_lines) else 1
        drop = [str(f) for f in arm.get("drop_flags", [])]
        extra = [str(f) for f in arm.get("extra_args", [])]
        env = {str(k): str(v) for k, v in (arm.get("env") or {}).items()}
        flags = [f for f in REQUIRED_FLAGS if f not in drop] + extra
        launch = Launch(str(path), line, f"registry:{arm['oracle']} ({arm.get('name', '?')})", "registry", flags)
        launch.problems = judge(flags, env) + _prefix_caching_problems(arm, extra, shares_prefixes)
        # A dropped flag or a backend override is allowed with the arm's `exemption` reason.
        reason = None
        if launch.problems and "exemption" in arm:
            reason = str(arm["exemption"]).strip()
        launches.append(_verdict(launch, reason))
    return launches


def scan_file(path: Path) -> list[Launch]:
    """Every oracle launch in one file, judged."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    source = Source()
    suffix = path.suffix
    if suffix == ".py":
        scan_python(text, source)
    elif suffix in CONFIG_SUFFIXES:
        scan_config(text, source)
    else:
        scan_shell(text, source)
    launches = []
    exported = _file_exports(source.units) if suffix not in CONFIG_SUFFIXES and suffix != ".py" else {}
    for words in source.units:
        for start, anchor, flags_start in find_launches(words):
            launch_words = words[start:flags_start]
            flags = [w.text for w in words[flags_start:]]
            env = {**exported, **_assignments(words[:start])}
            spelling = " ".join(w.text for w in launch_words)
            launch = Launch(str(path), words[anchor].line, spelling, "text", flags, judge(flags, env))
            lines = sorted({words[0].line, *(w.line for w in launch_words)})
            launches.append(_verdict(launch, _exemption(source, lines)))
    if suffix == ".toml":
        launches += _registry_arms(path, text)
    snippets = [(text, 1, True)] if suffix == ".py" else []
    snippets += [(code, first_line, False) for code, first_line in source.python_snippets]
    for code, first_line, is_whole_file in snippets:
        for launch in find_inprocess(code, str(path), first_line, is_whole_file):
            if launch.status == "violation" and suffix != ".py":
                # Python inside a shell or config file may carry its exemption in the host file's comments.
                reason = _exemption(source, [launch.line])
                if reason:
                    launch.status, launch.exemption = "exempt", reason
            launches.append(launch)
    return launches


def _is_harness_file(path: Path) -> bool:
    if path.suffix in SHELL_SUFFIXES | CONFIG_SUFFIXES | {".py"}:
        return True
    if path.suffix:
        return False
    try:
        with path.open("rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return head.startswith(b"#!") and (b"sh" in head.split(b"\n")[0])


def harness_files(paths: list[Path]) -> list[Path]:
    """Harness sources under `paths` (files taken as given; folders walked, hidden and cache folders skipped)."""
    files: list[Path] = []
    for root in paths:
        if root.is_file():
            files.append(root)
            continue
        if not root.is_dir():
            continue
        for folder, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
            for name in sorted(filenames):
                candidate = Path(folder) / name
                if _is_harness_file(candidate):
                    files.append(candidate)
    return files


def check(paths: list[Path]) -> tuple[int, list[Launch], int]:
    """(exit code, every launch, number of files scanned)."""
    files = harness_files(paths)
    launches = [launch for path in files for launch in scan_file(path)]
    if not launches:
        return 2, launches, len(files)
    is_violated = any(launch.status == "violation" for launch in launches)
    return (1 if is_violated else 0), launches, len(files)


def default_paths(repo_root: Path = REPO_ROOT) -> list[Path]:
    return [repo_root / p for p in DEFAULT_PATHS if (repo_root / p).exists()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", type=Path, help=f"default: {', '.join(DEFAULT_PATHS)} of the repo")
    parser.add_argument("--json", action="store_true", help="list every discovered launch and its status")


def run(args: argparse.Namespace) -> int:
    paths = list(args.paths) or default_paths()
    code, launches, num_files = check(paths)
    if args.json:
        report = {"exit_code": code, "num_files": num_files, "launches": [asdict(launch) for launch in launches]}
        print(json.dumps(report, indent=2))
        return code
    for launch in launches:
        if launch.status == "violation":
            print(f"{launch.path}:{launch.line}: {launch.spelling}: {'; '.join(launch.problems)}")
    num_exempt = sum(1 for launch in launches if launch.status == "exempt")
    num_violations = sum(1 for launch in launches if launch.status == "violation")
    print(
        f"oracle-flags: {len(launches)} launches in {num_files} files: "
        f"{len(launches) - num_exempt - num_violations} ok, {num_exempt} exempt, {num_violations} violations"
        + ("" if launches else " (nothing to check)")
    )
    return code


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(prog="deltaserve check oracle-flags", description=__doc__)
    add_arguments(main_parser)
    sys.exit(run(main_parser.parse_args()))
