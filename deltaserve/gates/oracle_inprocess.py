"""Discovery of in-process vLLM constructions in Python harness code, for `deltaserve check oracle-flags`.

An in-process oracle (`vllm.LLM(...)`, `AsyncLLMEngine.from_engine_args(...)`, `EngineArgs(...)`, ...) has no
command line for the flag checks to read, so this module reads the Python itself (a .py file, a shell heredoc,
a `python -c` string), never running it. Names are resolved through the file's imports and simple aliases
(`import vllm as v`, `from vllm import LLM as Oracle`, `from vllm import *`, `x = importlib.import_module("vllm")`,
`getattr(vllm, "LLM")`, `functools.partial(LLM, ...)`), so `LLM` imported from deltaserve is not vLLM's.

Rules (the registry is deltaserve/bench/registry.py, found by path):
- outside the registry every construction is a violation: it bypasses the registry's production configuration;
- inside it, a construction may pass only `**kwargs` (built by `vllm_engine`), and those kwargs must set
  `language_model_only` from the checkpoint (a dict entry whose value is not a constant);
- every `Deviation(...)` (deltaserve/bench/deviations.py) must state a non-empty reason, direction and magnitude;
- outside the registry, setting `language_model_only` at all (keyword, dict key, item or attribute store, or
  `setattr`), a backend setting (`gdn_prefill_backend=...`, or such a key added to spread kwargs), or building an
  `OracleEngine` by hand is a violation: the registry decides them.
An `oracle-exempt: <reason>` comment on the construction's lines or right above them exempts it.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass, field

from deltaserve.bench.deviations import BACKEND_FLAGS
from deltaserve.gates.oracle_scan import EXEMPT_RE, Launch

CONSTRUCTORS = frozenset({"LLM", "LLMEngine", "AsyncLLMEngine", "AsyncLLM", "EngineArgs", "AsyncEngineArgs"})
FACTORY_METHODS = frozenset({"from_engine_args", "from_vllm_config", "from_cli_args"})
REGISTRY_SUFFIX = "deltaserve/bench/registry.py"
LMO_KEY = "language_model_only"
BACKEND_KEYS = frozenset(flag[2:].replace("-", "_") for flag in BACKEND_FLAGS)
DEVIATION_TEXT_FIELDS = ("reason", "direction", "magnitude")


@dataclass
class _Scope:
    """What the file's names stand for: qualified vLLM paths, and whether `from vllm import *` ran."""

    bindings: dict[str, str] = field(default_factory=dict)
    is_star_vllm: bool = False


def _is_vllm_path(path: str | None) -> bool:
    return path is not None and (path == "vllm" or path.startswith("vllm."))


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _resolve(node: ast.AST, scope: _Scope) -> str | None:
    """The qualified name an expression stands for, when the file's imports make it a vLLM name."""
    if isinstance(node, ast.Name):
        if node.id in scope.bindings:
            return scope.bindings[node.id]
        if scope.is_star_vllm and node.id in CONSTRUCTORS:
            return f"vllm.{node.id}"
        return None
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name == "getattr" and len(node.args) >= 2:
            base, attr = _resolve(node.args[0], scope), _const_str(node.args[1])
            return f"{base}.{attr}" if base and attr else None
        if name in ("import_module", "__import__") and node.args:
            module = _const_str(node.args[0])
            return module if _is_vllm_path(module) else None
    return None


def _collect_bindings(tree: ast.AST) -> _Scope:
    scope = _Scope()
    # Twice, so an alias of an alias (x = vllm; y = x.LLM) resolves whatever the order of the statements.
    for _ in range(2):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_vllm_path(alias.name):
                        bound = alias.asname or alias.name.split(".")[0]
                        scope.bindings[bound] = alias.name if alias.asname else alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm_path(node.module):
                for alias in node.names:
                    if alias.name == "*":
                        scope.is_star_vllm = True
                    else:
                        scope.bindings[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                value = node.value
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                resolved = _resolve(value, scope) if value is not None else None
                if resolved:
                    for target in targets:
                        if isinstance(target, ast.Name):
                            scope.bindings[target.id] = resolved
    return scope


def _construction(call: ast.Call, scope: _Scope) -> str | None:
    """The vLLM constructor a call builds (e.g. "vllm.LLM"), or None."""
    target = _resolve(call.func, scope)
    func = call.func
    is_partial = (isinstance(func, ast.Name) and func.id == "partial") or (
        isinstance(func, ast.Attribute) and func.attr == "partial"
    )
    if is_partial and call.args:
        target = _resolve(call.args[0], scope)
    if not _is_vllm_path(target):
        return None
    parts = target.split(".")
    if parts[-1] in CONSTRUCTORS:
        return target
    if parts[-1] in FACTORY_METHODS and len(parts) >= 2 and parts[-2] in CONSTRUCTORS:
        return target
    return None


def _comments(text: str) -> tuple[dict[int, str], set[int]]:
    """Comments by (file-relative) line, and the lines that hold only a comment."""
    comments: dict[int, str] = {}
    only: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string[1:]
                if not tok.line[: tok.start[1]].strip():
                    only.add(tok.start[0])
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return comments, only


def _exemption(comments: dict[int, str], only: set[int], first: int, last: int) -> str | None:
    """The `oracle-exempt:` reason on lines first..last or in the comment block right above."""
    lines = list(range(first, last + 1))
    above = first - 1
    while above in only:
        lines.append(above)
        above -= 1
    for line in lines:
        match = EXEMPT_RE.search(comments.get(line, ""))
        if match:
            return match.group(1).strip()
    return None


def _sets_key(node: ast.AST, keys: frozenset[str]) -> str | None:
    """The registry-owned setting a node writes (keyword, dict key, item/attribute store, setattr), if any."""
    if isinstance(node, ast.Call):
        for keyword in node.keywords:
            if keyword.arg in keys:
                return keyword.arg
        func = node.func
        if isinstance(func, ast.Name) and func.id == "setattr" and len(node.args) >= 2:
            name = _const_str(node.args[1])
            return name if name in keys else None
    if isinstance(node, ast.Dict):
        # A backend key counts in a dict that extends other kwargs ({**engine.kwargs, ...}); a table of layer
        # attributes that merely names one is not a setting.
        is_kwargs_like = any(key is None for key in node.keys)
        for key in node.keys:
            name = _const_str(key)
            if name == LMO_KEY or (name in keys and is_kwargs_like):
                return name
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and _const_str(node.slice) in keys:
        return _const_str(node.slice)
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in keys:
        return node.attr
    return None


def _registry_problems(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, problem) for the registry's own in-process rules."""
    problems: list[tuple[int, str]] = []
    lmo_entries = [
        (key, value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        for key, value in zip(node.keys, node.values, strict=True)
        if _const_str(key) == LMO_KEY
    ]
    if not lmo_entries:
        problems.append((1, f"the registry's in-process kwargs do not set {LMO_KEY}"))
    for key, value in lmo_entries:
        if isinstance(value, ast.Constant):
            problems.append((key.lineno, f"{LMO_KEY} is the constant {value.value!r}: it must follow the checkpoint"))
    return problems


def _deviation_problems(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, problem) for every `Deviation(...)` that lacks its reason, direction or magnitude."""
    problems = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Deviation"):
            continue
        given = {k.arg: k.value for k in node.keywords}
        for name in DEVIATION_TEXT_FIELDS:
            value = given.get(name)
            text = _const_str(value)
            if value is None or (text is not None and not text.strip()):
                problems.append((node.lineno, f"a registry Deviation without its {name}"))
    return problems


def find_inprocess(text: str, path: str, first_line: int = 1, is_whole_file: bool = True) -> list[Launch]:
    """Every in-process vLLM construction (and registry-owned setting) in Python `text`, judged.

    `is_whole_file` is False for code embedded in another file (a heredoc, a `python -c` string): such code is
    never the registry, whatever file holds it."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    offset = first_line - 1
    is_registry = is_whole_file and path.replace("\\", "/").endswith(REGISTRY_SUFFIX)
    scope = _collect_bindings(tree)
    comments, only = _comments(text)
    found: list[Launch] = []

    def judge(node: ast.AST, spelling: str, problems: list[str]) -> None:
        last = getattr(node, "end_lineno", None) or node.lineno
        launch = Launch(path, node.lineno + offset, spelling, "in-process", problems=problems)
        reason = _exemption(comments, only, node.lineno, last)
        if reason is not None:
            launch.exemption = reason or None
            launch.status = "exempt" if reason else "violation"
            if not reason:
                launch.problems.append("oracle-exempt marker without a reason")
        elif problems:
            launch.status = "violation"
        found.append(launch)

    judged: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = _construction(node, scope)
        if target is None or id(node) in judged:
            continue
        # A construction is one finding, whatever its arguments hold.
        judged.update(id(inner) for inner in ast.walk(node))
        problems = []
        if not is_registry:
            problems.append(
                f"constructs {target} in process without the oracle registry "
                "(build it with deltaserve.bench.registry.vllm_engine and build_vllm_llm)"
            )
        elif node.args or any(k.arg is not None for k in node.keywords):
            problems.append(f"the registry's {target} must take only **kwargs built by vllm_engine")
        for keyword in node.keywords:
            if keyword.arg == LMO_KEY:
                problems.append(f"sets {LMO_KEY}={ast.unparse(keyword.value)}: the registry decides it")
        judge(node, target, problems)
    rules = (_registry_problems(tree) if is_registry else []) + (_deviation_problems(tree) if is_whole_file else [])
    if rules:
        for line, problem in rules:
            launch = Launch(path, line + offset, "registry (in-process rules)", "in-process", problems=[problem])
            launch.status = "violation"
            found.append(launch)
    if is_registry:
        return found
    for node in ast.walk(tree):
        if id(node) in judged:
            continue
        func = node.func if isinstance(node, ast.Call) else None
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name == "OracleEngine":
            judge(node, "OracleEngine", ["builds an OracleEngine by hand: only registry.vllm_engine makes one"])
            continue
        key = _sets_key(node, frozenset({LMO_KEY}) | BACKEND_KEYS)
        if key is not None:
            what = "a backend vLLM would choose itself" if key in BACKEND_KEYS else "the registry's value"
            judge(node, f"sets {key}", [f"sets {key} outside the oracle registry ({what})"])
    return found
