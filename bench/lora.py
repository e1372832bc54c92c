"""Multi-LoRA serving: the same requests on the base model and spread over adapters, side by side.

One run starts two servers with the same flags (unknown flags go to both), both up at once (an idle
server's threads sleep), under this process's pinning:

* the LoRA server: ``--lora-paths`` of ``--adapters`` PEFT adapters (default 8) and
  ``--max-loras-per-batch`` as many, so every adapter fits in one batch;
* the plain server: no LoRA at all, the baseline a LoRA server's base-only batches should equal.

Each repeat measures three rows, each on ``--num-requests`` FRESH prompts (default 64 of
``--prompt-len`` 128 random token ids: no prompt is ever sent twice, and the prefix cache is flushed
after each warm-up, so no request is served from the cache), all sent at once, greedy, exactly
``--max-new-tokens`` (64) tokens each (``ignore_eos``):

1. the LoRA server, every request on the base;
2. the LoRA server, the requests spread round-robin over the adapters (8 each for 64 over 8);
3. the plain server, every request on the base.

The table has the medians over ``--repeat`` (3) runs of output tokens/s and requests/s, and the
ratios (2)/(1) (what serving adapters costs over the base on one server) and (1)/(3) (what merely
enabling LoRA costs a base-only batch; ~1.0 expected). Requests go through the HTTP front door
(``--backend http``, OpenAI ``/v1/completions`` with the model ``SERVED:ADAPTER``) or the Python client
(``--backend zmq``, its ``lora_path``), bench/load_runner.py in both cases.

The adapters are made by peft (``init_lora_weights=False``: both matrices random, fixed seeds) at
``--rank`` (16) over all seven projections (q, k, v, o, gate, up, down), on a transformers model built
from the checkpoint's config.json with random weights: a LoRA's matrices have the shapes of the
model's linears and nothing else of it (its weights play no part), so a GGUF model's folder, which
has a config.json but no HF weights, is enough. They are cached under bench/results/lora-adapters.

Every measured request must finish with exactly ``--max-new-tokens`` tokens and no cached prompt
token, else the run fails (exit code 1). ``--check`` adds checks of the outputs, one request at a
time (8 tokens of one prompt): the LoRA server's base output equals the plain server's, and every
adapter's output differs from the base's (an adapter that were silently ignored would be measured as
the base).

    python -m bench.lora --device cpu --cpus 0-1
    python -m bench.lora --device cpu --cpus 0-1 --check --repeat 1 --num-requests 16
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence, TypeVar

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    DEFAULT_RESULTS_DIR,
    default_output_path,
    machine_info,
    median,
    parse_cpu_list,
    pin_threads,
    print_table,
    write_json,
)
from bench.serving import ServerHandle, add_pinning_args, benchmark_workloads, server_for
from bench.workloads import BenchRequest, Workload, token_range_for, uniform

T = TypeVar("T")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_DIR = DEFAULT_RESULTS_DIR / "lora-adapters"  # git-ignored, like the results
BASE_ON_LORA, ADAPTERS_ON_LORA, BASE_ON_PLAIN = "lora-base", "lora-adapters", "plain-base"
CHECK_TOKENS = 8


# ---------------------------------------------------------------------- adapters


def adapter_names(count: int) -> list[str]:
    return [f"lora{i}" for i in range(count)]


def make_adapters(
    model_folder: str | Path, out_root: str | Path, count: int, rank: int, alpha: float, seed: int
) -> list[Path]:
    """``count`` PEFT adapter folders for the checkpoint's architecture at ``rank`` over every
    projection, adapter ``i`` drawn under seed ``seed + i`` (reproducible, and cached: a folder that
    exists is reused). Made on a randomly initialised transformers model of the checkpoint's
    config.json: the adapters' shapes come from the config alone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(model_folder)
    root = Path(out_root) / f"{folder.name}-r{rank}-a{alpha:g}-s{seed}"
    outs = [root / name for name in adapter_names(count)]
    missing = [(i, out) for i, out in enumerate(outs) if not (out / "adapter_config.json").is_file()]
    if not missing:
        return outs
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model: Any = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    for i, out in missing:
        torch.manual_seed(seed + i)  # each adapter's draw independent of which others were cached
        config = LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=list(PROJECTIONS), init_lora_weights=False, lora_dropout=0.0
        )
        wrapped = get_peft_model(model, config)
        wrapped.save_pretrained(str(out))
        model = wrapped.unload()  # the plain model again, for the next adapter
    return outs


# ---------------------------------------------------------------------- workloads


def workload_for(
    row: str, repeat: int, args: argparse.Namespace, vocab: tuple[int, int], adapters: Sequence[str]
) -> Workload:
    """The requests of one row of one repeat: fresh prompts (a seed of their own per (row, repeat)),
    on the base, or with ``row`` ADAPTERS_ON_LORA round-robin over ``adapters`` (the first
    ``len(adapters)`` requests, which the warm-up sends, name every adapter once)."""
    index = (BASE_ON_LORA, ADAPTERS_ON_LORA, BASE_ON_PLAIN).index(row)
    seed = args.seed * 1000 + repeat * 3 + index
    wl = uniform(args.num_requests, args.prompt_len, args.max_new_tokens, seed, vocab[0], vocab[1])
    if row == ADAPTERS_ON_LORA:
        reqs = [replace_adapter(r, adapters[r.index % len(adapters)]) for r in wl.requests]
        return Workload(f"{row}", {**wl.params, "adapters": len(adapters)}, reqs)
    return Workload(row, wl.params, wl.requests)


def rotated(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left ``by`` places: each repeat starts with another row, so that no row is
    always the first after an idle spell (or always the one after the adapters' row)."""
    k = by % len(items)
    return [*items[k:], *items[:k]]


def replace_adapter(req: BenchRequest, adapter: str) -> BenchRequest:
    from dataclasses import replace

    return replace(req, lora_path=adapter)


# ---------------------------------------------------------------------- checks


def request_problems(run: dict[str, Any], max_new_tokens: int) -> list[str]:
    """What is wrong with one measured run's requests: a failure, an output of another length than
    asked, a prompt token served from the cache (each names the row and the request). Pure."""
    row = run["workload"]["name"]
    problems = []
    for rec in run["requests"]:
        if rec["error"] is not None:
            problems.append(f"{row}: request {rec['index']} failed: {rec['error']}")
        elif rec["output_len"] != max_new_tokens:
            problems.append(f"{row}: request {rec['index']} made {rec['output_len']} tokens, not {max_new_tokens}")
        if rec["cached_tokens"]:
            problems.append(f"{row}: request {rec['index']} had {rec['cached_tokens']} cached prompt tokens")
    return problems


def output_problems(lora: ServerHandle, plain: ServerHandle, prompt: list[int], adapters: Sequence[str]) -> list[str]:
    """Greedy outputs of one prompt, one request at a time (so every batch has the same shape on both
    servers): the LoRA server's base output must equal the plain server's, each adapter's must
    differ from the base's."""
    from runtime.client import Client

    params = {"max_new_tokens": CHECK_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with Client(plain.address, api_key=plain.api_key, timeout=600) as c:
        plain_out = c.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    problems = []
    with Client(lora.address, api_key=lora.api_key, timeout=600) as c:
        base_out = c.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        if base_out != plain_out:
            problems.append(f"the LoRA server's base output {base_out} is not the plain server's {plain_out}")
        for name in adapters:
            out = c.generate(input_ids=prompt, sampling_params=params, lora_path=name)["output_ids"]
            if out == base_out:
                problems.append(f"adapter {name}'s output {out} is the base's: the adapter did nothing")
    return problems


def load_average() -> list[float] | None:
    """The host's load averages (1, 5, 15 min; None off Unix): a figure taken while other work ran on
    the cores says so."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def weight_info(handle: ServerHandle) -> dict[str, Any]:
    """The server's ``weights`` report: how the weights are held (``--quantization auto`` decides it
    on a CPU: a GGUF model may keep its blocks) and the kernels its ops chose."""
    from runtime.client import Client

    with Client(handle.address, api_key=handle.api_key, timeout=60) as c:
        return dict(c.server_info().get("weights") or {})


# ---------------------------------------------------------------------- summary


def summarize(runs: dict[str, list[dict[str, Any]]], labels: dict[str, str]) -> list[dict[str, Any]]:
    """One row per measured row: medians over its repeats, each repeat's output tok/s, and the ratios
    over the LoRA server's base row and the plain server's row. Pure."""
    rows = []
    for key, label in labels.items():
        metrics = [r["metrics"] for r in runs[key]]
        rows.append(
            {
                "row": label,
                "repeats": len(metrics),
                "output_tok_s": median([m["output_tok_s"] for m in metrics]),
                "request_throughput": median([m["request_throughput"] for m in metrics]),
                "each": ", ".join(f"{m['output_tok_s']:.0f}" for m in metrics),
                "ttft_p50_ms": median([m["ttft_p50_ms"] for m in metrics]),
                "tpot_p50_ms": median([m["tpot_p50_ms"] for m in metrics]),
                "duration_s": median([m["duration_s"] for m in metrics]),
            }
        )
    by_key = dict(zip(labels, rows))
    for row in rows:
        for ref, column in ((BASE_ON_LORA, "vs_lora_base"), (BASE_ON_PLAIN, "vs_plain")):
            base = by_key[ref]["output_tok_s"] if ref in by_key else math.nan
            row[column] = row["output_tok_s"] / base if base else math.nan
    return rows


COLUMNS = [
    ("row", "requests on"),
    ("repeats", "n"),
    ("output_tok_s", "out tok/s"),
    ("request_throughput", "req/s"),
    ("each", "each repeat out tok/s"),
    ("duration_s", "time s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("tpot_p50_ms", "TPOT p50 ms"),
    ("vs_lora_base", "/ (1)"),
    ("vs_plain", "/ (3)"),
]


# ---------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any other flag (e.g. --device cpu --dtype float32) is passed to launch.py, for both servers.",
    )
    parser.add_argument(
        "--model-path", default=None, help="checkpoint (default: the default model, SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--adapters", type=int, default=8, help="adapters, all in one batch (default 8)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank (default 16)")
    parser.add_argument("--alpha", type=float, default=None, help="their lora_alpha (default: the rank, scaling 1)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests a row (default 64)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens a request (default 128)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="output tokens a request (default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row (medians; default 3)")
    parser.add_argument("--warmup", type=int, default=8, help="warm-up requests (2 tokens) before each row (8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the adapters")
    parser.add_argument(
        "--backend",
        choices=("http", "zmq"),
        default="http",
        help="http: OpenAI /v1/completions, model SERVED:ADAPTER (default); zmq: the Python client's lora_path",
    )
    parser.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT / TPOT)")
    parser.add_argument("--adapter-dir", default=str(ADAPTER_DIR), help="where the adapters are made (and cached)")
    parser.add_argument(
        "--check", action="store_true", help="also check the outputs: base equal on both servers, adapters not"
    )
    add_pinning_args(parser)
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/lora_<time>.json)")
    args, server_flags = parser.parse_known_args(argv)
    if min(args.adapters, args.rank, args.num_requests, args.prompt_len, args.max_new_tokens, args.repeat) < 1:
        parser.error("--adapters, --rank, --num-requests, --prompt-len, --max-new-tokens, --repeat must be >= 1")
    if args.alpha is None:
        args.alpha = float(args.rank)
    return args, server_flags


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.checkpoints.model_source import checkpoint_folder

    args, server_flags = parse_args(argv)
    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    model_path = str(checkpoint_folder(args.model_path))
    vocab = token_range_for(model_path)
    names = adapter_names(args.adapters)
    folders = make_adapters(model_path, args.adapter_dir, args.adapters, args.rank, args.alpha, args.seed)
    lora_flags = [
        *server_flags,
        "--lora-paths",
        *(f"{name}={folder}" for name, folder in zip(names, folders)),
        "--max-loras-per-batch",
        str(args.adapters),
    ]
    labels = {
        BASE_ON_LORA: "(1) base, LoRA server",
        ADAPTERS_ON_LORA: f"(2) {args.adapters} adapters, LoRA server",
        BASE_ON_PLAIN: "(3) base, server without LoRA",
    }
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in labels}
    load_before = load_average()
    problems: list[str] = []
    with (
        server_for(None, model_path, lora_flags, None, pinning) as lora_server,
        server_for(None, model_path, server_flags, None, pinning) as plain_server,
    ):
        order = [(BASE_ON_LORA, lora_server), (ADAPTERS_ON_LORA, lora_server), (BASE_ON_PLAIN, plain_server)]
        for rep in range(args.repeat):
            for key, handle in rotated(order, rep):
                run = benchmark_workloads(
                    handle,
                    [workload_for(key, rep, args, vocab, names)],
                    request_rate=math.inf,
                    max_concurrency=None,
                    stream=not args.no_stream,
                    seed=args.seed,
                    warmup=args.warmup,
                    timeout=None,
                    backend=args.backend,
                )[0]
                runs[key].append(run)
                problems += request_problems(run, args.max_new_tokens)
        if args.check:
            prompt = uniform(1, args.prompt_len, CHECK_TOKENS, args.seed * 1000 + 999, *vocab).requests[0].input_ids
            problems += output_problems(lora_server, plain_server, prompt, names)
        server_args = lora_server.server_args
        weights = weight_info(lora_server)
    rows = summarize(runs, labels)
    machine = {**machine_info(pinning), "load_average_before": load_before, "load_average_after": load_average()}
    print_table(
        rows,
        COLUMNS,
        title=f"multi-LoRA serving: {args.num_requests} requests x ({args.prompt_len} prompt + {args.max_new_tokens} "
        f"new) tokens, all at once, {args.adapters} adapters of rank {args.rank} on q,k,v,o,gate,up,down, "
        f"medians of {args.repeat} ({machine.get('cpu_model') or 'this machine'}; {pinning.num_threads} threads "
        f"on cpus {pinning.cpus}; --dtype {server_args.get('dtype')}, weights {weights.get('quantization') or 'dense'}, "
        f"backend {args.backend})",
    )
    by_key = dict(zip(labels, rows))
    print(
        f"(2)/(1): {by_key[ADAPTERS_ON_LORA]['vs_lora_base']:.3f}   (1)/(3): {by_key[BASE_ON_LORA]['vs_plain']:.3f}   "
        f"(2)/(3): {by_key[ADAPTERS_ON_LORA]['vs_plain']:.3f}"
    )
    out = write_json(
        args.output or default_output_path("lora", f"{args.adapters}x-r{args.rank}"),
        {
            "kind": "lora",
            "machine": machine,
            "settings": {k: v for k, v in vars(args).items()},
            "server_flags": server_flags,
            "model_path": model_path,
            "weights": weights,
            "rows": rows,
            "runs": runs,
            "problems": problems,
        },
    )
    print(f"load average (1, 5, 15 min) before {load_before}, after {machine['load_average_after']}")
    print(f"\nwrote {out}")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    if args.check and not problems:
        print("check passed: every request finished with its length and no cache hit; outputs as expected")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
