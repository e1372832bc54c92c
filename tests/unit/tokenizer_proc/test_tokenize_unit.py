"""RequestBuilder.tokenize / detokenize: a prompt is counted exactly as ``build`` would serve it, and an
over-long one is counted, not refused (finding out is why a client counts); malformed requests are refused
by name. A stand-in tokenizer keeps it in-process and exact."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.protocol.messages import DetokenizeReq, GenerateReq, TokenizeReq
from tokenizer_proc.request_builder import ModelLimits, Rejected, RequestBuilder

LIMITS = ModelLimits(vocab_size=300, context_len=64, max_req_input_len=32, max_total_tokens=1000)


class ByteTokenizer:
    """One id per byte; special tokens 256 (BOS) and 257 (EOS); a template that tags each turn."""

    chat_template = "tagged"
    specials = {256: "<s>", 257: "</s>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([256] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        special = "" if skip_special_tokens else None
        return "".join(
            self.specials[i] if special is None and i in self.specials else "" if i in self.specials else chr(i)
            for i in ids
        )

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any, tokenize: bool, **kwargs: Any) -> str:
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return text + ("[assistant]" if kwargs.get("add_generation_prompt") else "")


def builder() -> RequestBuilder:
    return RequestBuilder(ByteTokenizer(), LIMITS)


def test_a_chat_counts_as_it_is_served() -> None:
    messages = [{"role": "user", "content": "hi"}]
    ids = builder().tokenize(TokenizeReq(rid="t", messages=messages))
    (served,) = builder().build(GenerateReq(rid="g", messages=messages, sampling_params={"max_new_tokens": 1}))
    assert ids == served.input_ids == list(b"[user]hi[assistant]")
    without = builder().tokenize(
        TokenizeReq(rid="t", messages=messages, chat_template_kwargs={"add_generation_prompt": False})
    )
    assert without == list(b"[user]hi")


def test_a_text_keeps_its_special_tokens_unless_asked() -> None:
    assert builder().tokenize(TokenizeReq(rid="t", text="ab")) == [256, 97, 98]
    assert builder().tokenize(TokenizeReq(rid="t", text="ab", add_special_tokens=False)) == [97, 98]


def test_an_over_long_prompt_is_counted_not_refused() -> None:
    text = "x" * (LIMITS.max_req_input_len * 8)
    with pytest.raises(Rejected, match="tokens|bytes"):
        builder().build(GenerateReq(rid="g", text=text))
    assert len(builder().tokenize(TokenizeReq(rid="t", text=text))) == len(text) + 1
    long_chat = [{"role": "user", "content": text}]
    assert len(builder().tokenize(TokenizeReq(rid="t", messages=long_chat))) == len(text) + len("[user][assistant]")


def test_malformed_requests_are_refused_by_name() -> None:
    with pytest.raises(Rejected, match="exactly one of text, messages"):
        builder().tokenize(TokenizeReq(rid="t"))
    with pytest.raises(Rejected, match="empty prompt"):
        builder().tokenize(TokenizeReq(rid="t", messages=[]))
    with pytest.raises(Rejected) as refused:
        builder().detokenize(DetokenizeReq(rid="d", tokens=[1, 300]))
    assert refused.value.param == "tokens" and "300" in refused.value.message


def test_ids_come_back_as_text() -> None:
    assert builder().detokenize(DetokenizeReq(rid="d", tokens=[256, 104, 105])) == "<s>hi"
    assert builder().detokenize(DetokenizeReq(rid="d", tokens=[256, 104, 105], skip_special_tokens=True)) == "hi"


def test_a_budget_past_the_context_is_refused_unless_it_may_be_fitted() -> None:
    """An explicit max_new_tokens past the context's room is refused (OpenAI's and SGLang's bodies); a
    request that may be fitted (Anthropic's: Claude Code asks for its model's whole budget) is shortened
    to the room instead."""
    ask = {"max_new_tokens": 1000}
    with pytest.raises(Rejected, match="exceeds the context length"):
        builder().build(GenerateReq(rid="g", text="hi", sampling_params=ask))
    (fitted,) = builder().build(GenerateReq(rid="g", text="hi", sampling_params=ask, fit_max_tokens=True))
    assert fitted.sampling_params.max_new_tokens == LIMITS.context_len - len(fitted.input_ids)
