"""The embedding, reranking and scoring routes: what a retrieval (RAG) pipeline calls beside the chat model.

On an embedding server (``--is-embedding``):

- ``POST /v1/embeddings``: OpenAI's (the openai SDK's ``client.embeddings.create``), on an embedding
  model; a cross-encoder is refused (it scores pairs; it has no vectors);
- ``POST /encode`` (and ``PUT``): SGLang's, the raw vector, or a cross-encoder's raw label scores;
- ``POST /v1/rerank``, ``/rerank``, ``/v2/rerank`` (the aliases vLLM and llama.cpp answer): the Cohere /
  Jina rerank, on a cross-encoder only.

On a generation server: ``POST /v1/score``, SGLang's label-token probabilities.

A route of the other kind is a 400 that says what the server serves. Every input is one request of
the shared path (``LocalRun``: tokenized, limited, routed and aborted like any other); the inputs of
one call are all sent before any reply is awaited, so the scheduler batches them. A refusal of one
input of a list names it (``input[3]: ...``), in the names of the body's fields. Errors are OpenAI's
JSON, as SGLang's and vLLM's servers answer on these routes.
"""

from __future__ import annotations

from fastapi import Request

from tokenizer_proc import embedding_reply as replies
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.embedding_protocol import EmbeddingRequest, EncodeRequest, RerankRequest, ScoreRequest, names
from tokenizer_proc.http import embedding_run
from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http, api_router
from tokenizer_proc.http.errors import RequestFailed
from tokenizer_proc.http.run import FastJSONResponse

router = api_router()

NOT_A_CROSS_ENCODER = (
    "the model is not a cross-encoder: /v1/rerank needs a sequence-classification reranker "
    "(such as a BertForSequenceClassification or XLMRobertaForSequenceClassification checkpoint) "
    "served with --is-embedding; embed the query and the documents with /v1/embeddings to rank by similarity"
)
SCORE_NEEDS_GENERATION = (
    "/v1/score reads the probabilities of label tokens from a generation model; this server serves "
    "embeddings (started with --is-embedding): start one without --is-embedding to score"
)


@router.post("/v1/embeddings")
async def embeddings(request: Request, http: Http) -> FastJSONResponse:
    http.authorize(request)
    body: EmbeddingRequest = await read_body(request, EmbeddingRequest, http.max_request_bytes)
    http.check_model(body.model)
    model = embedding_run.embedding_model(http)
    if model.classifier:
        raise oai.BadRequest(embedding_run.CROSS_ENCODER_HAS_NO_VECTORS, "model")
    embedding_run.check_dimensions(model, body.dimensions)
    field = body.field
    request.state.field_names = names({"text": field, "input_ids": field, "prompt": field})
    reqs = body.generate_reqs()
    chunks = await embedding_run.run_all(request, http, reqs, (lambda i: f"input[{i}]") if body.batch else None)
    vectors = [embedding_run.cut(model, embedding_run.vector(chunk), body.dimensions) for chunk in chunks]
    return FastJSONResponse(
        replies.embeddings_body(vectors, body.encoding_format, http.model_name, embedding_run.prompt_tokens(chunks))
    )


@router.api_route("/encode", methods=["POST", "PUT"])
async def encode(request: Request, http: Http) -> FastJSONResponse:
    """SGLang's: ``{embedding, meta_info}``, a list of them for a batch."""
    http.authorize(request)
    body: EncodeRequest = await read_body(request, EncodeRequest, http.max_request_bytes)
    model = embedding_run.embedding_model(http)
    embedding_run.check_dimensions(model, body.dimensions)
    reqs, batch, field = body.generate_reqs()
    request.state.field_names = names({"prompt": field})
    chunks = await embedding_run.run_all(request, http, reqs, (lambda i: f"{field}[{i}]") if batch else None)
    version = http.ready_door().weight_version
    results = [
        replies.encode_result(c, embedding_run.cut(model, embedding_run.vector(c), body.dimensions), version)
        for c in chunks
    ]
    return FastJSONResponse(results if batch else results[0])


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request, http: Http) -> FastJSONResponse:
    """The documents by relevance to the query, best first (Cohere's and Jina's shape)."""
    http.authorize(request)
    body: RerankRequest = await read_body(request, RerankRequest, http.max_request_bytes)
    if body.model is not None:
        http.check_model(body.model)
    model = embedding_run.embedding_model(http)
    if not model.classifier:
        raise oai.BadRequest(NOT_A_CROSS_ENCODER, "model")
    documents, top_n = body.texts(), body.kept()
    request.state.field_names = names({"text": "query", "text_pair": "documents", "prompt": "documents"})
    chunks = await embedding_run.run_all(request, http, body.generate_reqs(), lambda i: f"documents[{i}]")
    scores = [replies.relevance_score(embedding_run.vector(chunk)) for chunk in chunks]
    return FastJSONResponse(
        replies.rerank_body(
            scores, documents, top_n, body.return_documents, http.model_name, embedding_run.prompt_tokens(chunks)
        )
    )


@router.post("/v1/score")
async def score(request: Request, http: Http) -> FastJSONResponse:
    """SGLang's: per item, the probability of each label token as the next token after query + item."""
    http.authorize(request)
    body: ScoreRequest = await read_body(request, ScoreRequest, http.max_request_bytes)
    if body.model is not None:
        http.check_model(body.model)
    if http.ready_door().embedding is not None:
        raise oai.BadRequest(SCORE_NEEDS_GENERATION)
    # (a prompt is the query joined to an item: a refusal of one names the item, by its index)
    request.state.field_names = names(
        {"text": "items", "input_ids": "items", "prompt": "items", "token_ids_logprob": "label_token_ids"}
    )
    chunks = await embedding_run.run_all(request, http, body.generate_reqs(), lambda i: f"items[{i}]")
    scores = []
    for chunk in chunks:
        positions = chunk.meta.output_token_ids_logprobs
        if not positions:
            raise RequestFailed(
                "internal", f"request {chunk.rid} finished without an output position to read the labels at"
            )
        scores.append(replies.label_probabilities(positions[0], body.label_token_ids, body.apply_softmax))
    completion = sum(chunk.meta.completion_tokens or 0 for chunk in chunks)
    return FastJSONResponse(
        replies.score_body(scores, http.model_name, embedding_run.prompt_tokens(chunks), completion)
    )
