"""Embeddings/s: tinyserve serving all-MiniLM-L6-v2 against sentence-transformers (and llama.cpp's
``llama-server --embedding``) on the same CPU, batches of 256 sentences.

One engine at a time, all under this process's pinning (a server inherits the cpus and gets the
thread count through OMP_NUM_THREADS) and the OpenMP wait launch.py gives a CPU server
(``openmp_env``): tinyserve's server is started (``launch.py --model-path
all-minilm-l6-v2 --is-embedding --device cpu --dtype float32`` + the flags this script does not know),
measured and stopped; then ``SentenceTransformer(folder).encode(...)`` in this process on the same
folder; then llama-server on a GGUF of the same model when ``--llamacpp-server`` and ``--gguf`` are
given (made with llama.cpp's convert_hf_to_gguf.py; without them its row says "not run").

A server gets each batch through OpenAI's ``POST /v1/embeddings`` (``encoding_format: float``) in two
ways, both timed from the first byte sent to the last vector parsed: as one call of 256 inputs, and
as concurrent calls of 32 (``--chunk``); sentence-transformers gets the same 256 sentences in one
``encode`` call at its default ``batch_size`` 32 and at 256 (``--st-batch-size``). Each (engine, way)
is warmed up on a batch of its own, then measured ``--repeats`` times, each repeat on FRESH sentences
(bench/embedding_runner.py's ``sentence_plan``: no two batches share a sentence, so no engine answers a
repeat from a cache); the same batches go to every engine, so their token counts match. Rows are
medians; the ratios are over sentence-transformers' best way and llama.cpp's best way, and the
headline is tinyserve's best way over sentence-transformers' best.

The vectors are checked in the run: each row's minimum, over its first batch, of the cosine between
its vector and sentence-transformers' for the same sentence. tinyserve below ``--min-cosine`` (the
issue's 0.9999 in fp32; 0.999 in bf16, whose rounding alone moves a vector by about 1e-4) makes the run fail (exit code 1), the figures are of wrong vectors.

    python -m bench.embeddings --threads 2 --cpus 0-1
    python -m bench.embeddings --threads 2 --cpus 0-1 --llamacpp-server PATH/llama-server --gguf minilm-f32.gguf

The GGUF: ``python llama.cpp/convert_hf_to_gguf.py FOLDER --outtype f32 --outfile minilm-f32.gguf``,
FOLDER = ``runtime.checkpoints.model_source.minilm_folder()``. Needs the ``bench`` extra
(sentence-transformers, httpx). Flags it does not know are passed to launch.py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, MutableMapping, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import (
    default_output_path,
    machine_info,
    median,
    parse_cpu_list,
    pin_threads,
    print_table,
    write_json,
)
from bench.embedding_runner import (
    LLAMACPP,
    LLAMACPP_EMBEDDING_ARGS,
    OURS,
    SENTENCE_TRANSFORMERS,
    EmbeddingsClient,
    min_cosine,
    run_sentence_transformers,
    run_server,
    sentence_plan,
    server_ways,
)

# ---------------------------------------------------------------------- summary


def summarize(runs: list[dict[str, Any]], cosines: dict[tuple[str, str], float]) -> list[dict[str, Any]]:
    """One row per (engine, way), in the order of ``runs``: medians over its repeats, each repeat's
    embeddings/s, the ratio over sentence-transformers' best way and llama.cpp's best way, and the
    minimum cosine with sentence-transformers' vectors (``cosines``). Pure."""
    rows = []
    for engine, way in dict.fromkeys((r["engine"], r["way"]) for r in runs):
        sel = [r for r in runs if r["engine"] == engine and r["way"] == way]
        rates = [r["embeddings_per_s"] for r in sel]
        tokens = [r["prompt_tokens"] for r in sel if r.get("prompt_tokens")]
        rows.append(
            {
                "engine": engine,
                "way": way,
                "repeats": len(sel),
                "seconds": median([r["seconds"] for r in sel]),
                "embeddings_per_s": median(rates),
                "each": ", ".join(f"{x:.0f}" for x in rates),
                "tokens_per_s": median([t / r["seconds"] for t, r in zip(tokens, sel)]) if tokens else math.nan,
                "min_cosine": cosines.get((engine, way), math.nan),
            }
        )
    for base, key in ((SENTENCE_TRANSFORMERS, "vs_st"), (LLAMACPP, "vs_llamacpp")):
        best = best_rate(rows, base)
        for row in rows:
            row[key] = row["embeddings_per_s"] / best if best and row["engine"] != base else math.nan
    return rows


def best_rate(rows: list[dict[str, Any]], engine: str) -> float:
    """The engine's best way's median embeddings/s (NaN when it did not run)."""
    rates = [r["embeddings_per_s"] for r in rows if r["engine"] == engine and not math.isnan(r["embeddings_per_s"])]
    return max(rates) if rates else math.nan


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """tinyserve's best way against sentence-transformers' best and llama.cpp's best (every way is
    the same 256 sentences, so the best of each is the fair pairing)."""
    ours = [r for r in rows if r["engine"] == OURS and not math.isnan(r["embeddings_per_s"])]
    if not ours:
        return {}
    top = max(ours, key=lambda r: r["embeddings_per_s"])
    return {
        "way": top["way"],
        "embeddings_per_s": top["embeddings_per_s"],
        "vs_st": top["vs_st"],
        "vs_llamacpp": top["vs_llamacpp"],
        "st_embeddings_per_s": best_rate(rows, SENTENCE_TRANSFORMERS),
        "llamacpp_embeddings_per_s": best_rate(rows, LLAMACPP),
    }


def not_run_row(engine: str, why: str) -> dict[str, Any]:
    return {"engine": engine, "way": f"not run ({why})"}


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as printed: the cosine to 6 places (2 would print 1.00 for a wrong 0.996)."""
    return [
        {**r, "min_cosine": f"{r['min_cosine']:.6f}"} if not math.isnan(r.get("min_cosine", math.nan)) else r
        for r in rows
    ]


def openmp_env(env: MutableMapping[str, str]) -> dict[str, str | None]:
    """Give this process the OpenMP wait a CPU server starts its processes with (launch.py's
    ``CPU_OPENMP_ENV``: a short spin, then sleep), unless the user set either variable, as launch.py
    does; returns what is in effect. sentence-transformers runs in this process, so both engines
    then compute under one setting; libgomp reads it as torch loads, hence before any torch import."""
    from runtime.engine.cpu.process_env import CPU_OPENMP_ENV

    if not any(key in env for key, _ in CPU_OPENMP_ENV):
        env.update(CPU_OPENMP_ENV)
    return {key: env.get(key) for key, _ in CPU_OPENMP_ENV}


COLUMNS = [
    ("engine", "engine"),
    ("way", "way"),
    ("repeats", "n"),
    ("seconds", "s / batch"),
    ("embeddings_per_s", "emb/s"),
    ("each", "each repeat emb/s"),
    ("tokens_per_s", "tok/s"),
    ("vs_st", "/ ST best"),
    ("vs_llamacpp", "/ llama.cpp best"),
    ("min_cosine", "min cos vs ST"),
]


# ---------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's flags, checked; the rest is for launch.py."""
    from bench import serving

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False, epilog="Any other flag is passed to launch.py."
    )
    parser.add_argument("--model-path", default="all-minilm-l6-v2", help="tinyserve's model (default the MiniLM wheel)")
    parser.add_argument("--address", default=None, help="a running embedding server's ZMQ address (default: start one)")
    parser.add_argument("--http-address", default=None, help="with --address: its http://HOST:PORT")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--batch-size", type=int, default=256, help="sentences a batch (default 256)")
    parser.add_argument("--chunk", type=int, default=32, help="inputs a call in the concurrent way (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="measured batches per engine and way (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sentences")
    parser.add_argument(
        "--st-batch-size",
        type=int,
        nargs="+",
        default=[32, 256],
        help="sentence-transformers' encode batch_size, one way each (default 32, its own default, and 256)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="tinyserve's dtype (default auto: the server's own choice, bf16 where the CPU has native bf16)",
    )
    parser.add_argument(
        "--min-cosine",
        type=float,
        default=None,
        help="tinyserve's vectors must agree this well (default 0.9999 in float32; 0.999 otherwise: "
        "bf16 weights and activations against sentence-transformers' fp32 agree to about 1e-4)",
    )
    parser.add_argument("--skip-tinyserve", action="store_true", help="only the baselines")
    g = parser.add_argument_group("llama.cpp (optional: its row says 'not run' without both paths)")
    g.add_argument("--llamacpp-server", default=None, help="path of llama.cpp's llama-server binary")
    g.add_argument("--gguf", default=None, help="all-MiniLM-L6-v2 as GGUF (llama.cpp's convert_hf_to_gguf.py)")
    g.add_argument("--llamacpp-slots", type=int, default=64, help="llama-server's -np (default 64)")
    g.add_argument("--llamacpp-ctx-per-slot", type=int, default=512, help="its context a slot (MiniLM's 512)")
    g.add_argument("--llamacpp-arg", action="append", default=[], metavar="ARG", help="one more llama-server arg")
    g.add_argument("--llamacpp-log", default=None, help="append llama-server's output here (default: discarded)")
    serving.add_pinning_args(parser)
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/embeddings_<time>.json)")
    args, server_flags = parser.parse_known_args(argv)
    if args.min_cosine is None:
        args.min_cosine = 0.9999 if args.dtype == "float32" else 0.999
    if args.repeats < 1 or args.batch_size < 1 or args.chunk < 1 or min(args.st_batch_size) < 1:
        parser.error("--repeats, --batch-size, --chunk and --st-batch-size must be >= 1")
    if bool(args.llamacpp_server) != bool(args.gguf):
        parser.error("llama.cpp needs both --llamacpp-server and --gguf")
    if args.address and not args.http_address:
        parser.error("--address needs --http-address (the embeddings go over HTTP)")
    return args, server_flags


def llamacpp_config(args: argparse.Namespace, threads: int) -> Any:
    """llama-server as an embedder of the GGUF: mean pooling (MiniLM's rule; its OpenAI route
    normalises), ``threads`` for prompts, and the slots and context the flags give."""
    from bench.llamacpp_baseline import LlamaServerConfig

    return LlamaServerConfig(
        args.llamacpp_server,
        str(Path(args.gguf).resolve()),
        args.llamacpp_slots,
        threads,
        args.llamacpp_ctx_per_slot,
        (*LLAMACPP_EMBEDDING_ARGS, *args.llamacpp_arg),
    )


def main(argv: Sequence[str] | None = None) -> int:
    from bench import llamacpp_baseline, serving
    from runtime.checkpoints.model_source import minilm_folder

    args, server_flags = parse_args(argv)
    if "torch" in sys.modules:
        print("warning: torch is loaded already; the OpenMP wait below may not be what libgomp uses", file=sys.stderr)
    omp = openmp_env(os.environ)
    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    machine = machine_info(pinning)
    ways = server_ways(args.chunk)
    plan = sentence_plan(args.batch_size, args.repeats, max(len(ways), len(args.st_batch_size)), args.seed)
    runs: list[dict[str, Any]] = []
    vectors: dict[tuple[str, int], np.ndarray] = {}  # (engine, lane) -> its first repeat's vectors
    extra_rows: list[dict[str, Any]] = []

    if args.skip_tinyserve:
        extra_rows.append(not_run_row(OURS, "--skip-tinyserve"))
    else:
        flags = ["--device", "cpu", "--dtype", args.dtype, "--is-embedding", *server_flags]
        with serving.server_for(
            args.address, args.model_path, flags, args.api_key, pinning, http_address=args.http_address
        ) as handle:
            if handle.http_address is None:
                raise SystemExit("the server has no HTTP address")
            client = EmbeddingsClient(handle.http_address, args.model_path, args.api_key)
            client.model = client.served_model()
            got, first = run_server(OURS, client, plan, ways, args.repeats)
        runs += got
        vectors.update({(OURS, lane): v for lane, v in first.items()})

    got, reference = run_sentence_transformers(str(minilm_folder()), plan, args.st_batch_size, args.repeats)
    runs += got

    llamacpp_info: dict[str, Any] = {}
    if args.llamacpp_server:
        config = llamacpp_config(args, pinning.num_threads)
        llamacpp_info = llamacpp_baseline.describe(config)
        with llamacpp_baseline.llama_server(config, env=pinning.child_env(), log_path=args.llamacpp_log) as url:
            got, first = run_server(LLAMACPP, EmbeddingsClient(url, config.model_name), plan, ways, args.repeats)
        runs += got
        vectors.update({(LLAMACPP, lane): v for lane, v in first.items()})
    else:
        extra_rows.append(not_run_row(LLAMACPP, "give --llamacpp-server and --gguf"))

    cosines = {
        (r["engine"], r["way"]): min_cosine(vectors[(r["engine"], r["lane"])], reference[r["lane"]])
        for r in runs
        if r["repeat"] == 0 and (r["engine"], r["lane"]) in vectors
    }
    rows = summarize(runs, cosines)
    top = headline(rows)
    print_table(
        table_rows(rows) + extra_rows,
        COLUMNS,
        title=f"embeddings/s, {args.batch_size} sentences a batch, medians of {args.repeats} "
        f"({machine.get('cpu_model') or 'this CPU'}; {pinning.num_threads} threads on cpus {pinning.cpus})",
        digits=2,
    )
    print(
        "'/ ST best', '/ llama.cpp best': this row's emb/s over that engine's best way; min cos: over the first "
        f"batch; OpenMP wait of tinyserve and sentence-transformers: {omp}"
    )
    if top:
        print(
            f"headline: tinyserve ({top['way']}) {top['embeddings_per_s']:.0f} emb/s = {top['vs_st']:.2f}x "
            f"sentence-transformers' best ({top['st_embeddings_per_s']:.0f} emb/s)"
            + (f", {top['vs_llamacpp']:.2f}x llama.cpp's best" if not math.isnan(top["vs_llamacpp"]) else "")
        )
    wrong = [r for r in rows if r["engine"] == OURS and not r["min_cosine"] >= args.min_cosine]
    for r in wrong:
        print(f"FAILED: tinyserve ({r['way']}) min cosine {r['min_cosine']:.6f} < {args.min_cosine}", file=sys.stderr)
    out = write_json(
        args.output or default_output_path("embeddings", f"b{args.batch_size}"),
        {
            "kind": "embeddings",
            "settings": {
                "model_path": args.model_path,
                "batch_size": args.batch_size,
                "chunk": args.chunk,
                "repeats": args.repeats,
                "seed": args.seed,
                "st_batch_size": args.st_batch_size,
                "dtype": args.dtype,
                "openmp_env": omp,
                "server_flags": server_flags,
                "llamacpp": llamacpp_info,
            },
            "machine": machine,
            "headline": top,
            "summary": rows,
            "runs": runs,
        },
    )
    print(f"\nwrote {out}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
