"""Embeddings/s: tinyserve serving all-MiniLM-L6-v2 against sentence-transformers (and llama.cpp's
``llama-server --embedding``) on the same CPU, batches of 256 sentences.

One engine at a time, all under this process's pinning (a server inherits the cpus and gets the
thread count through OMP_NUM_THREADS): tinyserve's server is started (``launch.py --model-path
all-minilm-l6-v2 --is-embedding --device cpu --dtype float32`` + the flags this script does not know),
measured and stopped; then ``SentenceTransformer(folder).encode(...)`` in this process on the same
folder; then llama-server on a GGUF of the same model when ``--llamacpp-server`` and ``--gguf`` are
given (made with llama.cpp's convert_hf_to_gguf.py; without them its row says "not run").

A server gets each batch through OpenAI's ``POST /v1/embeddings`` (``encoding_format: float``) in two
ways, both timed from the first byte sent to the last vector parsed: as one call of 256 inputs, and
as concurrent calls of 32 (``--chunk``); sentence-transformers gets the same 256 sentences in one
``encode`` call at its default ``batch_size`` 32 and at 256 (``--st-batch-size``). Each (engine, way)
is warmed up on a batch of its own, then measured ``--repeats`` times, each repeat on FRESH sentences
(bench/embeddings.py's ``sentence_plan``: no two batches share a sentence, so no engine answers a
repeat from a cache); the same batches go to every engine, so their token counts match. Rows are
medians; the ratios are over sentence-transformers' best way and llama.cpp's best way, and the
headline is tinyserve's best way over sentence-transformers' best.

The vectors are checked in the run: each row's minimum, over its first batch, of the cosine between
its vector and sentence-transformers' for the same sentence. tinyserve below ``--min-cosine`` (the
issue's 0.9999 in fp32) makes the run fail (exit code 1), the figures are of wrong vectors.

    python -m bench.embeddings --threads 2 --cpus 0-1
    python -m bench.embeddings --threads 2 --cpus 0-1 --llamacpp-server PATH/llama-server --gguf minilm-f32.gguf

The GGUF: ``python llama.cpp/convert_hf_to_gguf.py FOLDER --outtype f32 --outfile minilm-f32.gguf`` with
FOLDER = ``runtime.checkpoints.model_source.minilm_folder()``. Needs the ``bench`` extra (sentence-transformers). Flags it does not know are passed to launch.py.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

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

OURS = "tinyserve"
SENTENCE_TRANSFORMERS = "sentence-transformers"
LLAMACPP = "llama.cpp"
WARMUP = -1  # the repeat index of a way's warm-up batch in the sentence plan
LLAMACPP_EMBEDDING_ARGS = ("--embedding", "--pooling", "mean")  # all-MiniLM-L6-v2's pooling rule


# ---------------------------------------------------------------------- sentences


def draw_sentences(count: int, seed: int, avoid: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """``count`` distinct sentences of the embedded English-like corpus drawn with ``seed``, none in
    ``avoid``: the tokenizer corpus's templates and word salad, not its fixed text (the same for every
    seed). Deterministic in (count, seed, avoid)."""
    from runtime.checkpoints.tiny_model import embedded_corpus

    fixed = len(embedded_corpus(0, seed))
    drawn = count
    while True:
        # The corpus is a seeded stream: a longer draw begins with the shorter one.
        fresh = [s for s in dict.fromkeys(embedded_corpus(drawn, seed)[fixed:]) if s not in avoid]
        if len(fresh) >= count:
            return fresh[:count]
        drawn *= 2


def sentence_plan(batch_size: int, repeats: int, lanes: int, seed: int) -> dict[tuple[int, int], list[str]]:
    """The batches of a run, keyed (lane, repeat) with repeat ``WARMUP`` for the warm-up: lane i is
    each engine's i-th way of sending a batch. No two batches share a sentence, so a server that
    keeps anything from one batch to the next (a prefix cache, a slot's last prompt) has nothing to
    reuse; every engine gets the same batches, so their token counts are the same."""
    used: set[str] = set()
    plan: dict[tuple[int, int], list[str]] = {}
    for lane in range(lanes):
        for rep in range(WARMUP, repeats):
            batch = draw_sentences(batch_size, seed=seed + 7919 * lane + rep + 1, avoid=used)
            used.update(batch)
            plan[(lane, rep)] = batch
    return plan


# ---------------------------------------------------------------------- measuring


@dataclass
class Measured:
    """One batch through one engine: the vectors in the batch's order and what it took."""

    vectors: np.ndarray  # (batch, dim) float32
    seconds: float
    prompt_tokens: int | None = None  # as the server's usage says (None: in-process)


class EmbeddingsError(RuntimeError):
    pass


def chunks(items: Sequence[str], size: int | None) -> list[list[str]]:
    """``items`` in calls of ``size`` (the last may be shorter); one call with ``size`` None."""
    if size is None:
        return [list(items)]
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def parse_embeddings(payload: dict[str, Any], count: int) -> tuple[list[list[float]], int]:
    """The vectors of a ``/v1/embeddings`` answer in input order (by each item's ``index``, which a
    server need not send in order) and its ``usage.prompt_tokens``; an answer without exactly one
    vector per input is an error, not a figure."""
    data = payload.get("data")
    if not isinstance(data, list):
        raise EmbeddingsError(f"no data in the answer: {str(payload)[:200]}")
    by_index = {int(item["index"]): item["embedding"] for item in data}
    if sorted(by_index) != list(range(count)) or len(data) != count:
        raise EmbeddingsError(f"{count} inputs but the answer's indices are {sorted(by_index)[:8]}...")
    return [by_index[i] for i in range(count)], int((payload.get("usage") or {}).get("prompt_tokens", 0))


class EmbeddingsClient:
    """``POST /v1/embeddings`` (OpenAI's shape, which tinyserve and llama-server both serve) with
    httpx, one connection per call in flight."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def served_model(self) -> str:
        """The model the server names first in ``GET /v1/models`` (what a request must name)."""
        import httpx

        reply = httpx.get(f"{self.base_url}/v1/models", headers=self.headers, timeout=60)
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])

    def body(self, inputs: list[str]) -> dict[str, Any]:
        return {"model": self.model, "input": inputs, "encoding_format": "float"}

    async def _call(self, http: Any, inputs: list[str]) -> tuple[list[list[float]], int]:
        reply = await http.post(f"{self.base_url}/v1/embeddings", json=self.body(inputs), headers=self.headers)
        if reply.status_code != 200:
            raise EmbeddingsError(f"HTTP {reply.status_code} from {self.base_url}/v1/embeddings: {reply.text[:300]}")
        return parse_embeddings(reply.json(), len(inputs))

    async def _embed(self, sentences: list[str], chunk: int | None) -> Measured:
        import httpx

        calls = chunks(sentences, chunk)
        limits = httpx.Limits(max_connections=len(calls), max_keepalive_connections=len(calls))
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as http:
            start = time.perf_counter()
            answers = await asyncio.gather(*(self._call(http, c) for c in calls))
            seconds = time.perf_counter() - start
        vectors = np.asarray([v for got, _ in answers for v in got], dtype=np.float32)
        return Measured(vectors, seconds, sum(tokens for _, tokens in answers))

    def embed(self, sentences: list[str], chunk: int | None) -> Measured:
        """The batch as one call (``chunk`` None) or as concurrent calls of ``chunk`` inputs."""
        return asyncio.run(self._embed(sentences, chunk))


def server_ways(chunk: int) -> list[tuple[str, int | None]]:
    """How a server gets a batch: (the way's name, inputs per call), in lane order."""
    return [("1 call", None), (f"concurrent calls of {chunk}", chunk)]


def run_server(
    engine: str,
    client: EmbeddingsClient,
    plan: dict[tuple[int, int], list[str]],
    ways: list[tuple[str, int | None]],
    repeats: int,
) -> tuple[list[dict[str, Any]], dict[int, np.ndarray]]:
    """Every way's warm-up, then ``repeats`` rounds of every way (interleaved, so a drift of the
    machine touches all alike). Returns the run records and each lane's first-repeat vectors."""
    for lane, (_, chunk) in enumerate(ways):
        client.embed(plan[(lane, WARMUP)], chunk)
    runs, first = [], {}
    for rep in range(repeats):
        for lane, (way, chunk) in enumerate(ways):
            got = client.embed(plan[(lane, rep)], chunk)
            runs.append(run_record(engine, way, lane, rep, got))
            if rep == 0:
                first[lane] = got.vectors
    return runs, first


def run_sentence_transformers(
    folder: str, plan: dict[tuple[int, int], list[str]], batch_sizes: Sequence[int], repeats: int
) -> tuple[list[dict[str, Any]], dict[int, np.ndarray]]:
    """``SentenceTransformer(folder).encode`` on the same batches (its way i on lane i), fp32 on the
    CPU; the first-repeat vectors of every lane, the reference of the cosine check (a lane none of its
    ways measured is encoded after the timing)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu")
    for lane, size in enumerate(batch_sizes):
        st_encode(model, plan[(lane, WARMUP)], size)
    runs, first = [], {}
    for rep in range(repeats):
        for lane, size in enumerate(batch_sizes):
            got = st_encode(model, plan[(lane, rep)], size)
            runs.append(run_record(SENTENCE_TRANSFORMERS, f"encode, batch_size {size}", lane, rep, got))
            if rep == 0:
                first[lane] = got.vectors
    for lane in {lane for lane, _ in plan} - set(first):
        first[lane] = st_encode(model, plan[(lane, 0)], batch_sizes[0]).vectors
    del model
    gc.collect()  # its weights go before the next engine starts
    return runs, first


def st_encode(model: Any, sentences: list[str], batch_size: int) -> Measured:
    """One timed ``encode`` call: tokenizing, the forward passes, pooling and normalising."""
    start = time.perf_counter()
    vectors = model.encode(sentences, batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True)
    return Measured(np.asarray(vectors, dtype=np.float32), time.perf_counter() - start)


def run_record(engine: str, way: str, lane: int, repeat: int, got: Measured) -> dict[str, Any]:
    n = int(got.vectors.shape[0])
    return {
        "engine": engine,
        "way": way,
        "lane": lane,
        "repeat": repeat,
        "embeddings": n,
        "dim": int(got.vectors.shape[1]) if got.vectors.ndim == 2 else None,
        "seconds": got.seconds,
        "embeddings_per_s": n / got.seconds if got.seconds > 0 else math.nan,
        "prompt_tokens": got.prompt_tokens,
    }


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest cosine between rows of ``a`` and the same rows of ``b`` (NaN: shapes differ)."""
    if a.shape != b.shape or a.size == 0:
        return math.nan
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    cos = (a64 * b64).sum(axis=1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))
    return float(cos.min())


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
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="tinyserve's dtype")
    parser.add_argument("--min-cosine", type=float, default=0.9999, help="tinyserve's vectors must agree this well")
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
        rows + extra_rows,
        COLUMNS,
        title=f"embeddings/s, {args.batch_size} sentences a batch, medians of {args.repeats} "
        f"({machine.get('cpu_model') or 'this CPU'}; {pinning.num_threads} threads on cpus {pinning.cpus})",
        digits=2,
    )
    print(
        "'/ ST best', '/ llama.cpp best': this row's emb/s over that engine's best way; min cos: over the first batch"
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
