"""Discovery of vLLM server launches in harness sources, for `deltaserve check oracle-flags`.

Shell (continuation lines, heredocs, command substitutions), Python (lists, tuples, concatenations, strings,
f-strings) and TOML/YAML configs are read as text, never run, and reduced to word lists; `find_launches`
spots `vllm serve` under any spelling (an expansion directly followed by `serve` included) while `vllm bench
serve` stays a client. The verdicts against the registry live in oracle_flags.py.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from dataclasses import dataclass, field

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
    # Python code embedded in the file (shell heredocs, `python -c CODE`), with its first line, for the
    # in-process checks (oracle_inprocess.py).
    python_snippets: list[tuple[str, int]] = field(default_factory=list)


def _is_python_word(text: str) -> bool:
    return os.path.basename(text.strip("\"'")).startswith("python") or text == EXPANSION


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
            for i in range(1, len(words) - 1):
                if words[i].text == "-c" and _is_python_word(words[i - 1].text):
                    source.python_snippets.append((words[i + 1].text, words[i + 1].line))
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
                    source.python_snippets.append((body, body_start))
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


def _words_from_string(text: str, line: int, sink: Source | None = None) -> list[Word]:
    """Split one string value into shell words (quotes inside it respected), keeping its line; Python code found
    in it (`python -c ...`) goes to `sink`."""
    inner = Source()
    scan_shell(text, inner, line)
    if sink is not None:
        sink.python_snippets.extend(inner.python_snippets)
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


def _element_words(node: ast.expr, line_offset: int, sink: Source | None = None) -> list[Word]:
    line = node.lineno + line_offset - 1
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        words = _words_from_string(node.value, line, sink)
        # A lone element is one argv word even if it is empty or all spaces.
        return words or [Word(node.value, line)]
    if isinstance(node, ast.JoinedStr):
        return _words_from_string(_fstring_text(node), line, sink)
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
            for flag, code in zip(elements, elements[1:], strict=False):
                is_flag = isinstance(flag, ast.Constant) and flag.value == "-c"
                if is_flag and isinstance(code, ast.Constant) and isinstance(code.value, str):
                    source.python_snippets.append((code.value, code.lineno + offset - 1))
            for element in elements:
                if isinstance(element, ast.Constant | ast.JoinedStr):
                    consumed.add(id(element))
                words += _element_words(element, offset, source)
        source.units.append(words)
    for node in ast.walk(tree):
        if id(node) in consumed or id(node) in docstrings:
            continue
        if isinstance(node, ast.JoinedStr):
            for value in node.values:
                consumed.add(id(value))
            source.units.append(_words_from_string(_fstring_text(node), node.lineno + offset - 1, source))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            source.units.append(_words_from_string(node.value, node.lineno + offset - 1, source))


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
                source.python_snippets.extend(inner.python_snippets)
                continue
            content = match.group(3) if match.group(3) is not None else match.group(4)
            words += _words_from_string(content, line, source)
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
