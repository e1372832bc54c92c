"""How bench/embeddings.py drives each engine: the sentences (fresh for every batch), the
``/v1/embeddings`` client that times a batch through a server (tinyserve's, llama-server's), the
same batches through ``SentenceTransformer.encode`` in this process, and the cosine check.

Kept apart from the comparison's CLI and summary (bench/embeddings.py) as bench/load_runner.py is
from bench/serving.py: this part sends and times, that one summarises and prints.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

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
