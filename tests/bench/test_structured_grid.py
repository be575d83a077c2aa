"""The structured-output grid's premise: its JSON schema cannot close within the grid's output length on the dummy
vocabulary, so every output token of both engines is masked (a closed grammar under ignore_eos fails vLLM 0.26's
request and leaves deltaserve unconstrained: benchmarks/results/grids/h200_structured-35b-a3b-20261201-s4.json)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def smallest(schema: dict[str, Any]) -> str:
    """The shortest JSON text the schema admits (required properties only, empty strings, zero, minItems items)."""
    kind = schema["type"]
    if kind == "array":
        return "[" + ",".join(smallest(schema["items"]) for _ in range(schema.get("minItems", 0))) + "]"
    if kind == "object":
        required = schema.get("required", [])
        return "{" + ",".join(f'"{name}":{smallest(schema["properties"][name])}' for name in required) + "}"
    return {"integer": "0", "string": '""'}[kind]


def test_the_grids_schema_cannot_close_within_its_output_length() -> None:
    grid = tomllib.loads((ROOT / "benchmarks/grids/h200_structured.toml").read_text())
    client_args = grid["grid"]["client_args"]
    body = json.loads(client_args[client_args.index("--extra-body") + 1])
    schema = body["structured_outputs"]["json"]
    text = smallest(schema)
    json.loads(text)  # a valid instance
    output_len = max(out for _, out in grid["grid"]["lengths"])
    # outside strings the dummy vocabulary spells JSON one character per token (its multi-character tokens, "tN"
    # words and the specials, contain letters or '<', never JSON structure), so the smallest instance costs at least
    # one token per character outside its (empty) strings
    assert len(text) > 10 * output_len, (len(text), output_len)
    free = tomllib.loads((ROOT / "benchmarks/grids/h200_structured_free.toml").read_text())
    assert "--extra-body" not in free["grid"]["client_args"] and free["grid"]["lengths"] == grid["grid"]["lengths"]
