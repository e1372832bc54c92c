"""Embedding requests through the RequestBuilder (tokenizer_proc/embedding_build.py), against the real
tokenizer of all-MiniLM-L6-v2 (BERT's WordPiece, with [CLS]/[SEP] and token types) as the oracle:
a text and a (query, document) pair are tokenized exactly as the tokenizer encodes them, token types
included; truncation keeps the first tokens and the closing [SEP]; an input past the limit is refused
with both lengths; a server serves one kind of request and says so to the other kind."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.checkpoints.model_source import minilm_folder
from runtime.protocol.messages import GenerateReq
from runtime.text.tokenizer import load_tokenizer
from tokenizer_proc.request_builder import ModelLimits, Rejected, RequestBuilder

LIMIT = 40  # a small limit, so that a few sentences pass it
LIMITS = ModelLimits(vocab_size=30522, context_len=512, max_req_input_len=LIMIT, max_total_tokens=4096)
QUERY = "how do embeddings work"
DOC = "an embedding model maps a text to a vector so that similar texts land close together in that space"
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(str(minilm_folder()))


def embedder(tokenizer: Any) -> RequestBuilder:
    return RequestBuilder(tokenizer, LIMITS, is_embedding=True)


def embed(tokenizer: Any, **fields: Any) -> Any:
    (built,) = embedder(tokenizer).build(GenerateReq(rid="e", embed=True, **fields))
    return built


def refusal(builder: RequestBuilder, **fields: Any) -> Rejected:
    with pytest.raises(Rejected) as refused:
        builder.build(GenerateReq(rid="r", **fields))
    return refused.value


def test_a_text_is_tokenized_as_the_tokenizer_encodes_it(tokenizer: Any) -> None:
    built = embed(tokenizer, text=QUERY, sampling_params={"max_new_tokens": 99, "n": 3}, priority=4, stream=True)
    expected = tokenizer(QUERY)
    assert built.input_ids == expected["input_ids"] and built.input_ids[0] == tokenizer.cls_token_id
    assert built.input_ids[-1] == tokenizer.sep_token_id
    assert built.token_type_ids == expected["token_type_ids"] == [0] * len(built.input_ids)
    # prefill only: nothing is sampled whatever the body said
    assert built.embed and built.sampling_params.max_new_tokens == 0 and built.sampling_params.n == 1
    assert built.priority == 4 and built.stream and not built.return_logprob


def test_a_pair_has_the_tokenizers_pair_encoding_and_token_types(tokenizer: Any) -> None:
    built = embed(tokenizer, text=QUERY, text_pair=DOC)
    expected = tokenizer(QUERY, DOC)
    assert built.input_ids == expected["input_ids"]
    assert built.token_type_ids == expected["token_type_ids"]
    query_len = len(tokenizer(QUERY)["input_ids"])  # [CLS] query [SEP]: type 0; document [SEP]: type 1
    assert built.token_type_ids == [0] * query_len + [1] * (len(built.input_ids) - query_len)
    assert built.input_ids.count(tokenizer.sep_token_id) == 2


def test_truncation_keeps_the_first_tokens_and_the_closing_separator(tokenizer: Any) -> None:
    full = tokenizer(LONG)["input_ids"]
    assert len(full) > LIMIT
    for keep in (5, LIMIT):
        built = embed(tokenizer, text=LONG, truncate_prompt_tokens=keep)
        assert len(built.input_ids) == keep == len(built.token_type_ids)
        assert built.input_ids[: keep - 1] == full[: keep - 1] and built.input_ids[-1] == tokenizer.sep_token_id
    # -1: as many as the model takes
    assert (
        embed(tokenizer, text=LONG, truncate_prompt_tokens=-1).input_ids
        == embed(tokenizer, text=LONG, truncate_prompt_tokens=LIMIT).input_ids
    )
    # a pair is cut as the tokenizer cuts pairs (longest first, as sentence-transformers' CrossEncoder
    # does): [CLS] a head of the query [SEP] a head of the document [SEP]; a short input is not cut
    pair = embed(tokenizer, text=QUERY, text_pair=LONG, truncate_prompt_tokens=12)
    assert len(pair.input_ids) == 12 == len(pair.token_type_ids)
    first_sep = pair.input_ids.index(tokenizer.sep_token_id)
    query_ids = tokenizer(QUERY, add_special_tokens=False)["input_ids"]
    doc_ids = tokenizer(LONG, add_special_tokens=False)["input_ids"]
    assert pair.input_ids[0] == tokenizer.cls_token_id and pair.input_ids[-1] == tokenizer.sep_token_id
    assert pair.input_ids[1:first_sep] == query_ids[: first_sep - 1]
    assert pair.input_ids[first_sep + 1 : -1] == doc_ids[: 12 - first_sep - 2]
    assert pair.token_type_ids == [0] * (first_sep + 1) + [1] * (11 - first_sep)
    assert embed(tokenizer, text=QUERY, truncate_prompt_tokens=LIMIT).input_ids == tokenizer(QUERY)["input_ids"]
    # token ids: their first k
    ids = list(range(1000, 1000 + LIMIT + 9))
    built = embed(tokenizer, input_ids=ids, truncate_prompt_tokens=7)
    assert built.input_ids == ids[:7] and built.token_type_ids is None


def test_an_input_past_the_limit_is_refused_with_both_lengths(tokenizer: Any) -> None:
    n = len(tokenizer(LONG)["input_ids"])
    refused = refusal(embedder(tokenizer), embed=True, text=LONG)
    assert refused.code == "too_long" and refused.param == "prompt"
    assert f"{n} tokens" in refused.message and f"limit of {LIMIT}" in refused.message
    assert "truncate_prompt_tokens" in refused.message
    ids = refusal(embedder(tokenizer), embed=True, input_ids=[5] * (LIMIT + 1))
    assert ids.code == "too_long" and f"{LIMIT + 1} tokens" in ids.message
    assert embed(tokenizer, input_ids=[5] * LIMIT).input_ids == [5] * LIMIT  # the limit itself is served


@pytest.mark.parametrize("truncate", [0, -2, LIMIT + 1])
def test_a_truncation_the_model_cannot_take_is_refused(tokenizer: Any, truncate: int) -> None:
    refused = refusal(embedder(tokenizer), embed=True, text=QUERY, truncate_prompt_tokens=truncate)
    assert refused.code == "invalid_request" and refused.param == "truncate_prompt_tokens"
    assert str(truncate) in refused.message


def test_a_cut_below_the_special_tokens_is_refused(tokenizer: Any) -> None:
    refused = refusal(embedder(tokenizer), embed=True, text=QUERY, text_pair=DOC, truncate_prompt_tokens=2)
    assert refused.param == "truncate_prompt_tokens" and "cannot be cut to 2 tokens" in refused.message


def test_each_server_refuses_the_other_kind_of_request(tokenizer: Any) -> None:
    generation = RequestBuilder(tokenizer, LIMITS)
    refused = refusal(generation, embed=True, text=QUERY)
    assert refused.code == "invalid_request" and "--is-embedding" in refused.message
    for fields in ({"text": QUERY}, {"input_ids": [101, 102]}, {"messages": [{"role": "user", "content": "hi"}]}):
        refused = refusal(embedder(tokenizer), **fields)
        assert refused.code == "invalid_request" and "serves embeddings" in refused.message, fields
    # the embedding fields mean nothing to a generation request
    for name, value in (("text_pair", DOC), ("truncate_prompt_tokens", 8)):
        refused = refusal(generation, text=QUERY, **{name: value})
        assert refused.param == name and "embedding request" in refused.message


def test_malformed_embedding_requests_are_refused_by_name(tokenizer: Any) -> None:
    builder = embedder(tokenizer)
    for fields, param in (
        ({"input_ids": [1], "text_pair": DOC}, "text_pair"),
        ({"text": ""}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"text": QUERY, "return_logprob": True}, "return_logprob"),
        ({"text": QUERY, "token_ids_logprob": [5]}, "token_ids_logprob"),
        ({"input_ids": [30522]}, "input_ids"),
        ({"text": QUERY, "priority": 2**63}, "priority"),
    ):
        assert refusal(builder, embed=True, **fields).param == param, fields
    assert "exactly one of" in refusal(builder, embed=True, text=QUERY, input_ids=[1]).message


class TemplateTokenizer:
    """One id per byte, and a template that tags each turn (the generation prompt: ``[assistant]``)."""

    chat_template = "tagged"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any, tokenize: bool, **kwargs: Any) -> str:
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return text + ("[assistant]" if kwargs.get("add_generation_prompt") else "")


def test_a_conversation_is_embedded_through_the_template_without_a_generation_prompt() -> None:
    limits = ModelLimits(vocab_size=256, context_len=512, max_req_input_len=64, max_total_tokens=4096)
    builder = RequestBuilder(TemplateTokenizer(), limits, is_embedding=True)
    messages = [{"role": "user", "content": "hi"}]
    (built,) = builder.build(GenerateReq(rid="c", embed=True, messages=messages))
    assert built.input_ids == list(b"[user]hi") and built.token_type_ids is None
    (asked,) = builder.build(
        GenerateReq(rid="c", embed=True, messages=messages, chat_template_kwargs={"add_generation_prompt": True})
    )
    assert asked.input_ids == list(b"[user]hi[assistant]")
    (cut,) = builder.build(GenerateReq(rid="c", embed=True, messages=messages, truncate_prompt_tokens=3))
    assert cut.input_ids == list(b"[us")


def test_the_rust_tokenizers_own_encoding_equals_transformers_call_and_a_truncation_leaves_it_alone(
    tokenizer: Any,
) -> None:
    """Untruncated texts and pairs take the Rust tokenizer's encode directly; after a truncating call
    (which leaves its truncation set on the backend) transformers' call encodes instead."""
    from runtime.checkpoints.tiny_model import embedded_corpus
    from tokenizer_proc.embedding_build import encode_text

    texts = [*embedded_corpus(200, seed=4), "héllo wörld 🙂", "  spaced  out  "]
    for i, text in enumerate(texts):
        pair = texts[i - 1] if i % 3 == 0 else None
        expected = tokenizer(text, pair, add_special_tokens=True)
        assert encode_text(tokenizer, text, pair, None) == (expected["input_ids"], expected["token_type_ids"])
    long_text = " ".join(texts[:20])
    cut, _ = encode_text(tokenizer, long_text, None, 16)
    assert len(cut) == 16 and cut[-1] == tokenizer.sep_token_id
    assert encode_text(tokenizer, long_text, None, None)[0] == tokenizer(long_text)["input_ids"]
