"""The whole front door of an embedding server, in process: HTTP (the app) and ZMQ (client frames) into the
real TokenizerManager with all-MiniLM-L6-v2's folder and tokenizer, a stand-in scheduler that keeps the
scheduler's contract (an embed request: one finished output whose vector is a fixed random table's
normalised mean over the prompt's tokens and token types), the real detokenizer, and back.

The oracle is the tokenizer's own encoding run through the same table: the reply is the vector of
exactly the tokens the tokenizer makes of the text (or of the pair). Also: the pooling rule and the size
are read from the folder at start; every generation route is refused on an embedding server and
``/v1/embeddings`` on a generation one; a too long input says both lengths, a truncated one is cut
keeping its [SEP]; /health_generate probes with an embedding."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import msgspec
import numpy as np
import pytest

from detokenizer_proc.detokenizer_manager import DetokenizerManager
from runtime.checkpoints.model_source import minilm_folder
from runtime.config.args import ServerArgs
from runtime.protocol.messages import (
    BatchTokenIDOut,
    ErrorReply,
    GenerateChunk,
    GenerateReq,
    ReqOutput,
    TokenizedGenerateReq,
)
from runtime.text.tokenizer import load_tokenizer
from tests.support.asgi import AsgiReply, call_app
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.server import build_app
from tokenizer_proc.request_builder import ModelLimits
from tokenizer_proc.tokenizer_manager import TokenizerManager

VOCAB, HIDDEN, LIMIT = 30522, 384, 48
LIMITS = ModelLimits(vocab_size=VOCAB, context_len=512, max_req_input_len=LIMIT, max_total_tokens=8192)
TABLE = np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
TYPES = np.random.default_rng(1).standard_normal((2, HIDDEN)).astype(np.float32)


def pooled(ids: list[int], types: list[int] | None) -> list[float]:
    """The stand-in model: mean pooling of token + token type rows, L2-normalised, fp32."""
    rows = TABLE[ids] + TYPES[types if types is not None else [0] * len(ids)]
    mean = rows.mean(axis=0)
    return [float(x) for x in (mean / np.linalg.norm(mean)).astype(np.float32)]


class ContractScheduler:
    """Answers each embed request as the scheduler does (one finished ReqOutput with its vector), through
    the detokenizer, on the loop; records every message it was sent."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.manager: TokenizerManager | None = None
        self.detokenizer: DetokenizerManager | None = None

    def send(self, msg: Any) -> None:
        self.sent.append(msg)
        if isinstance(msg, TokenizedGenerateReq) and msg.embed:
            assert msg.sampling_params.max_new_tokens == 0
            out = ReqOutput(
                rid=msg.rid,
                new_output_ids=[],
                finished=True,
                finish_reason={"type": "stop", "matched": None},
                prompt_tokens=len(msg.input_ids),
                embedding=pooled(msg.input_ids, msg.token_type_ids),
            )
            asyncio.get_running_loop().call_soon(self.answer, out)

    def answer(self, out: ReqOutput) -> None:
        assert self.manager is not None and self.detokenizer is not None
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(BatchTokenIDOut([out])), type=BatchTokenIDOut)
        batch = self.detokenizer.handle(wire)
        asyncio.ensure_future(self.manager.outputs.handle_outputs(batch.outputs))


class Router:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []
        self.replied: asyncio.Event | None = None  # set at each reply (made on the test's loop)

    async def send(self, identity: bytes, msg: Any) -> None:
        self.sent.append((identity, msg))
        if self.replied is not None:
            self.replied.set()

    async def send_raw(self, identity: bytes, payload: bytes) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(str(minilm_folder()))


def front_door(tokenizer: Any, is_embedding: bool = True) -> tuple[TokenizerManager, ContractScheduler, Router]:
    args = dataclasses.replace(
        ServerArgs(), model_path=str(minilm_folder()), is_embedding=is_embedding, served_model_name="minilm"
    )
    sched, router = ContractScheduler(), Router()
    manager = TokenizerManager(args, tokenizer, LIMITS, router, sched)  # type: ignore[arg-type]
    sched.manager, sched.detokenizer = manager, DetokenizerManager(tokenizer)
    return manager, sched, router


def call(manager: TokenizerManager, method: str, path: str, body: dict[str, Any] | None = None) -> AsgiReply:
    context = HttpContext(manager.server_args, 1 << 20)
    context.attach(manager)
    headers = {"content-type": "application/json"}
    return call_app(build_app(context), method, path, json.dumps(body).encode() if body else b"", headers)


def test_the_pooling_rule_and_size_are_read_from_the_folder(tokenizer: Any) -> None:
    manager, _, _ = front_door(tokenizer)
    assert manager.embedding is not None
    assert (manager.embedding.pooling.method, manager.embedding.pooling.normalize) == ("mean", True)
    assert not manager.embedding.classifier and manager.embedding.size == HIDDEN
    assert manager.model_info()["is_generation"] is False
    assert front_door(tokenizer, is_embedding=False)[0].embedding is None


def test_embeddings_are_the_vectors_of_the_tokenizers_tokens(tokenizer: Any) -> None:
    manager, sched, _ = front_door(tokenizer)
    texts = ["A man is eating food.", "Someone is playing a violin."]
    reply = call(manager, "POST", "/v1/embeddings", {"model": "minilm", "input": texts})
    assert reply.status == 200, reply.body
    body = reply.json()
    for text, item in zip(texts, body["data"]):
        encoded = tokenizer(text)
        assert item["embedding"] == pooled(encoded["input_ids"], encoded["token_type_ids"])
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(t)["input_ids"]) for t in texts)
    # a pair through /encode: the tokenizer's pair encoding, token types included
    pair = call(manager, "POST", "/encode", {"text": [["a query", "a document"]]}).json()
    encoded = tokenizer("a query", "a document")
    assert pair[0]["embedding"] == pooled(encoded["input_ids"], encoded["token_type_ids"])
    assert manager.table.is_empty() and all(m.embed for m in sched.sent)


def test_the_zmq_front_door_answers_with_the_vector(tokenizer: Any) -> None:
    async def main() -> None:
        manager, _, router = front_door(tokenizer)
        router.replied = asyncio.Event()
        frame = msgspec.msgpack.encode(GenerateReq(rid="z", embed=True, text="hello", text_pair="world"))
        await manager.handle_client_frames(b"c", [frame])
        await asyncio.wait_for(router.replied.wait(), 10)
        (who, chunk), *_ = router.sent
        encoded = tokenizer("hello", "world")
        assert who == b"c" and isinstance(chunk, GenerateChunk) and chunk.rid == "z" and chunk.finished
        assert chunk.meta.embedding == pooled(encoded["input_ids"], encoded["token_type_ids"])
        assert chunk.text == "" and chunk.output_ids == [] and chunk.meta.prompt_tokens == len(encoded["input_ids"])

    asyncio.run(main())


GENERATION_ROUTES = [
    ("/v1/chat/completions", {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "minilm", "prompt": "hi"}),
    ("/generate", {"text": "hi"}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "minilm", "input": "hi"}),
    ("/api/chat", {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}),
    ("/api/generate", {"model": "minilm", "prompt": "hi"}),
]


@pytest.mark.parametrize(("path", "body"), GENERATION_ROUTES, ids=[p for p, _ in GENERATION_ROUTES])
def test_every_generation_route_is_refused_on_an_embedding_server(
    tokenizer: Any, path: str, body: dict[str, Any]
) -> None:
    manager, sched, _ = front_door(tokenizer)
    reply = call(manager, "POST", path, body)
    assert reply.status == 400, reply.body
    assert b"serves embeddings" in reply.body and b"--is-embedding" in reply.body
    assert not sched.sent


def test_a_generation_server_refuses_embeddings_on_both_front_doors(tokenizer: Any) -> None:
    manager, sched, router = front_door(tokenizer, is_embedding=False)
    reply = call(manager, "POST", "/v1/embeddings", {"model": "minilm", "input": "x"})
    assert reply.status == 400 and b"--is-embedding" in reply.body

    async def main() -> None:
        await manager.handle_client_frames(b"c", [msgspec.msgpack.encode(GenerateReq(rid="e", embed=True, text="x"))])

    asyncio.run(main())
    ((_, error),) = router.sent
    assert isinstance(error, ErrorReply) and error.code == "invalid_request" and "--is-embedding" in error.message
    assert not sched.sent


def test_length_is_refused_or_cut_as_asked(tokenizer: Any) -> None:
    manager, sched, _ = front_door(tokenizer)
    text = "word " * 80
    n = len(tokenizer(text)["input_ids"])
    error = call(manager, "POST", "/v1/embeddings", {"model": "minilm", "input": ["ok", text]}).json()["error"]
    assert error["code"] == "too_long" and error["param"] == "input"
    assert error["message"].startswith(f"input[1]: the input has {n} tokens, more than the model's limit of {LIMIT}")
    body = {"model": "minilm", "input": text, "truncate_prompt_tokens": 10}
    reply = call(manager, "POST", "/v1/embeddings", body).json()
    cut = tokenizer(text, truncation=True, max_length=10)
    assert reply["data"][0]["embedding"] == pooled(cut["input_ids"], cut["token_type_ids"])
    sent = [m for m in sched.sent if isinstance(m, TokenizedGenerateReq)][-1]
    assert len(sent.input_ids) == 10 and sent.input_ids[-1] == tokenizer.sep_token_id
    assert reply["usage"]["prompt_tokens"] == 10


def test_health_generate_probes_an_embedding_server_with_an_embedding(tokenizer: Any) -> None:
    manager, sched, _ = front_door(tokenizer)
    assert call(manager, "GET", "/health_generate").status == 200
    (probe,) = sched.sent
    assert probe.embed and probe.sampling_params.max_new_tokens == 0
