"""Embeddings, reranking and scoring through launch.py, with the official openai SDK and our client.

* the real all-MiniLM-L6-v2 (``--model-path all-minilm-l6-v2 --is-embedding``, fp32): the openai SDK's
  ``embeddings.create`` (its default base64 and float) equals transformers' BertModel mean-pooled and
  normalised as the folder's sentence-transformers files say, for a batch of sentences of mixed lengths
  sent at once; ``dimensions`` cuts and renormalises; token ids in; a too-long input is a 400 naming its
  length and the limit, and ``truncate_prompt_tokens`` cuts it instead; a generation call is a 400;
* a causal LM as an embedder (the tiny Llama, ``--is-embedding``): its last token's final hidden state,
  normalised, equal to transformers' through HTTP and the ZMQ client alike; a repeated prompt is served
  from the prefix cache and gives the same vector;
* a cross-encoder (the tiny BERT classifier): ``/v1/rerank`` orders documents by transformers' logits;
* ``/v1/score`` on a generation server (the session's tiny Llama): label-token probabilities equal
  transformers' softmax at the prompt's last position.

After each module the server is idle and no KV slot leaked (the memory invariant).
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from runtime.checkpoints.model_source import MINILM_MODEL, minilm_folder
from tests.support.server_fixtures import API_KEY, assert_idle_and_nothing_leaked, base_args, http_json
from tests.support.server_process import ServedClient, launch_server

pytest_plugins = ["tests.support.server_fixtures"]

SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome and I would watch it again tomorrow with all of my friends.",
    "Paris is the capital of France.",
    "def add(a, b): return a + b",
    "Ünïcode, émojis 🙂 and numbers 12345 survive tokenization.",
]
TIMEOUT_S = 120.0


def openai_client(server: ServedClient) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.server.http_address}/v1", api_key=API_KEY, max_retries=0)


def cosine(a: Any, b: Any) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=0))


# ------------------------------------------------------------------ the real MiniLM


@pytest.fixture(scope="module")
def minilm() -> Iterator[ServedClient]:
    args = ["--model-path", MINILM_MODEL, "--is-embedding", "--device", "cpu", "--dtype", "float32"]
    with launch_server([*args, "--api-key", API_KEY], client_timeout=TIMEOUT_S) as client:
        yield client
        assert_idle_and_nothing_leaked(client)


@pytest.fixture(scope="module")
def minilm_hf() -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    folder = minilm_folder()
    return AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


def minilm_reference(hf: tuple[Any, Any], ids: list[int]) -> torch.Tensor:
    """sentence-transformers' all-MiniLM-L6-v2: the mean of the last hidden states, normalised."""
    with torch.no_grad():
        hidden = hf[1](torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(0), dim=0)


def test_the_openai_sdk_gets_minilms_sentence_embeddings(minilm: ServedClient, minilm_hf: tuple[Any, Any]) -> None:
    client = openai_client(minilm)
    # the SDK asks for base64 unless told (and decodes it itself), then float
    for extra in ({}, {"encoding_format": "float"}):
        reply = client.embeddings.create(model=MINILM_MODEL, input=SENTENCES, **extra)
        assert [d.index for d in reply.data] == list(range(len(SENTENCES)))
        ids = [minilm_hf[0](s)["input_ids"] for s in SENTENCES]
        assert reply.usage.prompt_tokens == sum(len(i) for i in ids)
        for data, prompt in zip(reply.data, ids):
            expected = minilm_reference(minilm_hf, prompt)
            assert len(data.embedding) == 384 and cosine(data.embedding, expected) > 0.9999
            torch.testing.assert_close(torch.tensor(data.embedding), expected, atol=1e-5, rtol=1e-4)
    short = client.embeddings.create(model=MINILM_MODEL, input=SENTENCES[0], dimensions=128).data[0].embedding
    full = minilm_reference(minilm_hf, minilm_hf[0](SENTENCES[0])["input_ids"])
    torch.testing.assert_close(
        torch.tensor(short), torch.nn.functional.normalize(full[:128], dim=0), atol=1e-5, rtol=1e-4
    )
    by_ids = client.embeddings.create(model=MINILM_MODEL, input=[minilm_hf[0](SENTENCES[2])["input_ids"]])
    assert (
        cosine(by_ids.data[0].embedding, minilm_reference(minilm_hf, minilm_hf[0](SENTENCES[2])["input_ids"])) > 0.9999
    )


def test_a_too_long_input_is_refused_or_truncated_when_asked(minilm: ServedClient, minilm_hf: tuple[Any, Any]) -> None:
    import openai

    client = openai_client(minilm)
    long_text = " ".join(["retrieval"] * 700)
    limit = minilm.server_info()["model"]["context_len"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MINILM_MODEL, input=long_text)
    length = len(minilm_hf[0](long_text)["input_ids"])
    assert str(length) in str(refused.value) and str(limit) in str(refused.value)
    cut = client.embeddings.create(model=MINILM_MODEL, input=long_text, extra_body={"truncate_prompt_tokens": 64})
    truncated = minilm_hf[0](long_text, truncation=True, max_length=64)["input_ids"]
    assert cut.usage.prompt_tokens == 64
    assert cosine(cut.data[0].embedding, minilm_reference(minilm_hf, truncated)) > 0.9999
    status, reply = http_json(
        minilm,
        "POST",
        "/v1/chat/completions",
        {"model": MINILM_MODEL, "messages": [{"role": "user", "content": "hi"}]},
        key=API_KEY,
    )
    assert status == 400 and "embedding" in reply["error"]["message"]


# ------------------------------------------------------------------ a causal LM as an embedder


@pytest.fixture(scope="module")
def llama_embedder(tiny_checkpoints: Any) -> Iterator[ServedClient]:
    args = base_args(
        tiny_checkpoints.path("llama"), "--is-embedding", "--served-model-name", "embedder", "--api-key", API_KEY
    )
    with launch_server(args, client_timeout=TIMEOUT_S) as client:
        yield client
        assert_idle_and_nothing_leaked(client)


def test_a_causal_lm_embeds_with_its_last_tokens_hidden_state(
    llama_embedder: ServedClient, tiny_checkpoints: Any
) -> None:
    from transformers import AutoModel, AutoTokenizer

    path = tiny_checkpoints.path("llama")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    texts = ["the quick brown fox jumps over the lazy dog " * 3, "hello world", "a b c d e f g"]
    reply = openai_client(llama_embedder).embeddings.create(model="embedder", input=texts, encoding_format="float")
    for data, text in zip(reply.data, texts):
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(last, dim=0)
        torch.testing.assert_close(torch.tensor(data.embedding), expected, atol=2e-5, rtol=1e-4)
        assert llama_embedder.embed(text=text) == pytest.approx(data.embedding, abs=1e-6)
    status, again = http_json(llama_embedder, "POST", "/encode", {"text": texts[0]}, key=API_KEY)
    assert status == 200 and again["meta_info"]["cached_tokens"] > 0
    assert again["embedding"] == pytest.approx(reply.data[0].embedding, abs=1e-6)


# ------------------------------------------------------------------ a cross-encoder


@pytest.fixture(scope="module")
def reranker(tiny_checkpoints: Any) -> Iterator[ServedClient]:
    args = base_args(
        tiny_checkpoints.path("bert_classifier"),
        "--is-embedding",
        "--served-model-name",
        "reranker",
        "--api-key",
        API_KEY,
    )
    with launch_server(args, client_timeout=TIMEOUT_S) as client:
        yield client
        assert_idle_and_nothing_leaked(client)


def test_rerank_orders_documents_by_the_cross_encoders_scores(reranker: ServedClient, tiny_checkpoints: Any) -> None:
    from transformers import AutoTokenizer

    from tests.support.checkpoints import load_hf_encoder

    path = tiny_checkpoints.path("bert_classifier")
    tokenizer, model = AutoTokenizer.from_pretrained(path), load_hf_encoder(path)
    query = "which city is the capital"
    documents = ["paris is a city in france", "the dog runs", "capital letters are large", "berlin is the capital"]
    status, reply = http_json(
        reranker, "POST", "/v1/rerank", {"query": query, "documents": documents, "top_n": 3}, key=API_KEY
    )
    assert status == 200
    with torch.no_grad():
        logits = [float(model(**tokenizer(query, d, return_tensors="pt")).logits[0, 0]) for d in documents]
    expected = sorted(range(len(documents)), key=lambda i: -logits[i])[:3]
    assert [r["index"] for r in reply["results"]] == expected
    for result in reply["results"]:
        assert result["relevance_score"] == pytest.approx(
            float(torch.sigmoid(torch.tensor(logits[result["index"]]))), abs=1e-5
        )
        assert result["document"]["text"] == documents[result["index"]]
    status, refused = http_json(reranker, "POST", "/v1/embeddings", {"model": "reranker", "input": "hi"}, key=API_KEY)
    assert status == 400 and "/v1/rerank" in refused["error"]["message"]


# ------------------------------------------------------------------ scoring on a generation server


def test_score_gives_label_token_probabilities_as_transformers(llama_server: ServedClient, hf_reference: Any) -> None:
    model, tokenizer = hf_reference("llama")
    query, items, labels = "is this good? ", ["yes it is", "no"], [5, 9, 17]
    status, reply = http_json(
        llama_server, "POST", "/v1/score", {"query": query, "items": items, "label_token_ids": labels}, key=API_KEY
    )
    assert status == 200 and reply["object"] == "scoring"
    softmaxed = http_json(
        llama_server,
        "POST",
        "/v1/score",
        {"query": query, "items": items, "label_token_ids": labels, "apply_softmax": True},
        key=API_KEY,
    )[1]
    for item, scores, normalised in zip(items, reply["scores"], softmaxed["scores"]):
        ids = tokenizer(query + item)["input_ids"]
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        assert scores == pytest.approx([float(probs[t]) for t in labels], rel=1e-3, abs=1e-6)
        picked = probs[labels]
        assert normalised == pytest.approx((picked / picked.sum()).tolist(), rel=1e-3, abs=1e-6)
    served = llama_server.server_info()["server_args"]["served_model_name"]
    status, refused = http_json(llama_server, "POST", "/v1/embeddings", {"model": served, "input": "hi"}, key=API_KEY)
    assert status == 400 and "--is-embedding" in refused["error"]["message"]
