"""The reply bodies of the embedding, reranking and scoring routes (the requests: tokenizer_proc/embedding_protocol.py).

- ``/v1/embeddings``: OpenAI's list of ``{object: "embedding", index, embedding}`` in input order, the
  vector as JSON floats or, with ``encoding_format: "base64"`` (what the openai SDK asks for unless told
  otherwise, and decodes with ``numpy.frombuffer(..., dtype="float32")``), the base64 of its
  little-endian float32 bytes; ``usage`` counts the prompt tokens of every input;
- ``/encode``: SGLang's ``{embedding, meta_info}`` per input (``id``, ``finish_reason``,
  ``prompt_tokens``, ``cached_tokens``, ``e2e_latency``, ``weight_version``);
- ``/v1/rerank``: Cohere's and Jina's results, best first, each with its document's ``index`` in the
  request and its ``relevance_score``: for a one-label head (sentence-transformers' ``CrossEncoder``
  and vLLM's default) the sigmoid of the logit; for a head of several labels the softmax probability
  of the last label (the "relevant" class of a binary classifier); equal scores keep the documents' order;
- ``/v1/score``: SGLang's probabilities per item, per label token, from the logprobs of the label
  tokens at the first output position: ``exp(logprob)``, or with ``apply_softmax`` the softmax over
  the label tokens' logprobs (their probabilities renormalised to sum to one); a label token the
  reply does not name counts as probability 0, as in SGLang.
"""

from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import Any, Literal

from runtime.protocol.messages import GenerateChunk

EncodingFormat = Literal["float", "base64"]


def encode_vector(vector: list[float], encoding_format: EncodingFormat) -> list[float] | str:
    """The vector as OpenAI sends it: JSON floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def usage(prompt_tokens: int, completion_tokens: int | None = None) -> dict[str, int]:
    """OpenAI's usage: the prompt tokens (and the completion tokens where there are any) and their sum."""
    if completion_tokens is None:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def embeddings_body(
    vectors: list[list[float]], encoding_format: EncodingFormat, model: str, prompt_tokens: int
) -> dict[str, Any]:
    """OpenAI's embeddings reply; ``vectors`` in input order."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(vector, encoding_format)}
            for i, vector in enumerate(vectors)
        ],
        "model": model,
        "usage": usage(prompt_tokens),
    }


def encode_result(chunk: GenerateChunk, vector: list[float], weight_version: str) -> dict[str, Any]:
    """SGLang's ``/encode`` answer for one input: its vector and ``meta_info``."""
    meta = chunk.meta
    info: dict[str, Any] = {
        "id": chunk.rid,
        "finish_reason": chunk.finish_reason,
        "prompt_tokens": meta.prompt_tokens or 0,
        "cached_tokens": meta.cached_tokens or 0,
        "weight_version": weight_version,
    }
    if meta.latency is not None:
        info["e2e_latency"] = meta.latency
    return {"embedding": vector, "meta_info": info}


def relevance_score(label_scores: list[float]) -> float:
    """A cross-encoder's label scores as one relevance in [0, 1] (see the module docstring)."""
    if not label_scores:
        raise ValueError("a cross-encoder answered no label scores")
    if len(label_scores) == 1:
        return _sigmoid(label_scores[0])
    return _softmax(label_scores)[-1]


def rerank_body(
    scores: list[float],
    documents: list[str],
    top_n: int | None,
    return_documents: bool,
    model: str,
    prompt_tokens: int,
) -> dict[str, Any]:
    """The rerank reply: the documents' results by score, best first (top_n of them; None: all)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # (sorted is stable: ties keep their order)
    results = []
    for i in order[:top_n]:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results, "usage": usage(prompt_tokens)}


def label_probabilities(
    position: list[list[Any]] | None, label_token_ids: list[int], apply_softmax: bool
) -> list[float]:
    """The label tokens' probabilities at one output position (``[[logprob, token_id], ...]``), in the
    order of ``label_token_ids`` (see the module docstring)."""
    if position is None:
        raise ValueError("the reply carries no label token logprobs")
    given = {int(token_id): float(logprob) for logprob, token_id in position}
    logprobs = [given.get(token_id, -math.inf) for token_id in label_token_ids]
    if apply_softmax:
        return _softmax(logprobs)
    return [math.exp(lp) for lp in logprobs]


def score_body(scores: list[list[float]], model: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """SGLang's scoring reply."""
    return {"scores": scores, "model": model, "usage": usage(prompt_tokens, completion_tokens), "object": "scoring"}


def _sigmoid(x: float) -> float:
    """1 / (1 + e^-x), without overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _softmax(values: list[float]) -> list[float]:
    """exp(v_i) / sum_j exp(v_j), shifted by the largest value (all -inf: all 0)."""
    top = max(values)
    if top == -math.inf:
        return [0.0 for _ in values]
    weights = [math.exp(v - top) for v in values]
    total = math.fsum(weights)
    return [w / total for w in weights]
