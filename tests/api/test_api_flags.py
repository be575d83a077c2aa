"""`deltaserve serve` takes every flag of `vllm serve` (0.26): each parses, and each is implemented, accepted and
logged, or refused by name. The implemented server flags are checked on running servers: --root-path, TLS,
--enable-request-id-headers, --trust-request-chat-template, --enable-tokenizer-info-endpoint, --max-logprobs, ..."""

from __future__ import annotations

import argparse
import json
import logging
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaserve.api import cli
from deltaserve.api.compat import COMPAT_FLAGS, check_compat
from deltaserve.api.server import build_app
from deltaserve.api.settings import ServerSettings

from .conftest import MODEL_NAME
from .fake_engine import FakeEngine
from .server_thread import ServerThread, serve

DATA = Path(__file__).parent / "data"
CERT, KEY = str(DATA / "test-cert.pem"), str(DATA / "test-key.pem")
USER = [{"role": "user", "content": "Hi"}]

# Every option of `vllm serve` in vLLM 0.26 (vllm/entrypoints/openai/cli_args.py and vllm/engine/arg_utils.py).
VLLM_026_SERVE_FLAGS = """
--additional-config --aggregate-engine-logging --all2all-backend --allow-credentials --allow-deprecated-quantization
--allowed-headers --allowed-local-media-path --allowed-media-domains --allowed-methods --allowed-origins --api-key
--api-server-count --async-scheduling --attention-backend --attention-config --block-size --calculate-kv-scales
--chat-template --chat-template-content-format --code-revision --collect-detailed-traces --compilation-config
--config-format --convert --cp-kv-cache-interleave-size --cpu-distributed-timeout-seconds --cpu-offload-gb
--cpu-offload-params --cudagraph-capture-sizes --cudagraph-metrics --data-parallel-address --data-parallel-backend
--data-parallel-external-lb --data-parallel-hybrid-lb --data-parallel-multi-port-external-lb --data-parallel-rank
--data-parallel-rpc-port --data-parallel-size --data-parallel-size-local --data-parallel-start-rank
--data-parallel-supervisor-port --dbo-decode-token-threshold --dbo-prefill-token-threshold --dcp-comm-backend
--dcp-kv-cache-interleave-size --decode-context-parallel-size --default-chat-template-kwargs --default-mm-loras
--device-ids --diffusion-config --disable-access-log-for-endpoints --disable-cascade-attn --disable-chunked-mm-input
--disable-custom-all-reduce --disable-fastapi-docs --disable-hybrid-kv-cache-manager --disable-log-stats
--disable-nccl-for-dp-synchronization --disable-sliding-window --disable-uvicorn-access-log
--distributed-executor-backend --distributed-timeout-seconds --download-dir --dp-supervisor-probe-failure-threshold
--dp-supervisor-probe-interval-s --dp-supervisor-probe-timeout-s --dtype --ec-transfer-config
--enable-auto-tool-choice --enable-bf16x3-router-gemm --enable-chunked-prefill --enable-cumem-allocator --enable-dbo
--enable-elastic-ep --enable-ep-weight-filter --enable-eplb --enable-expert-parallel --enable-flash-late-interaction
--enable-flashinfer-autotune --enable-force-include-usage --enable-layerwise-nvtx-tracing --enable-log-deltas
--enable-log-outputs --enable-log-requests --enable-logging-iteration-details --enable-lora
--enable-mamba-cache-stochastic-rounding --enable-mfu-metrics --enable-mixed-moe-lora-format --enable-mm-embeds
--enable-moe-shared-loras --enable-offline-docs --enable-per-request-metrics --enable-prefix-caching
--enable-prompt-embeds --enable-prompt-tokens-details --enable-request-id-headers --enable-return-routed-experts
--enable-server-load-tracking --enable-sleep-mode --enable-ssl-refresh --enable-tokenizer-info-endpoint
--enable-tower-connector-lora --enforce-eager --eplb-config --exclude-tools-when-tool-choice-none
--expert-placement-strategy --fail-on-environ-validation --fingerprint-mode --fingerprint-value --fully-sharded-loras
--gdn-prefill-backend --generation-config --gpu-memory-utilization --grpc --h11-max-header-count
--h11-max-incomplete-event-size --headless --hf-config-path --hf-overrides --hf-token --host --ignore-patterns
--interleave-mm-strings --io-processor-plugin --ir-op-priority --jit-monitor-mode --jit-monitor-verbose
--kernel-config --kv-cache-dtype --kv-cache-dtype-skip-layers --kv-cache-memory-bytes --kv-cache-metrics
--kv-cache-metrics-sample --kv-events-config --kv-offloading-backend --kv-offloading-size --kv-sharing-fast-prefill
--kv-transfer-config --language-model-only --limit-mm-per-prompt --linear-backend --load-format --log-config-file
--log-error-stack --logits-processors --logprobs-mode --long-prefill-token-threshold --lora-dtype --lora-modules
--lora-target-modules --mamba-backend --mamba-block-size --mamba-cache-dtype --mamba-cache-mode
--mamba-cache-philox-rounds --mamba-ssm-cache-dtype --master-addr --master-port --max-cpu-loras
--max-cudagraph-capture-size --max-log-len --max-logprobs --max-long-partial-prefills --max-lora-rank --max-loras
--max-model-len --max-num-batched-tokens --max-num-partial-prefills --max-num-scheduled-tokens --max-num-seqs
--max-parallel-loading-workers --media-io-kwargs --middleware --mm-encoder-attn-backend --mm-encoder-attn-dtype
--mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-margin --mm-encoder-fp8-scale-save-path --mm-encoder-only
--mm-encoder-tp-mode --mm-ipc-gpu-memory-gb --mm-processor-cache-gb --mm-processor-cache-type --mm-processor-kwargs
--mm-shm-cache-max-object-size-mb --mm-tensor-ipc --model --model-class-overrides --model-impl
--model-loader-extra-config --moe-backend --nnodes --node-rank --num-gpu-blocks-override --numa-bind --numa-bind-cpus
--numa-bind-nodes --offload-backend --offload-group-size --offload-num-in-group --offload-params
--offload-prefetch-step --optimization-level --otlp-traces-endpoint --override-attention-dtype
--override-generation-config --performance-mode --pipeline-parallel-size --pooler-config --port
--prefill-context-parallel-size --prefill-schedule-interval --prefix-caching-hash-algo --prefix-match-unit
--profiler-config --pt-load-map-location --quantization --quantization-config --ray-workers-use-nsight
--reasoning-config --reasoning-parser --reasoning-parser-plugin --renderer-num-workers --response-role
--return-tokens-as-token-ids --revision --root-path --runner --safetensors-load-strategy
--safetensors-prefetch-block-size --safetensors-prefetch-num-threads --scheduler-cls --scheduler-reserve-full-isl
--scheduling-policy --seed --served-model-name --show-hidden-metrics-for-version --shutdown-timeout
--skip-mm-profiling --skip-tokenizer-init --spec-method --spec-model --spec-tokens --specialize-active-lora
--speculative-config --ssl-ca-certs --ssl-cert-reqs --ssl-certfile --ssl-ciphers --ssl-keyfile --stream-interval
--structured-outputs-config --tensor-parallel-size --tokenizer --tokenizer-mode --tokenizer-revision --tokens-only
--tool-call-parser --tool-parser-plugin --tool-server --trust-remote-code --trust-request-chat-template --ubatch-size
--uds --use-fp64-gumbel --use-tqdm-on-load --uvicorn-log-level --video-pruning-rate --watermark
--weight-transfer-config --worker-cls --worker-extension-cls
""".split()  # noqa: SIM905
# A value each implemented flag accepts (the rest take any string, or are switches).
VALUES = {"--port": "8001", "--max-model-len": "4096", "--max-num-seqs": "8", "--max-num-batched-tokens": "8192",
          "--gpu-memory-utilization": "0.8", "--dtype": "bfloat16", "--load-format": "safetensors", "--seed": "1",
          "--block-size": "16", "--override-generation-config": "{}", "--default-chat-template-kwargs": "{}",
          "--reasoning-parser": "qwen3", "--tool-call-parser": "hermes", "--allowed-origins": "[]",
          "--allowed-methods": '["GET"]', "--allowed-headers": '["x"]', "--uvicorn-log-level": "info",
          "--jit-monitor-mode": "error",
          "--chat-template-content-format": "string", "--max-logprobs": "5", "--ssl-cert-reqs": "0",
          "--h11-max-incomplete-event-size": "4096", "--mm-processor-kwargs": "{}",
          "--limit-mm-per-prompt": "{\"image\": 1}",
          "--structured-outputs-config": "{\"backend\": \"xgrammar\"}", "--scheduling-policy": "priority",
          "--prefix-caching-hash-algo": "xxhash", "--quantization": "fp8",
          "--speculative-config": "{\"method\": \"mtp\"}", "--gdn-prefill-backend": "triton",
          "--attention-config": "{}", "--fingerprint-mode": "hash",
          "--reasoning-config": "{\"reasoning_end_str\": \"</think>\"}"}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(prog="deltaserve serve")
    cli.add_arguments(result)
    return result


def parse(*argv: str) -> argparse.Namespace:
    return parser().parse_args(cli.normalize_argv(list(argv)))


def argv_for(flag: str) -> list[str]:
    action = parser()._option_string_actions[flag]
    if action.nargs == 0:
        return [flag]
    return [flag, VALUES.get(flag, "1")]


def test_every_vllm_flag_is_known() -> None:
    known = parser()._option_string_actions
    assert not [flag for flag in VLLM_026_SERVE_FLAGS if flag not in known]
    assert len(VLLM_026_SERVE_FLAGS) == 273


@pytest.mark.parametrize("flag", VLLM_026_SERVE_FLAGS)
def test_every_vllm_flag_parses(flag: str) -> None:
    args = parse("m", *argv_for(flag))
    entry = next((entry for entry in COMPAT_FLAGS if flag in entry.flags), None)
    value = argv_for(flag)[1:]
    if entry is not None and entry.policy == "refuse" and not (value and value[0] in entry.allowed):
        with pytest.raises(ValueError, match=flag):
            check_compat(args)
    else:
        check_compat(args)


def test_switches_have_the_no_form() -> None:
    for entry in COMPAT_FLAGS:
        if entry.kind == "switch":
            check_compat(parse("m", "--no-" + entry.flags[0][2:]))  # never refused: it asks for nothing
    args = parse("m", "--no-enable-auto-tool-choice", "--no-enforce-eager", "--no-trust-request-chat-template")
    assert not args.enable_auto_tool_choice and not args.enforce_eager


def test_refused_flags_name_themselves() -> None:
    cases = {("-pp", "2"): "--pipeline-parallel-size 2", ("--quantization-config", "{}"): "--quantization-config",
             ("--enable-lora",): "--enable-lora", ("--hf-overrides", "{}"): "--hf-overrides",
             ("--kv-transfer-config", "{}"): "--kv-transfer-config",
             ("--logprobs-mode", "processed_logits"): "--logprobs-mode processed_logits",
             ("--api-server-count", "2"): "--api-server-count 2", ("--nnodes", "2"): "--nnodes 2"}  # fmt: skip
    for argv, name in cases.items():
        with pytest.raises(ValueError, match=name):
            check_compat(parse("m", *argv))
    for argv in (["-tp", "1"], ["--logprobs-mode", "raw_logprobs"], ["--no-enable-lora"]):
        check_compat(parse("m", *argv))


def test_quantization_flag_reaches_the_engine_and_is_checked_at_start_up(
    tiny_dense: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--quantization / -q is vLLM's: "None" is no value, any other value goes to EngineConfig.quantization, and the
    start-up checks compare it with the checkpoint (tests/model/test_fp8_loading.py: accepted on block FP8); on this
    unquantized checkpoint, where vLLM would quantize online, `-q fp8` exits 1 with one line naming it."""
    for argv, value in ((["-q", "None"], None), (["-q", "fp8"], "fp8"), (["--quantization", "awq"], "awq"), ([], None)):
        args = parse("m", *argv)
        check_compat(args)
        assert cli.build_engine_config(args, "m", "cpu").quantization == value
    for method, problem in (("fp8", "no quantization_config"), ("gptq", "is not supported")):
        caplog.clear()
        assert cli.run(parse(str(tiny_dense), "-q", method, "--port", "0", "--device", "cpu")) == 1
        (error,) = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
        assert f"--quantization {method} " in error and problem in error, error


def test_tensor_parallel_flags_are_implemented() -> None:
    # vLLM's parallelism flags that deltaserve honours are its own flags, not accepted-and-ignored table entries
    table_flags = {flag for entry in COMPAT_FLAGS for flag in entry.flags}
    implemented = ("--tensor-parallel-size", "-tp", "--distributed-executor-backend", "--enable-expert-parallel", "-ep")
    assert table_flags.isdisjoint(implemented)
    args = parse("m", "-tp", "2", "--distributed-executor-backend", "mp", "-ep")
    check_compat(args)
    config = cli.build_engine_config(args, "m", "cpu")
    assert (config.tensor_parallel_size, config.distributed_executor_backend, config.enable_expert_parallel) == (
        2, "mp", True,
    )  # fmt: skip
    config = cli.build_engine_config(
        parse("m", "--tensor-parallel-size", "4", "--no-enable-expert-parallel"), "m", "cpu"
    )
    assert (config.tensor_parallel_size, config.enable_expert_parallel) == (4, False)
    assert (
        cli.build_engine_config(parse("m", "--distributed-executor-backend", "uni"), "m", "cpu").tensor_parallel_size
        == 1
    )
    for argv, name in ((["-tp", "2", "--distributed-executor-backend", "ray"], "'ray' is not supported"),
                       (["-tp", "2", "--distributed-executor-backend", "uni"], r"'uni' .*\(-tp 1\)"),
                       (["-tp", "0"], "tensor_parallel_size must be at least 1")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            cli.build_engine_config(parse("m", *argv), "m", "cpu")
        assert cli.run(parse("m", *argv)) == 2


def test_gdn_prefill_backend_is_implemented(tiny_dense: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's --gdn-prefill-backend {flashinfer,triton,cutedsl} reaches EngineConfig (absent: None, vLLM's auto, which
    serves deltaserve's own kernel); cutedsl is refused by name (exit 2), another value by argparse as in vLLM, and
    flashinfer where it cannot run (here: the CPU) at start-up, exit 1 with one line giving the reason."""
    assert all("--gdn-prefill-backend" not in entry.flags for entry in COMPAT_FLAGS)
    for argv, value in (([], None), (["--gdn-prefill-backend", "triton"], "triton"),
                        (["--gdn_prefill_backend=flashinfer"], "flashinfer")):  # fmt: skip
        assert cli.build_engine_config(parse("m", *argv), "m", "cpu").gdn_prefill_backend == value
    with pytest.raises(ValueError, match=r"--gdn-prefill-backend cutedsl .*not served by deltaserve.*Blackwell"):
        cli.build_engine_config(parse("m", "--gdn-prefill-backend", "cutedsl"), "m", "cpu")
    assert cli.run(parse("m", "--gdn-prefill-backend", "cutedsl")) == 2
    with pytest.raises(SystemExit):
        parse("m", "--gdn-prefill-backend", "auto")  # not one of vLLM's choices
    caplog.clear()
    argv = (str(tiny_dense), "--gdn-prefill-backend", "flashinfer", "--port", "0", "--device", "cpu")
    assert cli.run(parse(*argv)) == 1
    (error,) = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert "--gdn-prefill-backend flashinfer: FlashInfer's GDN prefill cannot run here: the device is cpu" in error


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1073741824", 2**30), ("4G", 4 * 2**30), ("512M", 512 * 2**20), ("1T", 2**40), ("3K", 3072),
     ("1.5g", 1_500_000_000), ("2k", 2000), ("0.25t", 250 * 10**9), (" 7m ", 7_000_000), ("0", None),
     ("None", None), ("", None)],
)  # fmt: skip
def test_kv_cache_memory_bytes_reads_vllms_human_readable_ints(value: str, expected: int | None) -> None:
    """vLLM's reading (human_readable_int behind optional_type): lowercase suffixes decimal, uppercase binary; "" or
    None: not set, and 0 too (vLLM tests it for truth). It is implemented, not a table entry, and reaches the engine
    config (the offline LLM takes the same field)."""
    assert "--kv-cache-memory-bytes" not in {flag for entry in COMPAT_FLAGS for flag in entry.flags}
    args = parse("m", f"--kv_cache_memory_bytes={value}")
    check_compat(args)
    assert cli.build_engine_config(args, "m", "cpu").kv_cache_memory_bytes == expected


@pytest.mark.parametrize(("value", "expected"), [("12", 12), ("None", None), ("", None)])
def test_num_gpu_blocks_override_reaches_the_engine(value: str, expected: int | None) -> None:
    """vLLM's optional_type(int); implemented, not a table entry (tests/runner/test_cache_budget.py: its effect)."""
    assert "--num-gpu-blocks-override" not in {flag for entry in COMPAT_FLAGS for flag in entry.flags}
    args = parse("m", f"--num-gpu-blocks-override={value}")
    check_compat(args)
    assert cli.build_engine_config(args, "m", "cpu").num_gpu_blocks_override == expected


@pytest.mark.parametrize(
    ("value", "error"),
    [("4GiB", "not a byte count"), ("4 GB", "not a byte count"), ("1.5G", "did you mean 1.5g"),
     ("-1", "at least 0"), ("lots", "not a byte count")],
)  # fmt: skip
def test_kv_cache_memory_bytes_refuses_other_spellings(value: str, error: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse("m", "--kv-cache-memory-bytes", value)
    err = capsys.readouterr().err
    assert "error: argument --kv-cache-memory-bytes: " in err and error in err and repr(value) in err


def test_a_kv_cache_memory_bytes_short_of_one_sequence_stops_the_server_by_name(
    tiny_dense: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """`deltaserve serve --kv-cache-memory-bytes 64k` on a tiny checkpoint, too little for one 64-token sequence:
    exits 1 at start-up with one line naming the flag's field and max_model_len, as vLLM refuses."""
    monkeypatch.setenv("DELTASERVE_ENABLE_MULTIPROCESSING", "0")  # the engine core on a thread: no process to start
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)  # a server that did start returns 0, not serves on
    argv = (str(tiny_dense), "--kv-cache-memory-bytes", "64k", "--max-model-len", "64", "--port", "0")
    assert cli.run(parse(*argv, "--device", "cpu")) == 1
    (error,) = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert "kv_cache_memory_bytes (64000 bytes, 0.00 GiB) is not enough for max_model_len (64)" in error, error


def test_accepted_flags_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    check_compat(parse("m", "--kv-cache-dtype", "fp8", "--mamba-ssm-cache-dtype", "float32", "--enable-dbo"))
    messages = {record.getMessage(): record.levelname for record in caplog.records}
    assert messages["accepting --kv-cache-dtype fp8 without honouring it: the KV cache is kept in the model dtype"] \
        == "WARNING"  # fmt: skip
    assert any(m.startswith("ignoring --mamba-ssm-cache-dtype float32") for m in messages)
    assert any(m.startswith("ignoring --enable-dbo") and level == "INFO" for m, level in messages.items())


RECIPES = [
    "Qwen/Qwen3.5-27B-FP8 --language-model-only --reasoning-parser qwen3 --enable-prefix-caching",
    "Qwen/Qwen3.6-35B-A3B --kv-cache-dtype fp8 --moe-backend marlin --gpu-memory-utilization 0.5 --max-model-len "
    "262144 --max-num-seqs 8 --max-num-batched-tokens 8192 --enable-chunked-prefill --async-scheduling "
    '--enable-prefix-caching --speculative-config {"method":"mtp","num_speculative_tokens":3} --load-format '
    "fastsafetensors --reasoning-parser qwen3 --tool-call-parser qwen3_coder --enable-auto-tool-choice",
    "Qwen/Qwen3-Next-80B-A3B-Instruct -tp 1 --tool-call-parser hermes --enable-auto-tool-choice --no-enable-chunked-"
    "prefill --compilation_config.cudagraph_mode=PIECEWISE --speculative-config "
    '{"method":"qwen3_next_mtp","num_speculative_tokens":2}',
    "m --host 0.0.0.0 --port 4015 --served-model-name=Qwen3 --max_num_seqs=64 --max_model_len=10240 "
    "--gpu-memory-utilization=0.85 --disable-fastapi-docs --disable-log-requests --disable-uvicorn-access-log -O3",
]


@pytest.mark.parametrize("recipe", RECIPES)
def test_vllm_launch_lines_run_unchanged(recipe: str) -> None:
    args = parse(*recipe.split())
    check_compat(args)
    model, device = cli.resolve_model(args)
    cli.build_engine_config(args, model, device)
    settings = cli.build_settings(args, model)
    assert settings.model_root == recipe.split()[0]


def test_underscores_and_config_file(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9001\nmax_num_seqs: 7\nenable-prefix-caching: true\nserved-model-name: [a, b]\n"
                      "speculative-config:\n  method: mtp\n")  # fmt: skip
    args = parse("m", "--config", str(config), "--max-num-seqs", "9")
    assert (args.port, args.max_num_seqs, args.served_model_name) == (9001, 9, ["a", "b"])
    assert args.enable_prefix_caching and json.loads(args.speculative_config) == {"method": "mtp"}
    with pytest.raises(ValueError, match="YAML"):
        cli.normalize_argv(["m", "--config", str(tmp_path / "serve.json")])


def test_bad_server_flags_are_refused(tmp_path: Path) -> None:
    for argv, message in ((["--ssl-keyfile", KEY], "go together"), (["--ssl-keyfile", KEY, "--ssl-certfile", "nope"],
                          "no such file"), (["--root-path", "api"], "start with"), (["--middleware", "no.such.Thing"],
                          "cannot import"), (["--ssl-cert-reqs", "5"], "0, 1 or 2")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            cli.build_settings(parse("m", *argv), "m")
    with pytest.raises(SystemExit):
        parse("m", "--max-request-body-bytes", "0")


def test_uvicorn_options_from_flags(tmp_path: Path) -> None:
    log_config = tmp_path / "log.json"
    log_config.write_text(json.dumps({"version": 1, "disable_existing_loggers": False}))
    options = cli.uvicorn_config_options(parse(
        "m", "--ssl-keyfile", KEY, "--ssl-certfile", CERT, "--ssl-ca-certs", CERT, "--ssl-cert-reqs", "2",
        "--ssl-ciphers", "ECDHE+AESGCM", "--h11-max-incomplete-event-size", "8192", "--log-config-file",
        str(log_config), "--uds", "/tmp/x.sock",
    ))  # fmt: skip
    assert options["ssl_certfile"] == CERT and options["ssl_cert_reqs"] == 2 and options["ssl_ciphers"]
    assert options["uds"] == "/tmp/x.sock" and "port" not in options
    assert options["h11_max_incomplete_event_size"] == 8192 and options["log_config"]["version"] == 1
    assert options["timeout_keep_alive"] == 5 and options["timeout_graceful_shutdown"] == 30
    assert options["http"].header_timeout_s == 20
    timed = cli.uvicorn_config_options(parse(
        "m", "--timeout-keep-alive", "7", "--timeout-graceful-shutdown", "3", "--timeout-request-header", "0.5",
    ))  # fmt: skip
    assert timed["timeout_keep_alive"] == 7 and timed["timeout_graceful_shutdown"] == 3
    # vLLM's --shutdown-timeout replaces the drain bound where given: 0 closes in-flight requests at once
    for given, bound in (("0", 0.0), ("45", 45.0)):
        drained = parse("m", "--timeout-graceful-shutdown", "3", "--shutdown-timeout", given)
        assert cli.uvicorn_config_options(drained)["timeout_graceful_shutdown"] == bound
    for refused in ("-1", "1.5"):
        with pytest.raises(SystemExit):
            parse("m", "--shutdown-timeout", refused)
    assert timed["http"].header_timeout_s == 0.5
    assert cli.build_settings(parse("m", "--timeout-request-body", "2"), "m").body_read_timeout_s == 2
    with pytest.raises(SystemExit):
        parse("m", "--timeout-request-body", "0")


def test_access_log_filter() -> None:
    log_filter = cli.AccessLogFilter(["/health", "/metrics"])

    def record(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:1", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    assert not log_filter.filter(record("/health")) and not log_filter.filter(record("/metrics?x=1"))
    assert log_filter.filter(record("/v1/models"))


def test_root_path(fake_engine: FakeEngine) -> None:
    server = serve(fake_engine, root_path="/api", api_keys=["k"])
    try:
        headers = {"Authorization": "Bearer k"}
        for path in ("/api/v1/models", "/v1/models"):  # a proxy may or may not strip the prefix
            assert httpx.get(server.base_url + path, headers=headers).json()["data"][0]["id"] == MODEL_NAME
            assert httpx.get(server.base_url + path).status_code == 401
        assert httpx.get(server.base_url + "/api/health").status_code == 200
        client = openai.OpenAI(base_url=server.base_url + "/api/v1", api_key="k", max_retries=0)
        assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1).choices
    finally:
        server.stop()


def client_context(with_client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=CERT)
    if with_client_cert:
        context.load_cert_chain(CERT, KEY)
    return context


def test_tls(fake_engine: FakeEngine) -> None:
    options = cli.uvicorn_config_options(parse("m", "--ssl-keyfile", KEY, "--ssl-certfile", CERT))
    tls = {key: value for key, value in options.items() if key.startswith("ssl_")}
    server = serve(fake_engine, client_context(), tls)
    try:
        assert server.base_url.startswith("https://")
        http_client = httpx.Client(verify=client_context())
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, http_client=http_client)
        assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1).choices
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.base_url + "/health")  # the certificate is not in the default trust store
    finally:
        server.stop()


def test_tls_client_certificates_required(fake_engine: FakeEngine) -> None:
    argv = ("m", "--ssl-keyfile", KEY, "--ssl-certfile", CERT, "--ssl-ca-certs", CERT, "--ssl-cert-reqs", "2")
    tls = {key: value for key, value in cli.uvicorn_config_options(parse(*argv)).items() if key.startswith("ssl_")}
    server = serve(fake_engine, client_context(with_client_cert=True), tls)
    try:
        assert httpx.get(server.base_url + "/health", verify=client_context(True)).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.base_url + "/health", verify=client_context(False))
    finally:
        server.stop()


@pytest.fixture(scope="module")
def flag_server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    server = serve(
        fake_engine, enable_request_id_headers=True, trust_request_chat_template=True,
        enable_tokenizer_info_endpoint=True, disable_fastapi_docs=True, max_logprobs=2, response_role="bot",
        return_tokens_as_token_ids=True, exclude_tools_when_tool_choice_none=True,
        chat_template_content_format="openai", api_keys=["k"],
    )  # fmt: skip
    yield server
    server.stop()


def post(server: ServerThread, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers={"Authorization": "Bearer k", **headers}, timeout=30)


def test_request_id_headers(flag_server: ServerThread, http: httpx.Client) -> None:
    response = post(flag_server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, **{"X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123" and response.json()["id"] == "cmpl-abc-123"
    generated = post(flag_server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).headers["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0
    assert len(httpx.get(flag_server.base_url + "/v1/models").headers["x-request-id"]) == 32  # on a 401 too
    streamed = post(flag_server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True},
                    **{"X-Request-Id": "s-1"})  # fmt: skip
    assert streamed.headers["x-request-id"] == "s-1"
    assert "x-request-id" not in http.get("/health").headers  # off by default


def test_trusted_request_template(flag_server: ServerThread, fake_engine: FakeEngine) -> None:
    body = {"messages": USER, "max_tokens": 1,
            "chat_template": "[{{ messages[0].content is string }}][{{ messages[0].content[0].text }}]"}  # fmt: skip
    assert post(flag_server, "/v1/chat/completions", body).status_code == 200
    # --chat-template-content-format openai: the template sees a list of text parts.
    assert fake_engine.tokenizer.decode(fake_engine.last_prompt_ids) == "[False][Hi]"


def test_tokenizer_info(flag_server: ServerThread, fake_engine: FakeEngine, http: httpx.Client) -> None:
    info = httpx.get(flag_server.base_url + "/tokenizer_info", headers={"Authorization": "Bearer k"}).json()
    assert info["tokenizer_class"] == type(fake_engine.tokenizer).__name__
    assert info["chat_template"] == fake_engine.tokenizer.chat_template
    assert not any("file" in key or "path" in key for key in info)
    assert http.get("/tokenizer_info").status_code == 404


def test_docs_can_be_disabled(flag_server: ServerThread, http: httpx.Client) -> None:
    assert http.get("/docs").status_code == 200 and http.get("/openapi.json").status_code == 200
    headers = {"Authorization": "Bearer k"}
    assert httpx.get(flag_server.base_url + "/docs", headers=headers).status_code == 404
    assert httpx.get(flag_server.base_url + "/openapi.json", headers=headers).status_code == 404


def test_max_logprobs_role_and_token_ids(flag_server: ServerThread) -> None:
    refused = post(flag_server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    body = post(flag_server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 2}).json()
    assert body["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    chat = post(flag_server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1}).json()
    assert chat["choices"][0]["message"]["role"] == "bot"


def test_exclude_tools_when_tool_choice_none(flag_server: ServerThread, fake_engine: FakeEngine) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    post(
        flag_server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, "tools": tools, "tool_choice": "none"}
    )
    assert "get_weather" not in fake_engine.tokenizer.decode(fake_engine.last_prompt_ids)


class HeaderMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message["headers"], (b"x-test-middleware", b"class")]
            await send(message)

        await self.app(scope, receive, tagged)


async def header_function(request: Any, call_next: Any) -> Any:
    response = await call_next(request)
    response.headers["x-test-function"] = "function"
    return response


def test_user_middleware(fake_engine: FakeEngine) -> None:
    settings = ServerSettings(model_root="m", served_model_names=[MODEL_NAME])
    app = build_app(fake_engine, settings)
    module = "api.test_api_flags" if __name__ == "api.test_api_flags" else __name__
    cli.add_user_middleware(app, [f"{module}.HeaderMiddleware", f"{module}.header_function"])
    server = ServerThread(app).start()
    try:
        response = httpx.get(server.base_url + "/v1/models")
        assert response.headers["x-test-middleware"] == "class" and response.headers["x-test-function"] == "function"
    finally:
        server.stop()
