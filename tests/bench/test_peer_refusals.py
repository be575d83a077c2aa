"""deltaserve/bench/peer_refusals.py and the grid's one relaunch: a server that refuses to start the way vLLM 0.26
does when max_num_seqs exceeds its state blocks is launched again with the count its message names, the record
says so, a resumed call starts with it, and so does a new record given the old one (--adapt-from) on the same
GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

from deltaserve.bench.grid import Grid
from deltaserve.bench.grid_config import Arm, load_config
from deltaserve.bench.peer_refusals import known_refusals, max_num_seqs_named, refusal_key, with_max_num_seqs
from tests.support.ports import free_port

from .bench_helpers import WordTokenizer

FAKE_SERVER = Path(__file__).parent / "fake_server.py"
# vLLM 0.26's words (config/compilation.py), as an H100 printed them for the 27B with prefix caching
REFUSAL = (
    "(EngineCore pid=2900) ERROR 12-05 16:29:38 [core.py:1330] ValueError: max_num_seqs (1024) exceeds available "
    "Mamba cache blocks (256). Each decode sequence requires one Mamba cache block, so CUDA graph capture cannot "
    "proceed. Please lower max_num_seqs to at most 256 or increase gpu_memory_utilization."
)
# a stand-in peer: refuses as vLLM does unless launched with --max-num-seqs at most 200, else serves
REFUSING = f"""
import os, sys
args = sys.argv[1:]
count = int(args[args.index("--max-num-seqs") + 1]) if "--max-num-seqs" in args else 1024
if count > 200:
    print({REFUSAL.replace("1024", "{count}").replace("256", "200")!r}.format(count=count), flush=True)
    sys.exit(1)
os.execv(sys.executable, [sys.executable, {str(FAKE_SERVER)!r}, *[a for a in args if a != "--max-num-seqs" and
         a != str(count)]])
"""


def _refusing_grid(tmp_path: Path, word_model: Path) -> Path:
    """A one-point grid whose one arm is the REFUSING stand-in peer."""
    script = tmp_path / "refusing.py"
    script.write_text(REFUSING)
    toml = tmp_path / "refusing.toml"
    toml.write_text(
        f'[grid]\nname="refusing"\nconcurrencies=[1]\nlengths=[[8,2]]\nport={free_port()}\nmin_prompts=2\n'
        "prompts_per_concurrency=1\nnum_warmups=0\n"
        f'[[models]]\nname="w"\npath="{word_model}"\n'
        f'[[arms]]\nname="peer"\nrole="subject"\n'
        f'command=["{sys.executable}", "{script}", "{{model}}", "--port", "{{port}}"]\nstartup_timeout_s=120\n'
    )
    return toml


def test_the_refusal_is_read_from_vllms_words() -> None:
    assert max_num_seqs_named("some log\n" + REFUSAL + "\nTraceback ...") == (1024, 256)
    assert max_num_seqs_named("ValueError: something else") is None
    assert max_num_seqs_named(REFUSAL.replace("at most 256", "at most 2048")) is None  # no lower count to take
    peer = with_max_num_seqs(Arm(name="v", oracle="vllm", extra_args=["--max-model-len", "8192"]), 240)
    assert peer.extra_args == ["--max-model-len", "8192", "--max-num-seqs", "240"]
    assert with_max_num_seqs(Arm(name="d", command=["serve", "m"]), 8).command == ["serve", "m", "--max-num-seqs", "8"]


def test_the_grid_relaunches_once_with_the_named_count_and_a_resume_starts_with_it(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    toml = _refusing_grid(tmp_path, word_model)
    results = tmp_path / "r"
    record = Grid(load_config(toml), results, record_name="refusing", is_drift_enabled=False).run()
    first, second = record["launches"]
    assert "exited with 1" in first["error"] and first["adapted_to"].startswith("--max-num-seqs 200: vLLM refused")
    assert second["error"] is None and second["argv"][-2:] == ["--max-num-seqs", "200"]
    assert record["arms"]["peer"]["max_num_seqs_by_model"] == {"w": 200}
    assert [(r["metrics"]["completed"], r["metrics"]["num_prompts"]) for r in record["runs"]] == [(2, 2)]
    # a resumed call (here: a point the first did not run) starts with the recorded count, no refusal first
    config = load_config(toml)
    config.concurrencies = [1, 2]
    resumed = Grid(config, results, record_name="refusing", is_drift_enabled=False,
                   resume_path=results / "refusing.json").run()  # fmt: skip
    third = resumed["launches"][2]
    assert third["error"] is None and third["argv"][-2:] == ["--max-num-seqs", "200"] and len(resumed["launches"]) == 3


def test_known_refusals_are_the_adapted_launches_of_a_record_on_the_same_gpus() -> None:
    record = {
        "host": {"gpus": ["NVIDIA H200"]},
        "resumed": [{"gpus": ["NVIDIA H100 80GB HBM3"]}],
        "launches": [
            {"argv": ["vllm", "serve", "m"], "adapted_to": "--max-num-seqs 234: vLLM refused max_num_seqs 256 ..."},
            {"argv": ["vllm", "serve", "m", "--max-num-seqs", "234"], "adapted_to": None},
            {"argv": ["deltaserve", "serve", "m"]},
        ],
    }
    assert known_refusals(record, ["NVIDIA H100 80GB HBM3"]) == {("vllm", "serve", "m"): 234}  # a resumed call's card
    assert known_refusals(record, ["NVIDIA H200"]) == {("vllm", "serve", "m"): 234}
    assert known_refusals(record, ["NVIDIA H100 80GB HBM3"] * 2) == {}  # other GPUs: their blocks differ
    # the GDN prefill backend sizes nothing: a FlashInfer launch's refusal serves the Triton twin's launch
    assert refusal_key(["vllm", "serve", "m", "--gdn-prefill-backend", "triton"]) == ("vllm", "serve", "m")
    assert refusal_key(["vllm", "serve", "m", "--gdn-prefill-backend=triton", "--x"]) == ("vllm", "serve", "m", "--x")
    record["launches"][0]["argv"] = ["vllm", "serve", "m", "--gdn-prefill-backend", "flashinfer"]
    assert known_refusals(record, ["NVIDIA H200"]) == {("vllm", "serve", "m"): 234}


def test_a_new_record_adapted_from_an_old_one_starts_with_its_count(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    toml = _refusing_grid(tmp_path, word_model)
    results = tmp_path / "r"
    Grid(load_config(toml), results, record_name="old", is_drift_enabled=False).run()
    new = Grid(load_config(toml), results, record_name="new", is_drift_enabled=False,
               adapt_from=results / "old.json").run()  # fmt: skip
    (launch,) = new["launches"]  # no refused start first
    assert launch["error"] is None and launch["argv"][-2:] == ["--max-num-seqs", "200"]
    assert launch["adapted_from"].startswith("--max-num-seqs 200: ") and "old.json" in launch["adapted_from"]
    assert new["arms"]["peer"]["max_num_seqs_by_model"] == {"w": 200}
    assert [r["metrics"]["completed"] for r in new["runs"]] == [2]
