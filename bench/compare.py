"""tinyserve vs a baseline (transformers ``generate``, or vLLM's offline engine), back to back, under one pinning.

One invocation pins this process (cpu affinity + torch threads), starts a server
(which inherits the affinity and gets the same thread count via OMP_NUM_THREADS),
runs each workload ``--repeat`` times against it, stops it, then loads the same
checkpoint in transformers with the same dtype and runs the same workloads
``--repeat`` times. Rows are the medians over the repeats; the ratio row is
tinyserve / baseline (above 1 means tinyserve is faster).

    python -m bench.compare --model bench --workload uniform shared-prefix --repeat 3 --device cpu
    python -m bench.compare --model bench --workload uniform shared-prefix --device cpu \
        --baseline vllm --vllm-python /path/to/vllm-venv/bin/python

With ``--baseline vllm`` the baseline is vLLM's offline engine in the Python given by
``--vllm-python`` (see bench/vllm_baseline.py), run after tinyserve's server has stopped:
one engine at a time.

Flags it does not know are passed to launch.py.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    default_output_path,
    machine_info,
    median_of_runs,
    parse_cpu_list,
    pin_threads,
    print_table,
    write_json,
)

MEDIAN_KEYS = ("duration_s", "output_tok_s", "total_tok_s", "request_throughput", "ttft_p50_ms", "ttft_p99_ms",
               "itl_p50_ms", "itl_p99_ms", "latency_p50_s", "latency_p99_s", "cache_hit_rate")
RATIO_KEYS = ("output_tok_s", "total_tok_s", "request_throughput")

COLUMNS = [("engine", "engine"), ("workload", "workload"), ("repeats", "n"), ("duration_s", "time s"),
           ("output_tok_s", "out tok/s"), ("total_tok_s", "total tok/s"), ("ttft_p50_ms", "TTFT p50 ms"),
           ("ttft_p99_ms", "TTFT p99 ms"), ("itl_p50_ms", "ITL p50 ms"), ("itl_p99_ms", "ITL p99 ms"),
           ("latency_p50_s", "lat p50 s"), ("cache_hit_rate", "cache hit")]


def summarize_comparison(runs: list[dict[str, Any]], ours: str, baseline: str) -> list[dict[str, Any]]:
    """Median rows per (workload, engine) and a ratio row per workload (pure)."""
    rows: list[dict[str, Any]] = []
    workloads = list(dict.fromkeys(r["workload"]["name"] for r in runs))
    for wl in workloads:
        medians: dict[str, dict[str, float]] = {}
        for engine in (ours, baseline):
            sel = [r["metrics"] for r in runs if r["engine"] == engine and r["workload"]["name"] == wl]
            if not sel:
                continue
            medians[engine] = median_of_runs(sel, MEDIAN_KEYS)
            rows.append({"engine": engine, "workload": wl, "repeats": len(sel), **medians[engine]})
        if ours in medians and baseline in medians:
            ratio: dict[str, Any] = {"engine": f"ratio {ours}/{baseline}", "workload": wl}
            for key in RATIO_KEYS:
                a, b = medians[ours].get(key, math.nan), medians[baseline].get(key, math.nan)
                ratio[key] = a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan
            ratio["duration_s"] = (medians[baseline]["duration_s"] / medians[ours]["duration_s"]
                                   if medians[ours].get("duration_s") else math.nan)  # speed-up
            rows.append(ratio)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from bench import hf_baseline, serving, vllm_baseline
    from bench.roofline import ModelDims

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog="Any other flag is passed to launch.py.")
    serving.add_model_args(parser)
    serving.add_workload_args(parser)
    parser.add_argument("--repeat", type=int, default=3, help="runs per engine and workload; medians are quoted")
    parser.add_argument("--device", default="auto", help="both engines (auto: cuda when available)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="both engines")
    parser.add_argument("--batch-size", type=int, default=hf_baseline.DEFAULT_BATCH_SIZE, help="baseline batch size")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="tinyserve arrivals (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="tinyserve requests in flight")
    parser.add_argument("--no-stream", action="store_true",
                        help="tinyserve requests without streaming (whole outputs, as the offline baselines "
                             "return them; no TTFT / ITL)")
    parser.add_argument("--warmup", type=int, default=-1,
                        help="warm-up requests before each run (2 tokens each); -1: the whole workload (default)")
    parser.add_argument("--baseline", choices=("transformers", "vllm"), default="transformers",
                        help="the engine to compare with (default transformers)")
    parser.add_argument("--vllm-python", default=None,
                        help="with --baseline vllm: a Python interpreter that can import vllm")
    parser.add_argument("--skip-baseline", action="store_true", help="only tinyserve")
    parser.add_argument("--skip-ours", action="store_true", help="only the baseline")
    serving.add_pinning_args(parser)
    parser.add_argument("--output", default=None,
                        help="JSON path (default bench/results/compare_<workloads>_<time>.json)")
    args, server_flags = parser.parse_known_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.baseline == "vllm" and not args.skip_baseline and not args.vllm_python:
        parser.error("--baseline vllm needs --vllm-python")

    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    model_path = serving.resolve_model_path(args)
    workloads = serving.build_workloads(args, model_path)
    dims = ModelDims.from_path(model_path).as_dict()
    machine = machine_info(pinning)
    runs: list[dict[str, Any]] = []

    if not args.skip_ours:
        flags = ["--device", args.device, "--dtype", args.dtype, *server_flags]
        with serving.server_for(None, model_path, flags, None, pinning) as handle:
            for rep in range(args.repeat):
                for run in serving.benchmark_workloads(
                        handle, workloads, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                        stream=not args.no_stream, seed=args.seed, warmup=args.warmup, timeout=None):
                    run.update(repeat=rep, machine=machine)
                    run.pop("requests", None)  # medians only; serving.py keeps per-request records
                    runs.append(run)
    if not args.skip_baseline and args.baseline == "vllm":
        for run in vllm_baseline.run_vllm_baseline(args.vllm_python, model_path, workloads, args.dtype, args.repeat,
                                                   pinning.cpus):
            run.update(machine=machine)
            runs.append(run)
    elif not args.skip_baseline:
        runner = hf_baseline.HFRunner(model_path, args.device, args.dtype)
        for rep in range(args.repeat):
            for wl in workloads:
                runner.warm_up(wl, args.batch_size, args.warmup)
                run = hf_baseline.run_baseline(runner, wl, args.batch_size, dims, model_path)
                run.update(repeat=rep, machine=machine)
                runs.append(run)
        del runner

    baseline = vllm_baseline.ENGINE if args.baseline == "vllm" else hf_baseline.ENGINE
    rows = summarize_comparison(runs, serving.ENGINE, baseline)
    print_table(rows, COLUMNS, title=f"tinyserve vs {args.baseline} (medians of {args.repeat}; "
                                     f"{pinning.num_threads} threads on cpus {pinning.cpus})")
    print("ratio row: tok/s columns are tinyserve / baseline; 'time s' is the speed-up (baseline time / ours)")
    tag = "-".join(w.name for w in workloads)
    out = write_json(args.output or default_output_path("compare", tag), {
        "kind": "compare", "settings": {"repeat": args.repeat, "device": args.device, "dtype": args.dtype,
                                        "baseline": args.baseline,
                                        "batch_size": args.batch_size, "server_flags": server_flags,
                                        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
                                        "stream": not args.no_stream},
        "machine": machine, "summary": rows, "runs": runs})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
