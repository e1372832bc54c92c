"""The embedding, rerank and score routes through the app, against a fake front door that answers each
request as the scheduler's contract says (an embedding request: one finished output with its vector;
a score request: the label tokens' logprobs at its one output position), with known values:

- ``/v1/embeddings`` read by the official openai SDK (``AsyncOpenAI`` over an in-process ASGI transport):
  float and its default base64 decode to the vectors sent, in input order although the replies come
  back reversed; ``dimensions`` cuts and renormalises; usage adds up the prompt tokens; every input
  is in flight before any reply is read;
- ``/encode``: SGLang's shapes, single and batch, pairs for a cross-encoder;
- ``/v1/rerank`` (and its aliases): order, ``top_n``, ``return_documents``, the score of one- and
  two-label heads (torch's sigmoid / softmax as the oracle);
- ``/v1/score``: the probabilities of SGLang's formula from given logprobs, with ``apply_softmax``
  and ``item_first``;
- refusals: the wrong kind of server, a reranker asked for vectors, a rerank on an embedder, a bad
  ``dimensions``, a refused input named by its index."""

from __future__ import annotations

import asyncio
import json
import math
import random
from typing import Any, Callable

import httpx2
import msgspec
import numpy as np
import openai
import pytest
import torch

from runtime.checkpoints.pooling import PoolingSpec
from runtime.config.args import ServerArgs
from runtime.protocol.messages import ChunkMeta, GenerateChunk, GenerateReq
from tests.support.asgi import AsgiReply, call_app
from tokenizer_proc.embedding_model import EmbeddingModel
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.server import build_app
from tokenizer_proc.rejected import Rejected

KEY = "secret"
MODEL = "served"
SIZE = 8
EMBEDDER = EmbeddingModel(PoolingSpec("mean", True, False, True, "test"), SIZE)
RERANKER = EmbeddingModel(PoolingSpec("cls", False, True, True, "test"), 1)
STOP = {"type": "stop", "matched": None}


def vector_of(req: GenerateReq) -> list[float]:
    """A unit vector that depends on the input (so that a reply in the wrong place is seen)."""
    rng = random.Random(repr((req.text, req.input_ids, req.text_pair)))
    raw = [rng.uniform(-1, 1) for _ in range(SIZE)]
    norm = math.sqrt(sum(x * x for x in raw))
    return [float(np.float32(x / norm)) for x in raw]  # the scheduler sends fp32 values


def prompt_tokens_of(req: GenerateReq) -> int:
    return len(req.input_ids) if req.input_ids is not None else len((req.text or "").split()) + 2


class FakeDoor:
    """A front door that answers each request with ``answer(req)``, all of them at the first moment the
    route waits (in reverse order), and records what it was given and how many were in flight then."""

    tokenizer = None
    context_len = 512
    weight_version = "v7"

    def __init__(
        self,
        embedding: EmbeddingModel | None,
        answer: Callable[[GenerateReq], GenerateChunk],
        reject: dict[int, Rejected] | None = None,
    ) -> None:
        self.embedding = embedding
        self.answer = answer
        self.reject = reject or {}
        self.submitted: list[GenerateReq] = []
        self.pending: list[GenerateChunk] = []
        self.in_flight_when_answered: list[int] = []
        self.queue: asyncio.Queue[Any] | None = None

    def open_local(self) -> tuple[bytes, asyncio.Queue[Any]]:
        self.queue = asyncio.Queue()
        return b"client", self.queue

    async def submit_local(self, identity: bytes, req: GenerateReq) -> int:
        refusal = self.reject.get(len(self.submitted))
        if refusal is not None:
            raise refusal
        self.submitted.append(req)
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append(msgspec.structs.replace(self.answer(req), rid=req.rid))
        return 1

    def flush(self) -> None:
        assert self.queue is not None
        self.in_flight_when_answered.append(len(self.submitted))
        for chunk in reversed(self.pending):
            self.queue.put_nowait(chunk)
        self.pending = []

    def close_local(self, identity: bytes) -> None:
        pass


def embedded(req: GenerateReq) -> GenerateChunk:
    """The scheduler's contract for an embedding request: one finished output with the vector."""
    assert req.embed
    meta = ChunkMeta(prompt_tokens=prompt_tokens_of(req), completion_tokens=0, latency=0.5, embedding=vector_of(req))
    return GenerateChunk(req.rid, "", [], True, STOP, meta)


def app_of(door: FakeDoor) -> Any:
    context = HttpContext(ServerArgs(api_key=KEY, served_model_name=MODEL), 1 << 20)
    context.attach(door)  # type: ignore[arg-type]
    return build_app(context)


def post(door: FakeDoor, path: str, body: dict[str, Any]) -> AsgiReply:
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    return call_app(app_of(door), "POST", path, json.dumps(body).encode(), headers)


def error_of(reply: AsgiReply, status: int = 400) -> dict[str, Any]:
    assert reply.status == status, reply.body
    error: dict[str, Any] = reply.json()["error"]
    return error


def with_sdk(door: FakeDoor, calls: Callable[[openai.AsyncOpenAI], Any]) -> Any:
    """Run ``calls(client)`` with the official SDK, its HTTP going straight into the app."""

    async def main() -> Any:
        transport = httpx2.ASGITransport(app=app_of(door))
        async with httpx2.AsyncClient(transport=transport, base_url="http://tinyserve") as http:
            client = openai.AsyncOpenAI(api_key=KEY, base_url="http://tinyserve/v1", http_client=http, max_retries=0)
            return await calls(client)

    return asyncio.run(main())


TEXTS = ["the first text", "a second, longer text than the first", "3"]


def test_the_openai_sdk_reads_the_vectors_as_float_and_as_its_default_base64() -> None:
    door = FakeDoor(EMBEDDER, embedded)

    async def calls(client: openai.AsyncOpenAI) -> Any:
        default = await client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64
        floats = await client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        raw = await client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64")
        return default, floats, raw

    default, floats, raw = with_sdk(door, calls)
    expected = [vector_of(GenerateReq(rid="", text=t)) for t in TEXTS]
    for reply in (default, floats):
        assert reply.object == "list" and reply.model == MODEL
        assert [d.index for d in reply.data] == [0, 1, 2] and all(d.object == "embedding" for d in reply.data)
        assert [d.embedding for d in reply.data] == expected  # exact: float32 values survive both encodings
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(t.split()) + 2 for t in TEXTS)
    assert isinstance(raw.data[0].embedding, str)  # asked for explicitly: the SDK hands the string over
    assert np.frombuffer(__import__("base64").b64decode(raw.data[0].embedding), "<f4").tolist() == expected[0]
    # every input of a call was in flight before any reply was read, each an embedding request
    assert door.in_flight_when_answered == [3, 6, 7]
    assert [r.text for r in door.submitted] == TEXTS * 2 + TEXTS[:1] and all(r.embed for r in door.submitted)


def test_token_id_inputs_and_dimensions() -> None:
    door = FakeDoor(EMBEDDER, embedded)

    async def calls(client: openai.AsyncOpenAI) -> Any:
        one = await client.embeddings.create(model=MODEL, input=[5, 6, 7], dimensions=3)
        many = await client.embeddings.create(model=MODEL, input=[[5, 6, 7], [8]], encoding_format="float")
        return one, many

    one, many = with_sdk(door, calls)
    full = np.array(vector_of(GenerateReq(rid="", input_ids=[5, 6, 7])), dtype=np.float64)
    cut = full[:3] / np.linalg.norm(full[:3])  # the first 3, renormalised: the pooling rule normalises
    assert np.allclose(one.data[0].embedding, cut, atol=1e-6) and len(one.data[0].embedding) == 3
    assert math.isclose(float(np.linalg.norm(one.data[0].embedding)), 1.0, abs_tol=1e-6)
    assert [d.embedding for d in many.data] == [
        vector_of(GenerateReq(rid="", input_ids=ids)) for ids in ([5, 6, 7], [8])
    ]
    assert many.usage.prompt_tokens == 4
    # a model that does not normalise keeps the values it cut
    plain = FakeDoor(EmbeddingModel(PoolingSpec("mean", False, False, True, "test"), SIZE), embedded)
    reply = post(plain, "/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 2}).json()
    assert reply["data"][0]["embedding"] == vector_of(GenerateReq(rid="", text="x"))[:2]


def test_bad_dimensions_and_inputs_are_refused_by_field() -> None:
    door = FakeDoor(EMBEDDER, embedded)
    for dimensions in (0, SIZE + 1):
        error = error_of(post(door, "/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": dimensions}))
        assert error["param"] == "dimensions" and str(dimensions) in error["message"]
    matryoshka = FakeDoor(EmbeddingModel(EMBEDDER.pooling, SIZE, (2, 4, 8)), embedded)
    error = error_of(post(matryoshka, "/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 3}))
    assert "2, 4, 8" in error["message"]
    assert post(matryoshka, "/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 4}).status == 200
    for body, param in (
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": [1, "a"]}, "input"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": MODEL}, "input"),
    ):
        assert error_of(post(door, "/v1/embeddings", body))["param"] == param, body
    assert error_of(post(door, "/v1/embeddings", {"model": "other", "input": "x"}), 404)["code"] == "model_not_found"


def test_a_refused_input_of_a_list_is_named_by_its_index() -> None:
    too_long = Rejected("too_long", "the input has 600 tokens, more than the model's limit of 512", "prompt")
    door = FakeDoor(EMBEDDER, embedded, reject={1: too_long})
    error = error_of(post(door, "/v1/embeddings", {"model": MODEL, "input": ["ok", "long"]}))
    assert error["message"] == "input[1]: the input has 600 tokens, more than the model's limit of 512"
    assert error["param"] == "input" and error["code"] == "too_long"
    single = error_of(
        post(FakeDoor(EMBEDDER, embedded, {0: too_long}), "/v1/embeddings", {"model": MODEL, "input": "x"})
    )
    assert single["message"].startswith("the input has 600 tokens")


def test_each_route_refuses_the_wrong_kind_of_server() -> None:
    generation = FakeDoor(None, embedded)
    for path, body in (
        ("/v1/embeddings", {"model": MODEL, "input": "x"}),
        ("/encode", {"text": "x"}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ):
        assert "--is-embedding" in error_of(post(generation, path, body))["message"], path
    reranker = FakeDoor(RERANKER, embedded)
    assert "cross-encoder" in error_of(post(reranker, "/v1/embeddings", {"model": MODEL, "input": "x"}))["message"]
    assert (
        "not a cross-encoder"
        in error_of(post(FakeDoor(EMBEDDER, embedded), "/rerank", {"query": "q", "documents": ["d"]}))["message"]
    )
    score = {"query": "q", "items": ["a"], "label_token_ids": [1]}
    assert "--is-embedding" in error_of(post(FakeDoor(EMBEDDER, embedded), "/v1/score", score))["message"]
    assert not generation.submitted and not reranker.submitted


def test_encode_answers_in_sglangs_shapes() -> None:
    door = FakeDoor(EMBEDDER, embedded)
    single = post(door, "/encode", {"text": "hello there", "rid": "mine"}).json()
    assert single["embedding"] == vector_of(GenerateReq(rid="", text="hello there"))
    info = single["meta_info"]
    assert info["id"] == "mine" and info["prompt_tokens"] == 4 and info["finish_reason"] == STOP
    assert info["weight_version"] == "v7" and info["e2e_latency"] == 0.5
    batch = post(door, "/encode", {"text": ["a", "b c"], "rid": "r", "dimensions": 4}).json()
    assert [r["meta_info"]["id"] for r in batch] == ["r_0", "r_1"]
    assert [len(r["embedding"]) for r in batch] == [4, 4]
    ids = post(door, "/encode", {"input_ids": [3, 4]}).json()
    assert ids["embedding"] == vector_of(GenerateReq(rid="", input_ids=[3, 4]))
    pairs = post(FakeDoor(RERANKER, embedded), "/encode", {"text": [["q", "d1"], ["q", "d2"]]})
    assert pairs.status == 200 and len(pairs.json()) == 2
    assert error_of(post(door, "/encode", {"text": [["q", "d", "e"]]}))["param"] == "text"
    assert error_of(post(door, "/encode", {"text": "x", "image_data": "a.png"}))["param"] == "image_data"


LOGITS = {"d0": -1.0, "d1": 2.5, "d2": 0.3, "d3": 2.5, "d4": -7.0}


def reranked(labels: Callable[[float], list[float]]) -> Callable[[GenerateReq], GenerateChunk]:
    """A cross-encoder whose label scores for (query, document) come from LOGITS."""

    def answer(req: GenerateReq) -> GenerateChunk:
        assert req.embed and req.text == "the query" and req.text_pair is not None
        meta = ChunkMeta(prompt_tokens=10, embedding=labels(LOGITS[req.text_pair]))
        return GenerateChunk(req.rid, "", [], True, STOP, meta)

    return answer


def test_rerank_orders_by_relevance_with_top_n_and_documents() -> None:
    door = FakeDoor(RERANKER, reranked(lambda logit: [logit]))
    documents: list[Any] = ["d0", {"text": "d1"}, "d2", "d3", "d4"]
    reply = post(door, "/v1/rerank", {"model": MODEL, "query": "the query", "documents": documents}).json()
    expected = torch.sigmoid(torch.tensor([LOGITS[f"d{i}"] for i in range(5)], dtype=torch.float64)).tolist()
    assert [r["index"] for r in reply["results"]] == [1, 3, 2, 0, 4]  # by score; the tie keeps the given order
    assert all(math.isclose(r["relevance_score"], expected[r["index"]], rel_tol=1e-12) for r in reply["results"])
    assert [r["document"] for r in reply["results"]] == [{"text": f"d{i}"} for i in (1, 3, 2, 0, 4)]
    assert reply["model"] == MODEL and reply["id"].startswith("rerank-")
    assert reply["usage"] == {"prompt_tokens": 50, "total_tokens": 50}
    assert door.in_flight_when_answered == [5]
    for path in ("/rerank", "/v2/rerank"):
        top = post(door, path, {"query": "the query", "documents": documents, "top_n": 2, "return_documents": False})
        assert top.json()["results"] == [{"index": i, "relevance_score": expected[i]} for i in (1, 3)]
    assert error_of(post(door, "/v1/rerank", {"query": "the query", "documents": []}))["param"] == "documents"
    assert error_of(post(door, "/v1/rerank", {"query": "q", "documents": ["d0"], "top_n": -1}))["param"] == "top_n"


def test_a_two_label_head_scores_the_softmax_of_its_last_label() -> None:
    door = FakeDoor(EmbeddingModel(RERANKER.pooling, 2), reranked(lambda logit: [0.5, logit]))
    reply = post(door, "/v1/rerank", {"query": "the query", "documents": ["d0", "d1"]}).json()
    probs = [torch.softmax(torch.tensor([0.5, LOGITS[d]], dtype=torch.float64), 0)[1].item() for d in ("d0", "d1")]
    assert [(r["index"], r["relevance_score"]) for r in reply["results"]] == [(1, probs[1]), (0, probs[0])]


LABELS = [11, 22, 33]
ITEM_LOGPROBS = {"A": [-0.1, -2.5, -4.0], "B": [-3.0, -0.2, -9.0]}


def scored(req: GenerateReq) -> GenerateChunk:
    """A generation model's one greedy step, with the label tokens' logprobs at its output position."""
    assert not req.embed and req.sampling_params == {"max_new_tokens": 1, "temperature": 0.0}
    assert req.token_ids_logprob == LABELS
    item = next(k for k in ITEM_LOGPROBS if (req.text or "").find(k) >= 0 or (req.input_ids or [0])[0] == ord(k))
    position = [[lp, t] for lp, t in zip(ITEM_LOGPROBS[item], LABELS)]
    meta = ChunkMeta(prompt_tokens=6, completion_tokens=1, output_token_ids_logprobs=[position])
    return GenerateChunk(req.rid, "x", [7], True, STOP, meta)


def test_score_gives_the_label_probabilities_as_sglang_computes_them() -> None:
    door = FakeDoor(None, scored)
    body = {"query": "Is it? ", "items": ["A", "B"], "label_token_ids": LABELS}
    reply = post(door, "/v1/score", body).json()
    assert reply["object"] == "scoring" and reply["model"] == MODEL
    assert reply["scores"] == [[math.exp(lp) for lp in ITEM_LOGPROBS[k]] for k in "AB"]
    assert reply["usage"] == {"prompt_tokens": 12, "completion_tokens": 1 * 2, "total_tokens": 14}
    assert [r.text for r in door.submitted] == ["Is it? A", "Is it? B"]
    soft = post(door, "/v1/score", {**body, "apply_softmax": True, "item_first": True}).json()["scores"]
    for got, item in zip(soft, "AB"):
        oracle = torch.softmax(torch.tensor(ITEM_LOGPROBS[item], dtype=torch.float64), 0).tolist()
        assert np.allclose(got, oracle, rtol=1e-12) and math.isclose(sum(got), 1.0)
    assert [r.text for r in door.submitted[2:]] == ["AIs it? ", "BIs it? "]
    tokens = post(
        door, "/v1/score", {"query": [1, 2], "items": [[ord("B")]], "label_token_ids": LABELS, "item_first": True}
    )
    assert tokens.json()["scores"] == [[math.exp(lp) for lp in ITEM_LOGPROBS["B"]]]
    assert door.submitted[-1].input_ids == [ord("B"), 1, 2]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
        ({"query": "q", "items": [], "label_token_ids": [1]}, "items"),
        ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "items"),
        ({"query": "q", "items": ["a"]}, "label_token_ids"),
    ],
)
def test_a_malformed_score_body_is_refused_by_field(body: dict[str, Any], param: str) -> None:
    door = FakeDoor(None, scored)
    assert error_of(post(door, "/v1/score", body))["param"] == param
    assert not door.submitted


def with_ollama(door: FakeDoor, calls: Callable[[Any], Any]) -> Any:
    """Run ``calls(client)`` with Ollama's own Python client, its HTTP going straight into the app."""
    import httpx
    import ollama

    async def main() -> Any:
        transport = httpx.ASGITransport(app=app_of(door))
        headers = {"authorization": f"Bearer {KEY}"}
        return await calls(ollama.AsyncClient(host="http://tinyserve", headers=headers, transport=transport))

    return asyncio.run(main())


def test_ollamas_client_embeds_on_an_embedding_server() -> None:
    import ollama

    door = FakeDoor(EMBEDDER, embedded)

    async def calls(client: Any) -> Any:
        many = await client.embed(model=MODEL, input=TEXTS)
        cut = await client.embed(model=MODEL, input="x", truncate=False, dimensions=4)
        loaded = await client.embed(model=MODEL)  # Ollama's load call: no input
        old = await client.embeddings(model=MODEL, prompt="hello")
        return many, cut, loaded, old

    many, cut, loaded, old = with_ollama(door, calls)
    assert many.model == MODEL and many.embeddings == [vector_of(GenerateReq(rid="", text=t)) for t in TEXTS]
    assert many.prompt_eval_count == sum(len(t.split()) + 2 for t in TEXTS) and many.total_duration > 0
    full = np.array(vector_of(GenerateReq(rid="", text="x")))
    assert np.allclose(cut.embeddings[0], full[:4] / np.linalg.norm(full[:4]), atol=1e-6)
    assert loaded.embeddings == [] and list(old.embedding) == vector_of(GenerateReq(rid="", text="hello"))
    # Ollama truncates unless told not to
    assert [r.truncate_prompt_tokens for r in door.submitted] == [-1, -1, -1, None, -1]

    async def refused(client: Any) -> list[int]:
        codes = []
        for call in (client.embed(model=MODEL, input="x"), client.embed(model="other", input="x")):
            with pytest.raises(ollama.ResponseError) as error:
                await call
            codes.append(error.value.status_code)
        return codes

    assert with_ollama(FakeDoor(None, embedded), refused) == [501, 404]
