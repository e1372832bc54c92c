"""``ServerArgs``: every server flag's value, the parser that fills it and the order its checks run in.

The flags themselves (names, defaults' wording, help text, checks) live in one module per flag
group (``model_args``, ``front_door_args``, ``logging_args``, ``execution_args``, ``memory_args``,
``scheduling_args``, ``output_args``, ``parallel_args``, ``spec_args``, ``lora_args``), so that adding a flag
touches its group and this dataclass only. ``ServerArgs`` stays one plain dataclass (not one per
group) because it is handed to spawned child processes, printed in server info and rebuilt from
flags by tests: one flat object keeps all of that trivial. Importers use ``runtime.config.args``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from runtime.config import (
    execution_args,
    front_door_args,
    logging_args,
    lora_args,
    memory_args,
    model_args,
    output_args,
    parallel_args,
    scheduling_args,
    spec_args,
)
from runtime.config.flag_checks import positive
from runtime.config.version import package_version


@dataclass
class ServerArgs:
    """Every server flag; ``from_cli`` parses them, ``validate`` checks them."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"
    dtype: str = "auto"
    # None or "none": weights dense in --dtype (a GGUF file's dequantized); "auto" (launch.py's default):
    # the CPU's choice (runtime.engine.quant.loading.resolve_quantization)
    quantization: str | None = None
    quantized_activations: str = "none"  # kept-quantized weights' numerics on a CPU: none (weight-only) or int8
    tp_size: int = 1
    ep_size: int = 1  # of the tp_size ranks: groups that each hold whole experts (a mixture of experts)
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    attention_backend: str = "auto"
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = 8192
    page_size: int = 1
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    priority_preemption: bool = False
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: str = "write_through"
    kv_cache_dtype: str = "auto"  # the KV cache's format: auto (the model's dtype), bf16, fp8_e4m3, fp8_e5m2, int8
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    context_length: int | None = None
    stream_interval: int = 1
    random_seed: int | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None
    api_key: str | None = None
    log_level: str = "info"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    enable_mixed_chunk: bool = False
    grammar_backend: str = "xgrammar"
    grammar_compile_timeout: float = 60.0
    disable_jump_forward: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # None: overlap where it pays (see scheduler_proc.model_worker.overlap_default); True/False: forced.
    disable_overlap_schedule: bool | None = None
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    revision: str | None = None
    http_port: int | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    # Where unset sampling fields come from (runtime/config/model_args.py): the model's, or OpenAI's.
    sampling_defaults: str = "model"
    is_embedding: bool = False  # serve embeddings / scores: prefill only (runtime.checkpoints.pooling)
    pooling: str | None = None  # --pooling: mean | cls | last; None: the folder's rule
    enable_metrics: bool = False
    log_requests: bool = False
    decode_log_interval: int = 40
    # Seconds one scheduler step may run before its process dumps its stacks and exits (scheduler_proc.watchdog).
    watchdog_timeout: float = 300.0
    max_requests_per_client: int = 4096
    max_controls_per_client: int = 16
    max_request_bytes: int | None = None
    graceful_shutdown_timeout: float = 30.0
    # Responses kept for /v1/responses' previous_response_id and GET (tokenizer_proc/response_store.py); 0: none.
    responses_store_size: int = 1000
    # Production lifecycle (scheduler_proc/queue_bound.py, scheduler_proc/deadlines.py): None = unbounded / none.
    max_queued_requests: int | None = None
    request_timeout: float | None = None
    # Speculative decoding (runtime/config/spec_args.py: the flags; scheduler_proc/spec: the work). None or
    # "none": off; "auto" (launch.py's default): the device's choice (resolve_speculative_algorithm).
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 8
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # Most tokens one verify step feeds the model (its requests' last tokens plus drafts); None: the
    # device's default (ServingPlatform.spec_step_tokens).
    speculative_max_step_tokens: int | None = None
    speculative_ngram_capacity: int = 0  # runs kept across requests (scheduler_proc/spec/ngram_table.py); 0: off
    # LoRA adapters (runtime/config/lora_args.py: the flags; runtime/engine/lora and scheduler_proc/lora_slots.py:
    # the work). None: off unless --lora-paths names adapters.
    enable_lora: bool | None = None
    lora_paths: list[str] | None = None
    max_loras_per_batch: int = lora_args.DEFAULT_MAX_LORAS_PER_BATCH
    max_loaded_loras: int | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None

    # ------------------------------------------------------------------ CLI

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (same name, dashes for underscores), each with help text, in
        argument groups so that ``--help`` reads by topic."""
        d = ServerArgs()
        model_args.add_model_args(parser, d)
        front_door_args.add_front_door_args(parser, d)
        logging_args.add_logging_args(parser, d)
        execution_args.add_execution_args(parser, d)
        memory_args.add_memory_args(parser, d)
        scheduling_args.add_scheduling_args(parser, d)
        output_args.add_output_args(parser, d)
        parallel_args.add_parallel_args(parser, d)
        spec_args.add_spec_args(parser, d)
        lora_args.add_lora_args(parser, d)

    @classmethod
    def make_parser(cls) -> argparse.ArgumentParser:
        """The ``tinyserve`` command line (``--version`` and every group's flags)."""
        parser = argparse.ArgumentParser(
            prog="tinyserve",  # the console script; `python launch.py` is the same program
            description="Start a tinyserve server: tokenizer, scheduler and detokenizer processes. "
            "Prints 'ready: tcp://HOST:PORT' once it accepts requests.",
        )
        parser.add_argument("--version", action="version", version=f"tinyserve {package_version()}")
        cls.add_cli_args(parser)
        return parser

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None) -> "ServerArgs":
        """Parse and validate ``argv``; a bad flag exits with status 2 and a usage message."""
        parser = cls.make_parser()
        ns = parser.parse_args(argv)
        args = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
        try:
            args.validate()
        except ValueError as exc:
            parser.error(str(exc))
        return args

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise ValueError naming the flag when a value is out of range or inconsistent.

        Runs ``CHECKS`` in order: each check lives beside its flags, the order is kept here
        because only the first failure is reported (see ``CHECKS``)."""
        for check in CHECKS:
            check(self)

    # ------------------------------------------------------------------ derived

    def resolved_model_path(self) -> str:
        """The checkpoint folder to load: ``model_path`` once ``launch.py`` has resolved it
        (runtime.checkpoints.model_source), else the default model's folder (prepared on first use)."""
        if self.model_path is not None:
            return self.model_path
        from runtime.checkpoints.model_source import checkpoint_folder

        return str(checkpoint_folder(None))

    def resolved_tokenizer_path(self) -> str:
        """--tokenizer-path, else the model's own tokenizer."""
        return self.tokenizer_path if self.tokenizer_path is not None else self.resolved_model_path()

    def resolved_http_port(self) -> int:
        """--http-port, else next to the ZMQ port (SGLang serves HTTP on --port itself; here
        --port stays the ZMQ front door, so existing clients keep working)."""
        if self.http_port is not None:
            return self.http_port
        return self.port + 1 if self.port else 0

    @property
    def chunked_prefill_enabled(self) -> bool:
        """-1, 0 and None all mean "no chunking" (SGLang's spellings)."""
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0

    def client_address(self) -> str:
        """The ``tcp://`` address clients connect to (IPv6 hosts in brackets)."""
        return endpoint("tcp", self.host, self.port)

    def redacted(self) -> dict[str, object]:
        """Field values for server info, without the api key."""
        d = dataclasses.asdict(self)
        if d["api_key"] is not None:
            d["api_key"] = "<set>"
        return d


def endpoint(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port``, an IPv6 host in brackets (the ZMQ and HTTP addresses printed)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def check_counts(args: ServerArgs) -> None:
    """Every flag that counts something must be >= 1 when set. The list spans the groups because
    it is one step of ``CHECKS``: split by group it would report a different flag first."""
    for flag, value in (
        ("--tp-size", args.tp_size),
        ("--ep-size", args.ep_size),
        ("--dp-size", args.dp_size),
        ("--max-prefill-tokens", args.max_prefill_tokens),
        ("--stream-interval", args.stream_interval),
        ("--nnodes", args.nnodes),
        ("--gpu-id-step", args.gpu_id_step),
        ("--decode-log-interval", args.decode_log_interval),
        ("--max-requests-per-client", args.max_requests_per_client),
        ("--max-controls-per-client", args.max_controls_per_client),
    ):
        positive(flag, value)
    for flag, opt in (
        ("--max-total-tokens", args.max_total_tokens),
        ("--max-running-requests", args.max_running_requests),
        ("--context-length", args.context_length),
        ("--cuda-graph-max-bs", args.cuda_graph_max_bs),
        ("--max-request-bytes", args.max_request_bytes),
        ("--max-queued-requests", args.max_queued_requests),
    ):
        if opt is not None:
            positive(flag, opt)


# Every check ``validate`` runs, in order. Only the first failure is reported, so this order decides
# which message a command line with several mistakes gets; it is the order the checks had before the
# flags were split by group (tests and users see the same errors), hence the groups interleave.
CHECKS: tuple[Callable[[ServerArgs], None], ...] = (
    execution_args.check_device_and_dtype,
    parallel_args.check_load_balance_method,
    execution_args.check_attention_backend,
    scheduling_args.check_schedule_policy,
    memory_args.check_cache_policies,
    logging_args.check_log_level,
    model_args.check_model_paths,
    output_args.check_parsers,
    model_args.check_chat_template,
    model_args.check_sampling_defaults,
    model_args.check_embedding,
    front_door_args.check_addresses,
    check_counts,
    front_door_args.check_timeouts,
    front_door_args.check_responses_store_size,
    output_args.check_grammar_compile_timeout,
    logging_args.check_watchdog_timeout,
    execution_args.check_cuda_graph_bs,
    scheduling_args.check_chunked_prefill_size,
    memory_args.check_page_size,
    scheduling_args.check_prefill_fits_pages,
    memory_args.check_mem_fraction,
    parallel_args.check_topology,
    memory_args.check_cache_tiers,
    front_door_args.check_api_key,
    spec_args.check_spec,
    lora_args.check_lora,
)
