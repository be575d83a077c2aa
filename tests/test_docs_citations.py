"""Every document and record the served code cites is in this repository, and no citation of a place outside it
remains.

Scans every .py file under deltaserve/ for `docs/<path>[#anchor]` citations and `benchmarks/results/...` paths:
each cited file must exist (a results path may be a folder or a glob that matches something), and an anchor must
be the GitHub slug of one of the cited file's headings. It also refuses the citation forms the repository left
behind: section numbers of documents that live outside it ("doc §4", "architecture doc", their file names), the
retired kernel diary (KERNEL_NOTES), change numbers (C5 ... C31) and session numbers. One test per folder of the
package, so a run shows which folders are clean; each prints every offender it finds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "deltaserve"

# A docs/ path not inside another path (so vLLM's "vllm/docs/..." is not ours), ending in a word character (so a
# sentence's full stop is not part of it), with an optional #anchor.
DOC_CITATION = re.compile(r"(?<![\w./-])(docs/[\w./-]*\w)(?:#([\w-]+))?")
# benchmarks/results, optionally followed by a path that may hold a glob (*) or an f-string field ({stem}).
RESULTS_PATH = re.compile(r"(?<![\w./-])benchmarks/results(?:/[\w.*{}/-]*[\w*}])?")
FORBIDDEN: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"§\s*\d"), "a section number of a document outside the repository"),
    (re.compile(r"\b(?:architecture|multimodal|serving) doc\b", re.IGNORECASE), "a document outside the repository"),
    (
        re.compile(r"qwen35-architecture|serving-and-benchmarks|hybrid-prefix-cache-and-mtp|style-anchors|arch_spec"),
        "a file name of a document outside the repository",
    ),
    (re.compile(r"KERNEL_NOTES"), "the retired kernel diary (cite docs/kernels.md)"),
    # C5 ... C31 (and C12b) as words; not a quoted token such as the safetensors dtype "C64"
    (re.compile(r"(?<![\"'\w])C\d{1,2}[a-z]?(?![\"'\w])"), "a change number (they live in docs/kernels-log.md)"),
    (re.compile(r"\bsession \d+", re.IGNORECASE), "a session number"),
)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, characters other than letters, digits, spaces, '-' and '_'
    dropped, each space turned into '-'."""
    text = heading.strip().lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in " -_").replace(" ", "-")


def heading_anchors(markdown: str) -> set[str]:
    """The anchors of a Markdown file's headings (fenced code skipped; repeated headings get -1, -2, ...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    is_fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            is_fenced = not is_fenced
            continue
        match = None if is_fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match is None:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def line_offenders(line: str, repo: Path) -> list[str]:
    """Why this source line's citations do not resolve in `repo`, or which retired citation form it uses."""
    problems = []
    for match in DOC_CITATION.finditer(line):
        path, anchor = match.group(1), match.group(2)
        target = repo / path
        if not target.exists():
            problems.append(f"cites {path}, which is not in the repository")
        elif anchor is not None and anchor not in heading_anchors(target.read_text(encoding="utf-8")):
            problems.append(f"cites {path}#{anchor}, which is not a heading of {path}")
    for match in RESULTS_PATH.finditer(line):
        path = match.group(0)
        if "{" in path:
            continue  # an f-string template, not a record
        if "*" in path:
            if not any(repo.glob(path)):
                problems.append(f"cites {path}, which matches no record")
        elif not (repo / path).exists():
            problems.append(f"cites {path}, which is not in the repository")
    for pattern, what in FORBIDDEN:
        found = pattern.search(line)
        if found is not None:
            problems.append(f"{found.group(0)!r}: {what}")
    return problems


def folder_of(path: Path) -> str:
    """The package folder a file belongs to (its first component under deltaserve/), or "top" for the files
    directly in deltaserve/."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "top"


def package_folders() -> list[str]:
    return sorted({folder_of(path) for path in PACKAGE.rglob("*.py")})


def offenders_in(folder: str) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if folder_of(path) != folder:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for problem in line_offenders(line, REPO):
                found.append(f"{path.relative_to(REPO)}:{number}: {problem}")
    return found


@pytest.mark.parametrize("folder", package_folders())
def test_citations_resolve_in_the_repository(folder: str) -> None:
    found = offenders_in(folder)
    for offender in found:
        print(offender)
    assert not found, f"{len(found)} citation(s) under deltaserve/{folder} do not resolve:\n" + "\n".join(found)


def test_github_slug() -> None:
    assert github_slug("Stages and messages") == "stages-and-messages"
    assert github_slug("Tensor-parallel sharding") == "tensor-parallel-sharding"
    assert github_slug("Positions and MRoPE") == "positions-and-mrope"
    assert github_slug("C++ & Triton: why?") == "c--triton-why"
    assert github_slug("snake_case stays") == "snake_case-stays"


def test_heading_anchors_skip_code_and_number_repeats() -> None:
    text = "# Title\n## Part one\n```\n## not a heading\n```\n## Part one\n#### Deep `code` heading\n"
    assert heading_anchors(text) == {"title", "part-one", "part-one-1", "deep-code-heading"}


def test_the_checker_reports_each_form(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ARCHITECTURE.md").write_text("# Map\n## The step contract\n", encoding="utf-8")
    (tmp_path / "benchmarks" / "results" / "grids").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "grids" / "h200_a-27b.json").write_text("{}", encoding="utf-8")
    clean = [
        "# see docs/ARCHITECTURE.md#the-step-contract.",
        "# docs/ARCHITECTURE.md and benchmarks/results/grids/h200_a-27b.json and benchmarks/results/grids/h200_*.json",
        '    "U8": 1, "C64": 8,',
        "# vLLM's vllm/docs/design/metrics.md and f'benchmarks/results/{stem}.json'",
    ]
    for line in clean:
        assert line_offenders(line, tmp_path) == [], line
    bad = {
        "# see docs/ARCHITECTURE.md#the-step-contrac": "not a heading",
        "# see docs/kernels.md#attention": "not in the repository",
        "# benchmarks/results/h200_a-27b.json": "not in the repository",
        "# benchmarks/results/kernels/decode-*.json": "matches no record",
        "# (architecture doc §5.3)": "section number",
        "# (multimodal doc)": "outside the repository",
        "# docs/qwen35-architecture.md": "file name of a document",
        "# measured in KERNEL_NOTES": "kernel diary",
        "# the split kernel (C16) and C12b": "change number",
        "# faster since Session 14": "session number",
    }
    for line, why in bad.items():
        problems = line_offenders(line, tmp_path)
        assert any(why in problem for problem in problems), (line, problems)


def test_the_fixed_headings_are_there() -> None:
    """The anchors the code cites are fixed names; these two documents must keep every one of them."""
    architecture = heading_anchors((REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert {
        "stages-and-messages", "who-owns-which-state", "the-step-contract", "one-request-through-the-code",
        "model-facts", "configs-and-checkpoint-layout", "gated-full-attention", "norms-and-rounding-points",
        "positions-and-mrope", "gated-deltanet-and-its-state", "moe-routing", "the-mtp-head",
        "tensor-parallel-sharding", "sources",
    } <= architecture  # fmt: skip
    multimodal = heading_anchors((REPO / "docs" / "multimodal.md").read_text(encoding="utf-8"))
    assert {
        "image-preprocessing", "video-preprocessing", "placeholders-and-prompt-expansion", "the-vision-tower",
        "multimodal-positions", "sources",
    } <= multimodal  # fmt: skip
