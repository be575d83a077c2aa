"""`deltaserve check oracle-flags`: a static gate that every oracle server launch in the harness is honest.

It reads harness sources (shell, Python, TOML/YAML grid configs) without running them and discovers every
vLLM server launch: the binary spelled out (`vllm serve`, `/x/bin/vllm serve`), any expansion directly
followed by `serve` (`$VLLM serve`, `"$ORACLE" serve`, `${VLLM_BIN} serve`, `$(which vllm) serve`, a Python
variable or f-string field before "serve", a `{template}` field), `python -m vllm.entrypoints.cli.main serve`
and `python -m vllm.entrypoints.openai.api_server`, in shell commands (continuation lines included), Python
lists, tuples, list concatenations and strings, and TOML/YAML arrays and strings. `vllm bench serve` (any
spelling) is a client, not a launch. Grid-config arms built by the oracle registry (`oracle = "vllm"`) count
as launches too and are checked by their `drop_flags` / `extra_args`.

Each launch must carry the registry's REQUIRED_FLAGS and none of its FORBIDDEN_FLAGS, or be exempted by a
comment `oracle-exempt: <reason>` on the launch line or in the comment block right above it. Exit 0 when
every discovered launch passes, 1 naming file:line of each violation, 2 when no launch was found at all.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import sys
import tokenize
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deltaserve.bench.registry import FORBIDDEN_FLAGS, REQUIRED_FLAGS

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATHS = ("benchmarks", "deltaserve/bench", ".ci", "scripts")
SHELL_SUFFIXES = {".sh", ".bash"}
CONFIG_SUFFIXES = {".toml", ".yaml", ".yml"}
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "node_modules", ".ruff_cache", ".pytest_cache"}
EXEMPT_RE = re.compile(r"oracle-exempt:(.*)")
CLI_MODULE = "vllm.entrypoints.cli.main"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
EXPANSION = "$expr"  # stands for a non-literal value (a Python name, an f-string field)


@dataclass
class Word:
    """One word of a command as the gate sees it: text after quote removal, its line, whether it expands."""

    text: str
    line: int
    is_expansion: bool = False


@dataclass
class Launch:
    """One discovered oracle launch and its verdict."""

    path: str
    line: int
    spelling: str
    kind: str  # "text": spelled out in the source; "registry": a grid arm built by the oracle registry
    flags: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    exemption: str | None = None
    status: str = "ok"  # ok | exempt | violation


@dataclass
class Source:
    """A scanned file: its commands as word lists, and its comments by line."""

    units: list[list[Word]] = field(default_factory=list)
    comments: dict[int, str] = field(default_factory=dict)
    comment_only_lines: set[int] = field(default_factory=set)


# ---------------------------------------------------------------------------------------------------------
# Shell


def _read_balanced(text: str, i: int, open_ch: str, close_ch: str) -> int:
    """Index just past the `close_ch` matching the `open_ch` at text[i], skipping quoted parts."""
    depth = 0
    quote = ""
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == open_ch:
            depth += 1
        elif ch == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


HEREDOC_RE = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def scan_shell(text: str, source: Source, first_line: int = 1, depth: int = 0) -> None:
    """Split shell text into simple commands (units of words); record comments; recurse into `-c` strings."""
    words: list[Word] = []
    line = first_line
    i = 0
    n = len(text)
    pending_heredocs: list[tuple[str, bool]] = []  # (delimiter, is_python)
    current = ""
    current_line = line
    is_current_expansion = False
    has_quoted_space = False
    is_in_word = False
    has_code_on_line = False

    def end_word() -> None:
        nonlocal current, is_in_word, is_current_expansion, has_quoted_space
        if is_in_word:
            words.append(Word(current, current_line, is_current_expansion))
            if has_quoted_space and depth < 4:
                # A quoted argument holding a whole command (`bash -c "vllm serve ..."`): scan it as well.
                scan_shell(current, source, current_line, depth + 1)
        current = ""
        is_in_word = False
        is_current_expansion = False
        has_quoted_space = False

    def end_unit() -> None:
        nonlocal words
        end_word()
        if words:
            source.units.append(words)
            heredoc = HEREDOC_RE.search(" ".join(w.text for w in words))
            if heredoc and not pending_heredocs:
                is_python = any("python" in w.text for w in words)
                pending_heredocs.append((heredoc.group(2), is_python))
        words = []

    def start_word() -> None:
        nonlocal is_in_word, current_line
        if not is_in_word:
            is_in_word = True
            current_line = line

    while i < n:
        ch = text[i]
        if ch == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                line += 1
                i += 2
                continue
            start_word()
            current += text[i + 1]
            i += 2
            continue
        if ch == "\n":
            end_unit()
            if not has_code_on_line and line in source.comments:
                source.comment_only_lines.add(line)
            has_code_on_line = False
            line += 1
            i += 1
            if pending_heredocs:
                delimiter, is_python = pending_heredocs.pop()
                body_lines: list[str] = []
                body_start = line
                while i < n:
                    end = text.find("\n", i)
                    end = n if end < 0 else end
                    body_line = text[i:end]
                    i = end + 1
                    line += 1
                    if body_line.strip() == delimiter:
                        break
                    body_lines.append(body_line)
                body = "\n".join(body_lines)
                if is_python:
                    scan_python(body, source, body_start)
                else:
                    scan_shell(body, source, body_start, depth + 1)
            continue
        if ch in " \t\r":
            end_word()
            i += 1
            continue
        if ch == "#" and not is_in_word:
            end = text.find("\n", i)
            end = n if end < 0 else end
            source.comments[line] = text[i + 1 : end]
            i = end
            continue
        if ch in ";|&()":
            end_unit()
            i += 1
            continue
        has_code_on_line = True
        if ch == "'":
            start_word()
            end = text.find("'", i + 1)
            end = n if end < 0 else end
            chunk = text[i + 1 : end]
            current += chunk
            has_quoted_space = has_quoted_space or any(c.isspace() for c in chunk.strip())
            line += chunk.count("\n")
            i = end + 1
            continue
        if ch == '"':
            start_word()
            j = i + 1
            while j < n and text[j] != '"':
                if text[j] == "\\" and j + 1 < n:
                    current += text[j + 1] if text[j + 1] != "\n" else ""
                    j += 2
                    continue
                if text[j] == "$" and j + 1 < n and text[j + 1] == "(":
                    k = _read_balanced(text, j + 1, "(", ")")
                    if not current:
                        is_current_expansion = True
                    current += text[j:k]
                    j = k
                    continue
                if text[j] == "$" and not current:
                    is_current_expansion = True
                if text[j].isspace() and current.strip():
                    has_quoted_space = True
                current += text[j]
                j += 1
            line += text[i:j].count("\n")
            i = j + 1
            continue
        if ch == "$":
            start_word()
            if not current:
                is_current_expansion = True
            if i + 1 < n and text[i + 1] in "({":
                k = _read_balanced(text, i + 1, text[i + 1], ")" if text[i + 1] == "(" else "}")
                current += text[i:k]
                line += text[i:k].count("\n")
                i = k
                continue
        if ch == "`":
            start_word()
            if not current:
                is_current_expansion = True
            end = text.find("`", i + 1)
            end = n if end < 0 else end
            current += text[i : end + 1]
            i = end + 1
            continue
        start_word()
        current += ch
        i += 1
    end_unit()
    if not has_code_on_line and line in source.comments:
        source.comment_only_lines.add(line)


def _words_from_string(text: str, line: int) -> list[Word]:
    """Split one string value into shell words (quotes inside it respected), keeping its line."""
    inner = Source()
    scan_shell(text, inner, line)
    words = [w for unit in inner.units for w in unit]
    for w in words:
        if w.text.startswith("{") and w.text.endswith("}"):
            w.is_expansion = True
    return words


# ---------------------------------------------------------------------------------------------------------
# Python


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                ids.add(id(first.value))
    return ids


def _fstring_text(node: ast.JoinedStr) -> str:
    parts = []
    for value in node.values:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            parts.append(value.value)
        else:
            parts.append(" $expr ")
    return "".join(parts)


def _element_words(node: ast.expr, line_offset: int) -> list[Word]:
    line = node.lineno + line_offset - 1
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        words = _words_from_string(node.value, line)
        # A lone element is one argv word even if it is empty or all spaces.
        return words or [Word(node.value, line)]
    if isinstance(node, ast.JoinedStr):
        return _words_from_string(_fstring_text(node), line)
    return [Word(EXPANSION, line, is_expansion=True)]


def _list_operands(node: ast.expr) -> list[ast.expr] | None:
    """The list/tuple literals of `a + b + c` when every operand is one; else None."""
    if isinstance(node, ast.List | ast.Tuple):
        return [node]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _list_operands(node.left)
        right = _list_operands(node.right)
        if left is not None and right is not None:
            return left + right
        if left is not None:
            return left + [node.right]
    return None


def scan_python(text: str, source: Source, first_line: int = 1) -> None:
    """Units: each list/tuple literal (list concatenations joined) and each free-standing string."""
    offset = first_line
    try:
        tree = ast.parse(text)
    except SyntaxError:
        scan_shell(text, source, first_line)
        return
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                line = tok.start[0] + offset - 1
                source.comments[line] = tok.string[1:]
                if not tok.line[: tok.start[1]].strip():
                    source.comment_only_lines.add(line)
    except (tokenize.TokenError, IndentationError):
        pass
    docstrings = _docstring_ids(tree)
    consumed: set[int] = set()
    for node in ast.walk(tree):
        if id(node) in consumed:
            continue
        operands = _list_operands(node) if isinstance(node, ast.BinOp | ast.List | ast.Tuple) else None
        if operands is None:
            continue
        words: list[Word] = []
        for operand in operands:
            consumed.add(id(operand))
            elements = operand.elts if isinstance(operand, ast.List | ast.Tuple) else [operand]
            for element in elements:
                if isinstance(element, ast.Constant | ast.JoinedStr):
                    consumed.add(id(element))
                words += _element_words(element, offset)
        source.units.append(words)
    for node in ast.walk(tree):
        if id(node) in consumed or id(node) in docstrings:
            continue
        if isinstance(node, ast.JoinedStr):
            for value in node.values:
                consumed.add(id(value))
            source.units.append(_words_from_string(_fstring_text(node), node.lineno + offset - 1))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            source.units.append(_words_from_string(node.value, node.lineno + offset - 1))


# ---------------------------------------------------------------------------------------------------------
# TOML / YAML

STRING_RE = re.compile(r'"""(.*?)"""|\'\'\'(.*?)\'\'\'|"((?:[^"\\\n]|\\.)*)"|\'([^\'\n]*)\'', re.S)


def _strip_config_comment(line: str) -> tuple[str, str | None]:
    """(code, comment) of one config line; `#` inside quotes is not a comment."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == "\\" and quote == '"':
                continue
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t[,"):
            return line[:i], line[i + 1 :]
    return line, None


def scan_config(text: str, source: Source) -> None:
    """Units: one per statement; a bracketed array, a triple-quoted string, a YAML block sequence of scalars
    or a YAML block scalar spans lines as one statement. Triple-quoted and block-scalar text is scanned as
    shell (it usually holds a script)."""
    raw_lines = text.split("\n")
    code_lines: list[tuple[int, str]] = []
    for number, raw in enumerate(raw_lines, start=1):
        code, comment = _strip_config_comment(raw)
        if comment is not None:
            source.comments[number] = comment
            if not code.strip():
                source.comment_only_lines.add(number)
        code_lines.append((number, code))

    statements: list[list[tuple[int, str]]] = []
    block_scalars: list[tuple[int, int]] = []  # (first, last) content lines of YAML `key: |` blocks
    depth = 0
    is_in_triple = False
    block_indent: int | None = None
    is_sequence_owner = False
    for number, code in code_lines:
        stripped = code.strip()
        indent = len(code) - len(code.lstrip())
        item = stripped[2:].rstrip() if stripped.startswith("- ") else ""
        is_scalar_item = stripped == "-" or (bool(item) and ": " not in item and not item.endswith(":"))
        if depth > 0 or is_in_triple:
            is_continuation = True
        elif block_indent is not None and stripped and indent > block_indent:
            first, _ = block_scalars[-1]
            block_scalars[-1] = (first if first else number, number)
            continue
        else:
            is_continuation = is_sequence_owner and is_scalar_item
        if not stripped and not is_continuation:
            continue
        if is_continuation and statements:
            statements[-1].append((number, code))
        else:
            statements.append([(number, code)])
            block_indent = None
            is_sequence_owner = False
            if re.search(r":\s*[|>][-+0-9]*\s*$", code):
                block_indent = indent
                block_scalars.append((0, 0))
            elif re.search(r":\s*$", code):
                is_sequence_owner = True
        for quote in ('"""', "'''"):
            if code.count(quote) % 2 == 1:
                is_in_triple = not is_in_triple
        if not is_in_triple:
            without_strings = STRING_RE.sub("", code)
            depth = max(0, depth + without_strings.count("[") - without_strings.count("]"))

    for first, last in block_scalars:
        if first:
            scan_shell("\n".join(raw_lines[first - 1 : last]), source, first)
    for statement in statements:
        first_number = statement[0][0]
        body = ""
        last_number = first_number
        for number, code in statement:
            # Skipped blank lines become empty lines again, so offsets into `body` map back to file lines.
            body += "\n" * (number - last_number) + code
            last_number = number
        words: list[Word] = []
        position = 0
        for match in STRING_RE.finditer(body):
            line = first_number + body.count("\n", 0, match.start())
            words += _bare_words(body[position : match.start()], first_number + body.count("\n", 0, position))
            position = match.end()
            if match.group(1) is not None or match.group(2) is not None:
                content = match.group(1) if match.group(1) is not None else match.group(2)
                inner = Source()
                scan_shell(content, inner, line)
                source.units.extend(inner.units)
                continue
            content = match.group(3) if match.group(3) is not None else match.group(4)
            words += _words_from_string(content, line)
        words += _bare_words(body[position:], first_number + body.count("\n", 0, position))
        if words:
            source.units.append(words)


def _bare_words(text: str, line: int) -> list[Word]:
    """Unquoted tokens of a config statement (keys, `=`, brackets and commas dropped), with their lines."""
    words = []
    for offset, piece in enumerate(text.split("\n")):
        for token in re.split(r"[\s,\[\]=]+", piece):
            token = token.strip().rstrip(":")
            if token and token != "-":
                is_expansion = token.startswith("$") or (token.startswith("{") and token.endswith("}"))
                words.append(Word(token, line + offset, is_expansion))
    return words


# ---------------------------------------------------------------------------------------------------------
# Launch discovery and verdicts


def _is_vllm_binary(word: str) -> bool:
    return os.path.basename(word.strip("\"'")) == "vllm"


def find_launches(words: list[Word]) -> list[tuple[int, int, int]]:
    """(first word, anchor word, first flag) indices of each oracle launch in one unit.

    The anchor is the binary, expansion or module word that makes it a launch; its line is the one reported.
    """
    found = []
    for i, word in enumerate(words):
        if word.text == "serve" and i > 0:
            previous = words[i - 1]
            if previous.text in ("bench",):
                continue
            if _is_vllm_binary(previous.text) or previous.is_expansion or previous.text == CLI_MODULE:
                start = i - 1
                if previous.text == CLI_MODULE and i >= 2 and words[i - 2].text == "-m":
                    start = i - 3 if i >= 3 else i - 2  # include the interpreter
                found.append((start, i - 1, i + 1))
        elif word.text == API_SERVER_MODULE and i > 0 and words[i - 1].text == "-m":
            found.append((max(i - 2, 0), i, i + 1))
    return found


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


def judge(flags: list[str]) -> list[str]:
    """Problems of a launch's flag words against the registry's static rules."""
    problems = []
    for flag in REQUIRED_FLAGS:
        if not any(w == flag or w.startswith(flag + "=") for w in flags):
            problems.append(f"missing {flag}")
    for flag, why in FORBIDDEN_FLAGS.items():
        if any(w == flag or w.startswith(flag + "=") for w in flags):
            problems.append(f"{flag} ({why})")
    return problems


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
    launches = []
    for index, arm in enumerate(arms):
        if not isinstance(arm, dict) or "oracle" not in arm:
            continue
        line = arm_lines[index] if index < len(arm_lines) else 1
        drop = [str(f) for f in arm.get("drop_flags", [])]
        extra = [str(f) for f in arm.get("extra_args", [])]
        flags = [f for f in REQUIRED_FLAGS if f not in drop] + extra
        launch = Launch(str(path), line, f"registry:{arm['oracle']} ({arm.get('name', '?')})", "registry", flags)
        launch.problems = judge(flags)
        reason = None
        if drop:
            reason = str(arm.get("exemption", "")).strip()
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
    for words in source.units:
        for start, anchor, flags_start in find_launches(words):
            launch_words = words[start:flags_start]
            flags = [w.text for w in words[flags_start:]]
            spelling = " ".join(w.text for w in launch_words)
            launch = Launch(str(path), words[anchor].line, spelling, "text", flags, judge(flags))
            lines = sorted({words[0].line, *(w.line for w in launch_words)})
            launches.append(_verdict(launch, _exemption(source, lines)))
    if suffix == ".toml":
        launches += _registry_arms(path, text)
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
