"""POST /tokenize and /detokenize and the ZMQ client's ``tokenize()``/``detokenize()`` on the default
model (the session's fp32 SmolLM2 server), against transformers' own tokenizer of the same GGUF file:

* a text's ids equal transformers' (with and without special tokens), for one text and a list;
* a chat's ids equal transformers' rendering of its template with the generation prompt, and their
  count is the ``prompt_tokens`` the server reports when it serves the same messages;
* ids come back as the same text; bad ids and bodies are 400s naming the field;
* both bodies' dialects (SGLang's ``text``, vLLM's ``prompt`` and ``token_strs``) are answered.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from runtime.client import RequestError
from tests.support.real_model import API_KEY, smollm2_file
from tests.support.server_fixtures import assert_idle_and_nothing_leaked, http_json
from tests.support.server_process import ServedClient

pytest_plugins = ["tests.support.real_model"]

TEXTS = ["The capital of France is", "héllo wörld, ünïcode and emoji 🙂", "def add(a, b):\n    return a + b"]
CHAT = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = smollm2_file()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def server(smollm2_server: ServedClient) -> Iterator[ServedClient]:
    yield smollm2_server
    assert_idle_and_nothing_leaked(smollm2_server)


def post(server: ServedClient, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return http_json(server, "POST", path, body, key=API_KEY)


def test_texts_tokenize_as_transformers_does(server: ServedClient, hf_tokenizer: Any) -> None:
    context = server.server_info()["model"]["context_len"]
    for text in TEXTS:
        expected = hf_tokenizer(text)["input_ids"]
        status, reply = post(server, "/tokenize", {"prompt": text})
        assert status == 200 and reply == {"tokens": expected, "count": len(expected), "max_model_len": context}
        assert server.tokenize(text)["tokens"] == expected
        bare = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"] == bare
    status, batch = post(server, "/tokenize", {"prompt": TEXTS, "return_token_strs": True})
    assert status == 200 and batch["tokens"] == [hf_tokenizer(t)["input_ids"] for t in TEXTS]
    assert batch["count"] == [len(ids) for ids in batch["tokens"]]
    assert batch["token_strs"] == [hf_tokenizer.convert_ids_to_tokens(ids) for ids in batch["tokens"]]


def test_a_chat_counts_what_the_server_serves(server: ServedClient, hf_tokenizer: Any) -> None:
    expected = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    expected_ids = hf_tokenizer(expected, add_special_tokens=False)["input_ids"]
    status, reply = post(server, "/tokenize", {"messages": CHAT})
    assert status == 200 and reply["tokens"] == expected_ids
    assert server.tokenize(messages=CHAT)["tokens"] == expected_ids
    served = server.generate(messages=CHAT, sampling_params={"max_new_tokens": 1, "temperature": 0})
    assert served["meta"]["prompt_tokens"] == reply["count"]
    # without the generation prompt, the template's assistant header is not there
    shorter = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})[1]
    assert shorter["tokens"] == expected_ids[: shorter["count"]] and shorter["count"] < reply["count"]


def test_ids_come_back_as_text(server: ServedClient, hf_tokenizer: Any) -> None:
    for text in TEXTS:
        ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        status, reply = post(server, "/detokenize", {"tokens": ids})
        assert status == 200 and reply["text"] == reply["prompt"] == hf_tokenizer.decode(ids) == text
        assert server.detokenize(ids) == text
    batch = [hf_tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert post(server, "/detokenize", {"tokens": batch})[1]["text"] == TEXTS
    chat_ids = post(server, "/tokenize", {"messages": CHAT})[1]["tokens"]
    kept = post(server, "/detokenize", {"tokens": chat_ids})[1]["text"]
    skipped = post(server, "/detokenize", {"tokens": chat_ids, "skip_special_tokens": True})[1]["text"]
    assert "<|im_start|>" in kept and "<|im_start|>" not in skipped


def test_bad_requests_name_the_field(server: ServedClient) -> None:
    vocab = server.server_info()["model"]["vocab_size"]
    status, reply = post(server, "/detokenize", {"tokens": [1, vocab]})
    assert status == 400 and reply["error"]["param"] == "tokens" and str(vocab) in reply["error"]["message"]
    with pytest.raises(RequestError, match="tokens: token id"):
        server.detokenize([vocab])
    status, reply = post(server, "/tokenize", {"prompt": "a", "messages": CHAT})
    assert status == 400 and "exactly one of prompt, messages" in reply["error"]["message"]
    status, reply = post(server, "/tokenize", {"prompt": 3})
    assert status == 400 and reply["error"]["param"] == "prompt"
    status, reply = http_json(server, "POST", "/tokenize", {"prompt": "a"}, key="wrong")
    assert status == 401
