"""Overload: requests arriving faster than the server can serve them, with a bounded queue.

Without ``--max-queued-requests`` every request is queued, and while arrivals outpace the
server its queue, and every newcomer's time to first token, grow without bound. With it the
server refuses what it cannot queue (``overloaded``, HTTP 503 + Retry-After) at once, and the
requests it admits keep a bounded TTFT. Three runs:

1. capacity, on a server with the same flags but no queue bound (a closed loop's burst would
   otherwise be refused faster than it is served): ``--capacity-requests`` requests,
   ``--capacity-concurrency`` at a time: completed requests/s;
2. on the bounded server, Poisson arrivals at ``--low`` x capacity (0.8) for ``--duration`` s;
3. the same at ``--high`` x capacity (2.0).

The table has, per load: requests sent, admitted (completed), refused (``overloaded``), TTFT
p50/p99 of the admitted, and how long a refusal took (p50/p99); below it, the ratio of p99
TTFT at the high load to the low one (the issue's target: <= 3) and the refusal p99 (< 50 ms).

    python -m bench.overload --model smollm2 --max-queued-requests 8 --max-running-requests 16 --device cpu
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from bench.common import (
    default_output_path,
    machine_info,
    parse_cpu_list,
    percentile,
    pin_threads,
    print_table,
    write_json,
)
from bench.load_runner import RequestRecord, run_workload
from bench.serving import add_model_args, add_pinning_args, flush_cache, resolve_model_path, server_for, summarize_run
from bench.workloads import make_workload, token_range_for

OVERLOADED = "overloaded"


def load_row(label: str, rate: float, records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """One load's figures (pure: unit-tested)."""
    metrics = summarize_run(records, duration)
    refused = [r.latency * 1e3 for r in records if r.error == OVERLOADED and r.latency is not None]
    other = sorted({r.error for r in records if r.error not in (None, OVERLOADED)})
    return {
        "load": label,
        "rate": rate,
        "sent": len(records),
        "admitted": metrics["completed"],
        "refused": len(refused),
        "other_errors": ",".join(other) or "-",
        "ttft_p50_ms": metrics["ttft_p50_ms"],
        "ttft_p99_ms": metrics["ttft_p99_ms"],
        "refusal_p50_ms": percentile(refused, 50) if refused else float("nan"),
        "refusal_p99_ms": percentile(refused, 99) if refused else float("nan"),
        "out_tok_s": metrics["output_tok_s"],
    }


COLUMNS = [
    ("load", "load"),
    ("rate", "req/s"),
    ("sent", "sent"),
    ("admitted", "admitted"),
    ("refused", "refused"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("refusal_p50_ms", "refusal p50 ms"),
    ("refusal_p99_ms", "refusal p99 ms"),
    ("out_tok_s", "out tok/s"),
    ("other_errors", "other errors"),
]


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any other flag (e.g. --device cpu) is passed to launch.py.",
    )
    add_model_args(parser)
    parser.add_argument("--max-queued-requests", type=int, default=16, help="the server's queue bound (default 16)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per load (default 60)")
    parser.add_argument("--low", type=float, default=0.8, help="the light load, x capacity (default 0.8)")
    parser.add_argument("--high", type=float, default=2.0, help="the overload, x capacity (default 2.0)")
    parser.add_argument("--capacity-requests", type=int, default=64, help="requests of the capacity run (default 64)")
    parser.add_argument(
        "--capacity-concurrency",
        type=int,
        default=16,
        help="requests in flight in the capacity run (default 16; at most running + queued)",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    add_pinning_args(parser)
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/overload_<time>.json)")
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args, server_flags = parse_args(argv)
    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    model_path = resolve_model_path(args)
    flags = [*server_flags, "--max-queued-requests", str(args.max_queued_requests)]

    def workload(n: int, seed: int, handle: Any) -> Any:
        low, high = token_range_for(handle.model_path, handle.vocab_size)
        return make_workload(
            "uniform",
            num_requests=n,
            prompt_len=args.prompt_len,
            max_new_tokens=args.max_new_tokens,
            seed=seed,
            vocab_low=low,
            vocab_high=high,
        )

    with server_for(None, model_path, server_flags, None, pinning) as handle:
        records, duration = run_workload(
            handle.address,
            workload(args.capacity_requests, args.seed, handle),
            max_concurrency=args.capacity_concurrency,
        )
    capacity = summarize_run(records, duration)["request_throughput"]
    rows = [load_row("capacity", float("inf"), records, duration)]
    with server_for(None, model_path, flags, None, pinning) as handle:
        for i, factor in enumerate((args.low, args.high)):
            flush_cache(handle.address, None)
            rate = factor * capacity
            records, duration = run_workload(
                handle.address,
                workload(max(1, round(rate * args.duration)), args.seed + 1 + i, handle),
                request_rate=rate,
            )
            rows.append(load_row(f"{factor:g}x", rate, records, duration))
    print_table(
        rows,
        COLUMNS,
        title=f"overload (--max-queued-requests {args.max_queued_requests}, capacity {capacity:.2f} req/s)",
    )
    ratio = rows[2]["ttft_p99_ms"] / rows[1]["ttft_p99_ms"]
    print(
        f"\np99 TTFT {args.high:g}x / {args.low:g}x: {ratio:.2f} (target <= 3); refusal p99 at {args.high:g}x: "
        f"{rows[2]['refusal_p99_ms']:.1f} ms (target < 50)"
    )
    out = write_json(
        args.output or default_output_path("overload", "uniform"),
        {
            "kind": "overload",
            "rows": rows,
            "ratio_p99_ttft": ratio,
            "machine": machine_info(pinning),
            "server_flags": flags,
            "model_path": model_path,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
