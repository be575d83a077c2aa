"""Grid configuration: the TOML file of `deltaserve bench grid` parsed into arms, models, lengths and the dataset,
and each (arm, model) pair resolved into an exact launch: a command line with its placeholders filled, or, for a
peer arm (`oracle = "vllm"`), the production command the oracle registry builds.

The optional `[dataset]` table picks the client's dataset: `name = "random"` (the default: text prompts on
/v1/completions) or `name = "random-mm"` (random text plus synthetic images on /v1/chat/completions, the client's
`--backend openai-chat`) with vLLM's random-mm settings as keys (`random_mm_base_items_per_request`,
`random_mm_num_mm_items_range_ratio`, `random_mm_limit_mm_per_prompt` as a table, `random_mm_bucket_config` as
vLLM's CLI literal, e.g. "{(512, 512, 1): 1.0}"). Image traffic makes the registry build the peer with its vision
tower (registry.py, `serves_media`).

`name = "prefix_repetition"` is vLLM's dataset of shared random prefixes (dataset_prefix.py): each `lengths` pair
(ISL, OSL) is prefix + suffix tokens in and OSL out, with `prefix_repetition_prefix_len` either one number for
every pair or a list with one per pair (the suffix is ISL minus it) and `prefix_repetition_num_prefixes` (vLLM's
default 10). Such data shares prefixes, so the registry builds every peer without --no-enable-prefix-caching; an
arm with `enable_prefix_caching = true` (and optionally `prefix_match_unit = N`) is vLLM's prefix-caching arm.
A vLLM arm with `speculative_config = {method = "mtp", num_speculative_tokens = k, ...}` is vLLM's MTP arm (the
registry checks it and adds `--speculative-config`).

`name = "multi-turn"` is our conversation workload (multi_turn.py) on /v1/chat/completions: the concurrency axis is
the number of clients (one conversation each, so a point at concurrency C runs C conversations), each `lengths`
pair is (system prompt tokens, answer tokens), and `multi_turn_turns` and `multi_turn_user_len` (both required)
give every conversation's turns and user-message length. It shares prefixes too, so its peers are built as for
prefix_repetition.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaserve.bench import registry
from deltaserve.bench.dataset_mm import format_bucket_config, parse_bucket_config, parse_limit_mm_per_prompt
from deltaserve.bench.deviations import DEFAULT_SITE

REPO_ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER_RE = re.compile(r"\{(model|model_name|port|python|repo|max_isl)\}")


@dataclass
class Arm:
    """One server launch recipe (templates are expanded per model)."""

    name: str
    role: str = "peer"  # "subject" (deltaserve) or "peer" (the denominator)
    command: list[str] = field(default_factory=list)
    oracle: str | None = None
    site: str = DEFAULT_SITE
    python: str = "{python}"
    extra_args: list[str] = field(default_factory=list)
    drop_flags: list[str] = field(default_factory=list)
    exemption: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    health_url: str = "http://127.0.0.1:{port}/health"
    startup_timeout_s: float = 600.0
    version_probe: list[str] = field(default_factory=list)
    denominator_note: str | None = None
    # Another arm of the grid this one is also compared with (arm / baseline ratios), e.g. vLLM at a forced backend
    # against vLLM at its own choice.
    baseline: str | None = None
    # vLLM's prefix-caching arm (registry.vllm_launch): --enable-prefix-caching [--prefix-match-unit N]
    enable_prefix_caching: bool = False
    prefix_match_unit: int | None = None
    # a vLLM peer: its MTP arm (registry_rules.check_speculative_config)
    speculative_config: dict[str, Any] | None = None
    # Estimates for --deadline-s: a launch starts only if startup + points x run would end before the deadline.
    expected_startup_s: float = 0.0
    expected_run_s: float = 0.0


DATASETS = ("random", "random-mm", "prefix_repetition", "multi-turn")
PREFIX_KEYS = ("prefix_repetition_prefix_len", "prefix_repetition_num_prefixes")
MULTI_TURN_KEYS = ("multi_turn_turns", "multi_turn_user_len")
MM_KEYS = (
    "random_mm_base_items_per_request",
    "random_mm_num_mm_items_range_ratio",
    "random_mm_limit_mm_per_prompt",
    "random_mm_bucket_config",
)


@dataclass
class DatasetConfig:
    """The grid's `[dataset]` table: which client dataset every run uses, and its random-mm settings."""

    name: str = "random"
    mm: dict[str, object] = field(default_factory=dict)  # random-mm keys given in the TOML (client defaults else)
    prefix: dict[str, object] = field(default_factory=dict)  # prefix_repetition keys given in the TOML
    multi_turn: dict[str, object] = field(default_factory=dict)  # multi-turn keys given in the TOML

    @property
    def serves_media(self) -> bool:
        return self.name == "random-mm"

    @property
    def is_multi_turn(self) -> bool:
        return self.name == "multi-turn"

    @property
    def shares_prefixes(self) -> bool:
        return self.name in ("prefix_repetition", "multi-turn")

    def prefix_len(self, lengths: list[tuple[int, int]], isl: int) -> int:
        """The shared prefix of the `lengths` pair with this ISL (one number, or one per pair)."""
        value = self.prefix["prefix_repetition_prefix_len"]
        if isinstance(value, list):
            value = value[[pair[0] for pair in lengths].index(isl)]
        return int(value)  # type: ignore[call-overload]

    def client_flags(
        self, lengths: list[tuple[int, int]] | None = None, isl: int = 0, osl: int = 0, concurrency: int = 1
    ) -> list[str]:
        """The `deltaserve bench serve` flags that pick this dataset (and, for images and conversations, the chat
        endpoint); a prefix_repetition point needs the grid's `lengths` and its (ISL, OSL), a multi-turn point its
        (system, answer) lengths and its concurrency (= clients)."""
        if self.is_multi_turn:
            flags = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", self.name]
            flags += ["--multi-turn-num-clients", str(concurrency), "--multi-turn-system-len", str(isl)]
            flags += ["--multi-turn-turns", str(self.multi_turn["multi_turn_turns"])]
            flags += ["--multi-turn-user-len", str(self.multi_turn["multi_turn_user_len"])]
            return [*flags, "--multi-turn-output-len", str(osl)]
        if self.name == "prefix_repetition":
            prefix_len = self.prefix_len(lengths or [], isl)
            flags = ["--dataset-name", self.name, "--prefix-repetition-prefix-len", str(prefix_len)]
            flags += ["--prefix-repetition-suffix-len", str(isl - prefix_len)]
            flags += ["--prefix-repetition-output-len", str(osl)]
            if "prefix_repetition_num_prefixes" in self.prefix:
                flags += ["--prefix-repetition-num-prefixes", str(self.prefix["prefix_repetition_num_prefixes"])]
            return flags
        if not self.serves_media:
            return ["--dataset-name", self.name]
        flags = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", self.name]
        for key in MM_KEYS:
            if key not in self.mm:
                continue
            value = self.mm[key]
            if key == "random_mm_limit_mm_per_prompt":
                text = json.dumps(value)
            elif key == "random_mm_bucket_config":
                text = format_bucket_config(parse_bucket_config(str(value)))
            else:
                text = str(value)
            flags += ["--" + key.replace("_", "-"), text]
        return flags


def parse_dataset(raw: dict[str, object]) -> DatasetConfig:
    """Validate a `[dataset]` table (unknown keys and bad random-mm values are refused by name)."""
    name = str(raw.get("name", "random"))
    if name not in DATASETS:
        raise ValueError(f"[dataset]: name must be one of {', '.join(DATASETS)}, got {name!r}")
    unknown = set(raw) - {"name", *MM_KEYS, *PREFIX_KEYS, *MULTI_TURN_KEYS}
    if unknown:
        raise ValueError(f"[dataset]: unknown keys {sorted(unknown)}")
    mm = {k: v for k, v in raw.items() if k in MM_KEYS}
    if mm and name != "random-mm":
        raise ValueError(f"[dataset]: {sorted(mm)} apply to random-mm only, not {name!r}")
    prefix = {k: v for k, v in raw.items() if k in PREFIX_KEYS}
    if prefix and name != "prefix_repetition":
        raise ValueError(f"[dataset]: {sorted(prefix)} apply to prefix_repetition only, not {name!r}")
    if name == "prefix_repetition" and "prefix_repetition_prefix_len" not in prefix:
        raise ValueError("[dataset]: prefix_repetition needs prefix_repetition_prefix_len (one, or one per length)")
    multi_turn = {k: v for k, v in raw.items() if k in MULTI_TURN_KEYS}
    if multi_turn and name != "multi-turn":
        raise ValueError(f"[dataset]: {sorted(multi_turn)} apply to multi-turn only, not {name!r}")
    if name == "multi-turn":
        for key in MULTI_TURN_KEYS:
            if not isinstance(multi_turn.get(key), int) or int(multi_turn[key]) < 1:  # type: ignore[call-overload]
                raise ValueError(f"[dataset]: multi-turn needs {key}, a positive integer")
    if "random_mm_bucket_config" in mm:
        parse_bucket_config(str(mm["random_mm_bucket_config"]))
    if "random_mm_limit_mm_per_prompt" in mm:
        parse_limit_mm_per_prompt(mm["random_mm_limit_mm_per_prompt"])  # type: ignore[arg-type]
    return DatasetConfig(name, mm, prefix, multi_turn)


def check_prefix_lengths(dataset: DatasetConfig, lengths: list[tuple[int, int]]) -> None:
    """Each (ISL, OSL) pair has a prefix shorter than its ISL (distinct ISLs, so a point names its prefix)."""
    if dataset.name != "prefix_repetition":
        return
    value = dataset.prefix["prefix_repetition_prefix_len"]
    if isinstance(value, list) and len(value) != len(lengths):
        raise ValueError(f"[dataset]: {len(value)} prefix_repetition_prefix_len for {len(lengths)} lengths")
    if len({isl for isl, _ in lengths}) != len(lengths):
        raise ValueError("[dataset]: prefix_repetition lengths need distinct ISLs")
    for isl, _ in lengths:
        if not 0 < dataset.prefix_len(lengths, isl) < isl:
            raise ValueError(f"[dataset]: the prefix of ISL {isl} must be in [1, {isl - 1}]")


@dataclass
class Model:
    name: str
    path: str


@dataclass
class GridConfig:
    """A parsed grid TOML file."""

    name: str
    title: str
    description: str
    models: list[Model]
    arms: list[Arm]
    concurrencies: list[int]
    lengths: list[tuple[int, int]]
    prompts_per_concurrency: int = 10
    min_prompts: int = 10
    num_warmups: int = 2
    seed: int = 0
    port: int = 8000
    is_restart_cheap: bool = False
    drift_concurrency: int | None = None
    client_args: list[str] = field(default_factory=list)
    stop_timeout_s: float = 30.0
    run_timeout_s: float | None = None  # one client run longer than this is recorded as failed
    # each launch runs its first point once, unrecorded, before measuring: a server that compiles kernels for batch
    # shapes its start-up missed (vLLM's JIT) pays that in the throw-away run, not in its first measured point
    warmup_point: bool = False
    source_path: str = ""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_concurrency * concurrency)

    def max_input_len(self) -> int:
        """The longest prompt of any point (the registry sizes a peer's step budget by it): the largest ISL, or for
        multi-turn the last turn's history, system + turns x (user + answer) tokens before the chat template's."""
        if not self.dataset.is_multi_turn:
            return max(isl for isl, _ in self.lengths)
        turns, user_len = (int(self.dataset.multi_turn[k]) for k in MULTI_TURN_KEYS)  # type: ignore[call-overload]
        return max(system + turns * (user_len + osl) for system, osl in self.lengths)


def load_config(path: Path) -> GridConfig:
    """Parse and validate a grid TOML file."""
    raw = tomllib.loads(path.read_text())
    grid = raw.get("grid", {})
    arms = []
    for item in raw.get("arms", []):
        arm = Arm(**{k: v for k, v in item.items() if k in Arm.__dataclass_fields__})
        unknown = set(item) - set(Arm.__dataclass_fields__)
        if unknown:
            raise ValueError(f"arm {arm.name!r}: unknown keys {sorted(unknown)}")
        if bool(arm.command) == bool(arm.oracle):
            raise ValueError(f"arm {arm.name!r}: give exactly one of `command` or `oracle`")
        if arm.role not in ("subject", "peer"):
            raise ValueError(f"arm {arm.name!r}: role must be subject or peer")
        if arm.drop_flags and not arm.exemption:
            raise ValueError(f"arm {arm.name!r}: drop_flags needs an `exemption` reason")
        if arm.speculative_config is not None and not arm.oracle:
            raise ValueError(f"arm {arm.name!r}: speculative_config builds a peer's MTP arm; a command arm spells it")
        arms.append(arm)
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate arm names in {path}")
    for arm in arms:
        if arm.baseline is not None and (arm.baseline not in names or arm.baseline == arm.name):
            raise ValueError(f"arm {arm.name!r}: baseline {arm.baseline!r} is not another arm of the grid")
    models = [Model(str(m["name"]), str(m["path"])) for m in raw.get("models", [])]
    if not arms or not models:
        raise ValueError(f"{path}: needs at least one [[arms]] and one [[models]]")
    known = set(GridConfig.__dataclass_fields__) - {
        "name", "title", "description", "models", "arms", "source_path", "dataset",
    }  # fmt: skip
    unknown = set(grid) - known - {"name", "title", "description"}
    if unknown:
        raise ValueError(f"[grid]: unknown keys {sorted(unknown)}")
    options = {k: v for k, v in grid.items() if k in known}
    options["lengths"] = [tuple(pair) for pair in grid.get("lengths", [[1024, 128]])]
    options.setdefault("concurrencies", [1])
    dataset = parse_dataset(raw.get("dataset", {}))
    check_prefix_lengths(dataset, options["lengths"])
    return GridConfig(
        name=str(grid.get("name", path.stem)),
        title=str(grid.get("title", path.stem)),
        description=str(grid.get("description", "")),
        models=models,
        arms=arms,
        source_path=str(path),
        dataset=dataset,
        **options,
    )


def expand(text: str, context: dict[str, str]) -> str:
    """$VARS from the environment, then the grid's own {placeholders} (unknown braces stay as they are)."""
    text = os.path.expandvars(text)
    return PLACEHOLDER_RE.sub(lambda m: context[m.group(1)], text)


@dataclass
class Launch:
    """An arm resolved for one model: what will be run."""

    arm: Arm
    model: Model
    argv: list[str]
    env_overrides: dict[str, str]
    health_url: str
    base_url: str
    version_probe: list[str]
    exemption: str | None
    reasons: list[str]
    deviations: list[str] = field(default_factory=list)  # registry deviation names the launch carries
    denominator_note: str | None = None  # the registry's note for them, if any can move a metric


def resolve(arm: Arm, model: Model, config: GridConfig) -> Launch:
    """Expand templates; for an oracle arm, ask the registry for the production command."""
    max_isl = config.max_input_len()
    context = {
        "model": expand(model.path, {}),
        "model_name": model.name,
        "port": str(config.port),
        "python": sys.executable,
        "repo": str(REPO_ROOT),
        "max_isl": str(max_isl),
    }
    env = {k: expand(str(v), context) for k, v in arm.env.items()}
    exemption = None
    reasons: list[str] = []
    deviations: list[str] = []
    note = None
    if arm.oracle:
        oracle = registry.oracle_launch(
            arm.oracle,
            context["model"],
            max_isl,
            port=config.port,
            site=arm.site,
            python=expand(arm.python, context),
            extra_args=[expand(a, context) for a in arm.extra_args],
            drop_flags=arm.drop_flags,
            exemption=arm.exemption,
            serves_media=config.dataset.serves_media,
            is_random_data=not config.dataset.shares_prefixes,
            enable_prefix_caching=arm.enable_prefix_caching,
            prefix_match_unit=arm.prefix_match_unit,
            speculative_config=arm.speculative_config,
        )
        argv = oracle.argv
        env = {**oracle.env, **env}
        probe = oracle.version_probe
        exemption = oracle.exemption
        reasons = oracle.reasons
        deviations = oracle.deviations
        note = oracle.denominator_note
    else:
        argv = [expand(a, context) for a in arm.command]
        probe = [expand(a, context) for a in arm.version_probe] or [
            sys.executable,
            "-c",
            "import deltaserve; print(deltaserve.__version__)",
        ]
    health_url = expand(arm.health_url, context)
    match = re.match(r"(https?://[^/]+)", health_url)
    base_url = match.group(1) if match else f"http://127.0.0.1:{config.port}"
    return Launch(arm, model, argv, env, health_url, base_url, probe, exemption, reasons, deviations, note)
