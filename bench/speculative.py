"""Speculative decoding on and off, side by side: the issue's targets in one run.

Starts one server without speculation (``--speculative-algorithm none``: launch.py's default drafts
on CPUs) and one with ``--speculative-algorithm ngram`` (every other flag the same; unknown flags go
to both), both up at once (an idle server's threads sleep), and runs
each scenario on one then the other, ``--repeat`` times, so that the machine's drift falls on both
alike; the table has the medians:

* ``repeat`` (chat answers that quote their prompt, bench/workloads.py) one request at a time:
  time per output token p50 (TPOT: the stream's per-chunk ITL p50 is ~0 with speculation, as
  each accepted token goes out as its own output; target: on <= 0.5x off);
* ``repeat`` at 16 concurrent requests (32 in all): output tokens/s (target: on >= off);
* ``uniform`` (random token ids) one at a time and at 16 (32 in all): TPOT and throughput
  (target: on >= 0.95x off).

Greedy everywhere, so both servers produce the same tokens and do the same useful work.

    python -m bench.speculative --model smollm2 --device cpu --dtype float32 --cpus 0-1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_output_path, machine_info, parse_cpu_list, pin_threads, print_table, write_json
from bench.serving import add_model_args, add_pinning_args, benchmark_workloads, resolve_model_path, server_for
from bench.workloads import make_workload, token_range_for

# (label, workload name, its parameters, concurrency, the figure compared)
SCENARIOS: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("repeat, 1 at a time", "repeat", {"num_requests": 8, "max_new_tokens": 112}, 1, "tpot_p50_ms"),
    ("repeat, 16 concurrent", "repeat", {"num_requests": 32, "max_new_tokens": 112}, 16, "output_tok_s"),
    ("uniform, 1 at a time", "uniform", {"num_requests": 4, "prompt_len": 128, "max_new_tokens": 40}, 1, "tpot_p50_ms"),
    (
        "uniform, 16 concurrent",
        "uniform",
        {"num_requests": 32, "prompt_len": 128, "max_new_tokens": 64},
        16,
        "output_tok_s",
    ),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any other flag is passed to launch.py, for both servers.",
    )
    add_model_args(parser)
    add_pinning_args(parser)
    parser.add_argument(
        "--num-draft-tokens", type=int, default=8, help="--speculative-num-draft-tokens (default 8, the server's)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each scenario on each server (medians)")
    parser.add_argument(
        "--scenario",
        type=int,
        nargs="*",
        default=None,
        help=f"indices of the scenarios to run (default all: {len(SCENARIOS)})",
    )
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/speculative_<time>.json)")
    args, server_flags = parser.parse_known_args(argv)
    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    model_path = resolve_model_path(args)
    low, high = token_range_for(model_path)
    scenarios = [SCENARIOS[i] for i in args.scenario] if args.scenario else SCENARIOS
    spec_flags = ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", str(args.num_draft_tokens)]
    results: dict[str, list[list[dict[str, Any]]]] = {"off": [[] for _ in scenarios], "on": [[] for _ in scenarios]}
    with (
        # (off explicitly: launch.py's default, auto, drafts on CPUs)
        server_for(None, model_path, [*server_flags, "--speculative-algorithm", "none"], None, pinning) as off_server,
        server_for(None, model_path, [*server_flags, *spec_flags], None, pinning) as on_server,
    ):
        for _ in range(args.repeat):
            for i, (_, name, params, conc, _) in enumerate(scenarios):
                for label, handle in (("off", off_server), ("on", on_server)):
                    results[label][i].append(
                        benchmark_workloads(
                            handle,
                            [make_workload(name, **params, vocab_low=low, vocab_high=high)],
                            request_rate=math.inf,
                            max_concurrency=conc,
                            stream=True,
                            seed=0,
                            warmup=-1,
                            timeout=None,
                        )[0]
                    )
    rows = []
    for i, (label, _, _, _, key) in enumerate(scenarios):

        def median(side: str, figure: str) -> float:
            values = [run["metrics"].get(figure) for run in results[side][i]]
            return (
                statistics.median(v for v in values if v is not None)
                if any(v is not None for v in values)
                else math.nan
            )

        off, on = median("off", key), median("on", key)
        rows.append(
            {
                "scenario": label,
                "figure": key,
                "off": off,
                "on": on,
                "on/off": on / off if off else math.nan,
                "on/off each": " ".join(
                    f"{b['metrics'][key] / a['metrics'][key]:.2f}" for a, b in zip(results["off"][i], results["on"][i])
                ),
                "off tok/s": median("off", "output_tok_s"),
                "on tok/s": median("on", "output_tok_s"),
                "accept len": median("on", "spec_accept_length"),
                "accept rate": median("on", "spec_accept_rate"),
            }
        )
    columns = [(k, k) for k in rows[0]] if rows else []
    print_table(
        rows,
        columns,
        title=f"speculative decoding (ngram, K={args.num_draft_tokens}) on vs off, medians of {args.repeat}",
    )
    out = write_json(
        args.output or default_output_path("speculative", "on-off"),
        {"kind": "speculative", "machine": machine_info(pinning), "rows": rows, "runs": results},
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
