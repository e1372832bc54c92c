"""What every embedding route shares (OpenAI's, SGLang's and Ollama's): the embedding model or the
refusal of a generation server, ``dimensions`` checked and applied, and a call's inputs run as one local
client (all sent before any reply is awaited) with each finished request's vector read back in order."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import Request

from runtime.protocol.messages import GenerateChunk, GenerateReq
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.embedding_build import NOT_AN_EMBEDDING_SERVER
from tokenizer_proc.embedding_model import DimensionsError, EmbeddingModel
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.errors import RequestFailed
from tokenizer_proc.http.run import LocalRun

# What a cross-encoder answers when asked for vectors (OpenAI's and Ollama's embedding routes).
CROSS_ENCODER_HAS_NO_VECTORS = (
    "the model is a cross-encoder (a reranker): it scores (query, document) pairs and has no embeddings; "
    "use /v1/rerank, or /encode for its raw label scores"
)


def embedding_model(http: HttpContext) -> EmbeddingModel:
    """The embedding model served, or 400 on a generation server."""
    model = http.ready_door().embedding
    if model is None:
        raise oai.BadRequest(NOT_AN_EMBEDDING_SERVER)
    return model


def check_dimensions(model: EmbeddingModel, dimensions: int | None) -> None:
    try:
        model.check_dimensions(dimensions)
    except DimensionsError as exc:
        raise oai.BadRequest(f"dimensions: {exc}", "dimensions") from None


def cut(model: EmbeddingModel, vector: list[float], dimensions: int | None) -> list[float]:
    try:
        return model.cut(vector, dimensions)
    except DimensionsError as exc:
        raise oai.BadRequest(f"dimensions: {exc}", "dimensions") from None


async def run_all(
    request: Request, http: HttpContext, reqs: list[GenerateReq], where: Callable[[int], str] | None
) -> list[GenerateChunk]:
    """Submit every request as one local client, then wait for all of them: each one's finished
    chunk, in the order of ``reqs`` (none for none). A refusal names the input (``where``); an input
    that ends in an error fails the call (RequestFailed)."""
    if not reqs:
        return []
    run = LocalRun(http.ready_door(), reqs)
    await run.submit(where)
    finished: list[GenerateChunk | None] = [None] * len(reqs)

    def take(index: int, chunk: GenerateChunk) -> None:
        if chunk.finished:
            finished[index] = chunk

    await run.collect(request, take)
    out = [chunk for chunk in finished if chunk is not None]
    assert len(out) == len(reqs)  # collect returns once every request has finished
    return out


def vector(chunk: GenerateChunk) -> list[float]:
    """A finished embedding request's vector; an aborted one (its deadline passed) fails the call."""
    vector = chunk.meta.embedding
    if vector is not None:
        return vector
    reason: dict[str, Any] = chunk.finish_reason or {}
    if reason.get("type") == "abort":
        raise RequestFailed("aborted", f"the request was aborted: {reason.get('message') or 'aborted'}")
    raise RequestFailed("internal", f"request {chunk.rid} finished without its embedding")


def prompt_tokens(chunks: list[GenerateChunk]) -> int:
    return sum(chunk.meta.prompt_tokens or 0 for chunk in chunks)
