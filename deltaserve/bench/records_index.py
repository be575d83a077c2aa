"""benchmarks/results/INDEX.md: one row per file under benchmarks/results/, generated (`deltaserve bench report`).

Records are filed by kind, one folder each (`KINDS`; `kind_of` says which folder a file name belongs in). A row
gives the file, what it measures (read from the record: its grid, command, shapes, variants, verdict...), the
date, project commit and GPU from the record's own provenance fields (`-` where it has none; a console log or a
raw archive takes them from the record it belongs to), and which files outside benchmarks/results/ cite it (by
file name, by a record's name without `.json`, or by a `*` / `{a,b}` pattern). Deterministic, so a test can tell
whether the committed index is current.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path
from typing import Any

from deltaserve.bench.grid_config import REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results"
DEFAULT_INDEX = RESULTS / "INDEX.md"
# kind folder -> (what it holds, the file-name patterns that belong there)
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "grids": (
        "serving grids (`deltaserve bench grid`): records, their console logs and raw archives",
        ("h200_*", "h100_*", "deltaserve-only*", "h200-*-deltaserve-only-*"),
    ),
    "kernels": (
        "kernel and step measurements (benchmarks/*.py, `deltaserve bench kernels`)",
        ("decode-step*", "mixed-step*", "conv-prefill*", "align-router*", "tune-moe*", "moe-table*", "kernels-*")
        + ("profile-decode*", "profile-prefill*", "dummy-routing*", "gdn-time*", "gdn-wu-diag*", "fp8-ab*")
        + ("vision-encode*", "attention-ab*", "startup-memory*", "gdn-prefill-ab*"),
    ),
    "gates": (
        "correctness: token gates, their vLLM reference runs, `pytest -m gpu` logs, training and conditioning, "
        "oracle probes",
        ("gate-*", "ref-vllm-*", "pytest-gpu-*", "conditioning-media*", "train-gpu-*", "flashinfer-probe*"),
    ),
    "logs": ("what each device session ran, call by call", ("h200-session*.txt", "h200-short*.txt")),
}
# Where citations are looked for (outside benchmarks/results/), and in which files.
CITING_ROOTS = ("README.md", "docs", "benchmarks", "deltaserve", "tests", "scripts")
CITING_SUFFIXES = (".md", ".py", ".toml", ".sh", ".json")
_TOKEN = re.compile(r"[\w.\-]+")
_PATTERN = re.compile(r"[\w.\-]*(?:\*|\{[\w.\-,]+\})[\w.\-*{},]*")


def kind_of(name: str) -> str | None:
    """The kind folder a result file's name belongs in, or None."""
    for kind, (_, patterns) in KINDS.items():
        if any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
            return kind
    return None


def result_files(root: Path = RESULTS) -> list[Path]:
    """Every file under `root` but the index itself and the git-ignored raw/ folder, in path order."""
    index = root / DEFAULT_INDEX.name
    return sorted(
        p for p in root.rglob("*") if p.is_file() and p != index and "raw" not in p.relative_to(root).parts[:1]
    )


def _load(path: Path) -> dict[str, Any] | None:
    if path.suffix != ".json":
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _flag(command: str, flag: str) -> str | None:
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    return words[words.index(flag) + 1] if flag in words[:-1] else None


def provenance(data: dict[str, Any]) -> tuple[str, str, str]:
    """(date, commit, GPU) from a record's own fields, `-` for each it lacks."""
    host = data.get("host") or {}
    nested = data.get("provenance") or {}
    date = host.get("date") or data.get("date") or nested.get("date")
    commit = (host.get("git") or {}).get("commit") or data.get("commit") or data.get("git_commit")
    commit = commit or nested.get("commit")
    gpus = host.get("gpus") if "gpus" in host else None
    gpu = ", ".join(gpus) if gpus else ("CPU" if gpus == [] else data.get("gpu") or nested.get("gpu"))
    source = str(data.get("source") or "")
    if not date and " on " in source:  # tune_moe's table: "tuned by ... on GPU, DATE, commit SHA; ..."
        match = re.search(r"on ([^,]+), (\d{4}-\d\d-\d\d)T[^,]*, commit (\w+)", source)
        if match:
            gpu, date, commit = match.group(1), match.group(2), match.group(3)
    return (str(date)[:10] if date else "-", str(commit)[:7] if commit else "-", str(gpu) if gpu else "-")


def _what_gate_mtp(data: dict[str, Any]) -> str:
    """The MTP gate's STRICT counts (against no MTP, against vLLM's MTP arm) and its yardsticks, from its verdict."""
    verdict = data.get("verdict") or {}
    n = verdict.get("num_prompts", 0)

    def strict(key: str) -> str:
        mismatches = verdict.get(key)
        return "-" if mismatches is None else f"{n - len(mismatches)}/{n}"

    text = (f"MTP gate: {Path(str(data.get('model'))).name} {data.get('dtype', '')}, k = {verdict.get('k')}; STRICT "
            f"{strict('off_mismatches')} against no MTP")  # fmt: skip
    if verdict.get("reference"):
        text += f", {strict('ref_mismatches')} against {verdict['reference']} with MTP"
    if verdict.get("vllm_mtp_vs_off") is not None:
        text += f"; yardsticks {strict('vllm_mtp_vs_off')} (vLLM with MTP vs without)"
        text += f", {strict('off_vs_vllm_off')} (no MTP vs vLLM without)"
    return text


def _what_json(data: dict[str, Any]) -> str:
    """What a record measures, from its own fields."""
    command = str(data.get("command") or (data.get("provenance") or {}).get("command") or "")
    kind = data.get("kind")
    if data.get("schema") == "deltaserve-grid-record/1":
        models = ", ".join(m["name"] for m in data.get("models", []))
        lengths = ", ".join(f"{i}/{o}" for i, o in data.get("lengths", []))
        dataset = (data.get("dataset") or {}).get("name", "random")
        concurrencies = ",".join(str(c) for c in data.get("concurrencies", []))
        arms = ", ".join(data.get("arms", {}))
        return f"grid `{data['grid']}`: {models}, {dataset} {lengths}, c{concurrencies}; arms {arms}"
    if kind == "decode_step":
        shapes = _flag(command, "--shapes") or ",".join(dict.fromkeys(r["shape"] for r in data.get("runs", [])))
        variants = _flag(command, "--variants") or ",".join(dict.fromkeys(r["variant"] for r in data.get("runs", [])))
        batches = _flag(command, "--batches") or "default"
        baseline = ", against a baseline tree" if "--baseline" in command else ""
        return f"decode step graph_ms (decode_step.py): {shapes}; variants {variants}; B {batches}{baseline}"
    if kind == "decode_step_separate_processes":
        return "decode step, one variant per process, alternating: " + str(data.get("why", ""))[:80]
    if kind == "mixed_step":
        shapes = _flag(command, "--shapes") or ",".join(data.get("shapes") or {})
        return f"mixed prefill+decode step (mixed_step.py): {shapes}; cases {_flag(command, '--cases') or 'default'}"
    if kind and str(kind).startswith("gate-tokens"):
        return _what_gate(data)
    if data.get("schema") == "deltaserve-gate-prefix-cache/1":
        model = Path(str(data.get("model"))).name
        dtype = (data.get("config") or {}).get("dtype", "")
        cached, prompt = data.get("cached_tokens", 0), data.get("prompt_tokens", 0) or 1
        stick = data.get("yardstick")
        yardstick = (f"; yardstick (no cache, chunked prefill) STRICT {stick.get('num_matched')}/"
                     f"{stick.get('num_checked')}" if isinstance(stick, dict) else "")  # fmt: skip
        return (f"prefix-cache gate (cache on vs off): {model} {dtype}, STRICT {data.get('num_matched')}/"
                f"{data.get('num_checked')}, {100 * cached / prompt:.1f} % of prompt tokens cached"
                f"{yardstick}")  # fmt: skip
    if kind == "gate-mtp":
        return _what_gate_mtp(data)
    if kind == "gate-fp8":
        verdict = next((line for line in data.get("output") or [] if str(line).startswith("STRICT")), "no STRICT line")
        model = Path(str(data.get("model") or "?")).name
        training = (data.get("checkpoint") or {}).get("training")
        trained = f" (trained on {training.get('device')})" if isinstance(training, dict) else ""
        return f"FP8 token gate: {model}{trained} as block FP8, {data.get('dtype', '')}, vs vLLM in process; {verdict}"
    if kind == "profile_prefill":
        lengths = ",".join(str(n) for n in data.get("prompt_lens", []))
        return (f"one prefill at a time in the engine, per op against the ceilings (profile_prefill.py): "
                f"{Path(str(data.get('model'))).name}, prompts {lengths}, {data.get('max_num_batched_tokens')} "
                "tokens a step")  # fmt: skip
    if kind == "kernel_bench":
        return f"kernel microbenchmarks (bench kernels): {_flag(command, '--models')}, {data.get('dtype')}"
    if kind == "fp8_ab":
        return _what_fp8_ab(data)
    if kind == "attention_ab":
        return _what_attention_ab(data)
    if kind == "align_router":
        return "MoE expert alignment and router launches alone (align_router_bench.py)"
    if kind == "conv-prefill-sweep":
        ab = "an earlier conv kernel against the current one" if "--baseline" in command else "tile sweep"
        return f"GDN prefill conv (conv_prefill_sweep.py): {ab}"
    if "batches" in data and "staggered" in data:
        tp = data.get("tensor_parallel_size")
        return f"decode steps in the engine (profile_decode.py): {Path(str(data.get('model'))).name}" + (
            f", TP={tp}" if tp else ""
        )
    if data.get("kernel") and data.get("buckets"):
        return f"tuned MoE launch table (tune_moe.py) for {data.get('file')}"
    if data.get("recipe"):
        recipe = data["recipe"]
        return f"tiny-model training on the GPU: {recipe.get('variant')}, {recipe.get('num_steps')} steps"
    return "-"


def _what_fp8_ab(data: dict[str, Any]) -> str:
    """benchmarks/fp8_ab.py: which models and ops, which arms ran and which were missing, the cases it timed."""
    results = data.get("results", [])
    models = ",".join(dict.fromkeys(str(r.get("model")) for r in results)) or "no case timed"
    ops = ",".join(dict.fromkeys(str(r.get("op")) for r in results))
    arms = data.get("arms", {})
    ran = ", ".join(name for name, arm in arms.items() if arm.get("available"))
    missing = ", ".join(data.get("missing", {})) or "none"
    cut = f"; {len(data['skipped'])} cut at the deadline" if data.get("skipped") else ""
    return f"block-FP8 GEMM / MoE vs libraries (fp8_ab.py): {models} {ops}; arms {ran}; missing {missing}{cut}"


def _what_attention_ab(data: dict[str, Any]) -> str:
    """benchmarks/attention_ab.py: which shapes, which arms ran and which were missing, what serves each range."""
    results = data.get("results", [])
    shapes = ",".join(dict.fromkeys(str(r.get("model")) for r in results)) or "no case timed"
    ran = ", ".join(name for name, arm in data.get("arms", {}).items() if arm.get("available"))
    missing = ", ".join(data.get("missing", {})) or "none"
    ranges = ", ".join(f"{v.get('range')} {v.get('serve')}" for v in data.get("ranges", [])) or "no range"
    cut = f"; {len(data['skipped'])} cut at the deadline" if data.get("skipped") else ""
    return f"paged attention prefill vs libraries (attention_ab.py): {shapes}; arms {ran}; missing {missing}; " \
        f"kernel per range {ranges}{cut}"  # fmt: skip


def _what_gate(data: dict[str, Any]) -> str:
    model = Path(str(data.get("model") or _flag(str(data.get("command") or ""), "--model") or "?")).name
    media = ", ".join(data.get("media") or []) or "text"
    output = data.get("output") or []
    verdict = next((line for line in output if isinstance(line, str) and line.startswith("STRICT")), None)
    if data.get("kind") == "gate-tokens-four-op-refusal":
        return f"four-op preamble refuses 3-D positions: {model}, {media}"
    reference = data.get("reference") or "transformers"
    verdict = f"; {verdict}" if verdict else ""
    return f"token gate: {model} {data.get('dtype', '')} vs {reference}, {media}{verdict}"


def _first_line(path: Path) -> str:
    for line in path.read_text(errors="replace").splitlines():
        text = line.strip().lstrip("#").strip()
        if text:
            return text if len(text) <= 110 else text[:107].rsplit(" ", 1)[0] + " ..."
    return "-"


def _what_log(path: Path) -> str:
    text = path.read_text(errors="replace")
    name = path.name
    if name.startswith("pytest-gpu-"):
        summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
        return "pytest -m gpu: " + (summary[-1].strip("= ") if summary else "no summary line (cut)")
    if name.startswith("ref-vllm-"):
        return "vLLM's run for the token gate, saved for --reference-cache"
    if name.startswith("tune-moe"):
        return "tune_moe.py console log"
    if name.startswith("startup-memory"):
        memory = next((line.split("memory: ", 1)[1] for line in text.splitlines() if "memory: " in line), "no line")
        return f"an engine's start-up memory log: {memory}"
    if name.startswith("flashinfer-probe"):
        verdict = next((line for line in text.splitlines() if line.startswith("flashinfer probe:")), "no verdict")
        return f"benchmarks/oracle/flashinfer_probe.py on the H200: {verdict}"
    if name.startswith("gate-"):
        verdict = next((line for line in text.splitlines() if line.startswith("STRICT")), "no STRICT line")
        return f"token gate console log: {verdict}"
    return "console log"


def describe(path: Path) -> tuple[str, str, str, str]:
    """(what, date, commit, GPU) of one result file."""
    data = _load(path)
    if data is not None:
        return (_what_json(data), *provenance(data))
    stem = path.name.removesuffix("-raw.tgz").removesuffix(".log")
    twin = _load(path.with_name(stem + ".json"))
    if path.name.endswith("-raw.tgz"):
        own = f"per-run client JSON and server logs of `{stem}.json`"
        return (own if twin is not None else "per-run client JSON and server logs", *provenance(twin or {}))
    if path.suffix == ".log" and twin is not None:
        return (f"console log of `{stem}.json`", *provenance(twin))
    if path.suffix == ".log":
        return (_what_log(path), "-", "-", "-")
    return (_first_line(path), "-", "-", "-")


def _citing_files(repo: Path) -> list[Path]:
    files = []
    for root in CITING_ROOTS:
        base = repo / root
        if base.is_file():
            files.append(base)
        elif base.is_dir():
            files += [p for p in base.rglob("*") if p.suffix in CITING_SUFFIXES and "__pycache__" not in p.parts]
    results = repo / "benchmarks" / "results"
    return sorted(p for p in files if p.is_file() and not p.is_relative_to(results))


def citations(names: list[str], repo: Path = REPO_ROOT) -> dict[str, list[str]]:
    """name -> the repository paths of the files that cite it. A name that says nothing by itself (`README.md`)
    is looked up by its path: pass `benchmarks/results/...`."""
    stems = {name.removesuffix(".json"): name for name in names if name.endswith(".json")}
    cited: dict[str, list[str]] = {name: [] for name in names}
    for path in _citing_files(repo):
        text = path.read_text(errors="replace")
        tokens = {token.rstrip(".") for token in _TOKEN.findall(text)}
        hits = {name for name in names if name in tokens or "/" in name and name in text}
        hits |= {stems[t] for t in tokens if t in stems}
        for pattern in {p.rstrip(".,") for p in _PATTERN.findall(text) if re.search(r"\d{8}", p)}:
            regex = re.compile(_glob_regex(pattern))
            hits |= {name for name in names if regex.fullmatch(name) or regex.fullmatch(name.removesuffix(".json"))}
        for name in hits:
            cited[name].append(path.relative_to(repo).as_posix())
    return cited


def _cited_as(path: Path, root: Path) -> str:
    """How a result file is looked for in the citing files: its name, or its repository path when the name is a
    folder's README."""
    return f"benchmarks/results/{path.relative_to(root).as_posix()}" if path.name == "README.md" else path.name


def _glob_regex(pattern: str) -> str:
    """`*` and `{a,b}` of a cited file-name pattern as a regular expression."""
    out, i = "", 0
    while i < len(pattern):
        char = pattern[i]
        if char == "{" and "}" in pattern[i:]:
            end = pattern.index("}", i)
            out += "(" + "|".join(re.escape(alt) for alt in pattern[i + 1 : end].split(",")) + ")"
            i = end + 1
            continue
        out += r"[\w.\-]*" if char == "*" else re.escape(char)
        i += 1
    return out


def render(root: Path = RESULTS, repo: Path = REPO_ROOT) -> str:
    """The index's Markdown."""
    files = result_files(root)
    cited = citations(sorted({_cited_as(p, root) for p in files}), repo)
    lines = [
        "# Benchmark records",
        "",
        "Generated by `deltaserve bench report` from the files under `benchmarks/results/`; do not edit by hand.",
        "A record is cited as `benchmarks/results/<kind>/<file name>`. Date, commit and GPU come from each record's",
        "own provenance fields (`-`: the file has none; a console log or raw archive takes them from its record).",
        "How records are made and read: `benchmarks/README.md`; the serving ratios: `docs/BENCHMARKS.md`.",
        "",
    ]
    by_kind: dict[str, list[Path]] = {}
    for path in files:
        by_kind.setdefault(path.relative_to(root).parts[0] if len(path.relative_to(root).parts) > 1 else "", []).append(
            path
        )
    for kind in [*KINDS, *sorted(k for k in by_kind if k not in KINDS)]:
        if kind not in by_kind:
            continue
        lines += [f"## {kind or 'unfiled'}", "", KINDS[kind][0] if kind in KINDS else "files outside a kind folder", ""]
        rows = []
        for path in by_kind[kind]:
            what, date, commit, gpu = describe(path)
            cell = ", ".join(cited[_cited_as(path, root)]) or "-"
            rows.append([f"`{path.relative_to(root).as_posix()}`", what, date, commit, gpu, cell])
        lines += ["| file | what it measures | date | commit | GPU | cited by |", "|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write(path: Path = DEFAULT_INDEX) -> None:
    path.write_text(render(path.parent))


def is_current(path: Path = DEFAULT_INDEX) -> bool:
    return path.exists() and path.read_text() == render(path.parent)
