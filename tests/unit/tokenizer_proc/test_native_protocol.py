"""SGLang's native /generate body and reply without a server: the body's translation into
GenerateReqs (tokenizer_proc/native_protocol.py), the reply's SGLang shape (native_reply.py), and
``stop_regex`` from its check (SamplingParams) to the stop it causes (StopChecker)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pydantic import ValidationError

from runtime.protocol.messages import ChunkMeta, GenerateChunk, GenerateReq
from runtime.protocol.sampling_params import SamplingParams, SamplingParamsError
from scheduler_proc.req import Req, StopChecker
from tokenizer_proc.native_protocol import NativeGenerateReq
from tokenizer_proc.native_reply import NativeReplies, SampleSoFar
from tokenizer_proc.openai_protocol import BadRequest


def reqs_of(body: dict[str, Any]) -> tuple[list[GenerateReq], bool]:
    return NativeGenerateReq.model_validate(body).generate_reqs()


def test_a_batch_spreads_single_values_and_takes_per_prompt_lists() -> None:
    reqs, batch = reqs_of(
        {
            "text": ["a", "b"],
            "sampling_params": [{"max_new_tokens": 3, "top_k": None}, {"sampling_seed": 7, "stream_interval": 4}],
            "return_logprob": [True, False],
            "logprob_start_len": 0,
            "token_ids_logprob": [[1, 2], [3]],
            "rid": "fam",
        }
    )
    assert batch and [r.rid for r in reqs] == ["fam_0", "fam_1"] and [r.text for r in reqs] == ["a", "b"]
    assert [r.sampling_params for r in reqs] == [{"max_new_tokens": 3}, {"seed": 7}]
    assert [r.return_logprob for r in reqs] == [True, False] and [r.logprob_start_len for r in reqs] == [0, 0]
    assert [r.token_ids_logprob for r in reqs] == [[1, 2], [3]]
    single, batch = reqs_of({"input_ids": [4, 5], "token_ids_logprob": [9], "rid": "one", "priority": None})
    assert not batch and single[0].rid == "one" and single[0].token_ids_logprob == [9] and single[0].priority == 0
    assert single[0].logprob_start_len == -1 and single[0].top_logprobs_num == 0
    shared, _ = reqs_of({"input_ids": [[1], [2]], "token_ids_logprob": [9, 8]})
    assert [r.token_ids_logprob for r in shared] == [[9, 8], [9, 8]] and shared[0].rid != shared[1].rid


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": ["a", "b"], "top_logprobs_num": [1]}, "top_logprobs_num"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["a", "b"], "token_ids_logprob": [[1]]}, "token_ids_logprob"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
        ({"text": "a", "rid": ["x"]}, "rid"),
        ({"text": ["a", "b"], "stream": True}, "stream"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": []}, "text"),
        ({"text": "a", "sampling_params": {"structural_tag": "{}"}}, "structural_tag"),
        ({"text": "a", "sampling_params": [{"beam_width": 2}]}, "beam_width"),
        ({"text": ["a", "b"], "lora_path": ["x"]}, "lora_path"),
        ({"text": "a", "lora_id": "x"}, "lora_id"),
        ({"text": "a", "image_data": ["x.png"]}, "image_data"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        reqs_of(body)
    assert refused.value.param == param and refused.value.status == 400


def test_lora_path_is_one_adapter_for_all_prompts_or_one_per_prompt() -> None:
    reqs, _ = reqs_of({"text": ["a", "b"], "lora_path": "x"})
    assert [r.lora_path for r in reqs] == ["x", "x"]
    reqs, _ = reqs_of({"text": ["a", "b"], "lora_path": [None, "y"]})
    assert [r.lora_path for r in reqs] == [None, "y"]


def test_types_stay_strict_and_unknown_fields_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValidationError):
        NativeGenerateReq.model_validate({"text": "a", "return_logprob": "yes"})
    with pytest.raises(ValidationError):
        NativeGenerateReq.model_validate({"text": "a", "logprob_start_len": [True]})
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            reqs_of({"text": "a", "model": "m", "routing_key_of_a_test": 1, "image_data": None})
    warned = [r.getMessage() for r in caplog.records if "routing_key_of_a_test" in r.getMessage()]
    assert len(warned) == 1


def chunk(rid: str, text: str, ids: list[int], finished: bool, **meta: Any) -> GenerateChunk:
    reason = {"type": "length", "length": 2} if finished else None
    return GenerateChunk(
        rid=rid, text=text, output_ids=ids, finished=finished, finish_reason=reason, meta=ChunkMeta(**meta)
    )


def test_the_reply_has_sglang_keys_triples_and_integer_ids() -> None:
    req = GenerateReq(rid="r", text="x", return_logprob=True, top_logprobs_num=1)
    replies = NativeReplies([req], token_text=lambda t: f"<{t}>", with_text=True, weight_version="v1")
    sample = SampleSoFar()
    first = chunk(
        "r",
        "ab",
        [7],
        False,
        prompt_tokens=3,
        completion_tokens=1,
        cached_tokens=0,
        output_token_logprobs=[[-0.5, 7.0]],
        output_top_logprobs=[[[-0.5, 7.0]]],
        input_token_logprobs=[[None, 1], [-1.5, 2]],
        input_top_logprobs=[None, [[-1.0, 4.0]]],
    )
    sample.add(first)
    mid = replies.result(first, sample)
    assert mid["meta_info"]["finish_reason"] is None and "e2e_latency" not in mid["meta_info"]
    last = chunk("r", "c", [8], True, completion_tokens=2, latency=0.25, output_token_logprobs=[[-0.25, 8]])
    sample.add(last)
    out = replies.result(last, sample)
    meta = out["meta_info"]
    assert out["text"] == "abc" and out["output_ids"] == [7, 8]
    assert meta["id"] == "r" and meta["e2e_latency"] == 0.25 and meta["weight_version"] == "v1"
    assert meta["finish_reason"] == {"type": "length", "length": 2} and "latency" not in meta
    assert meta["output_token_logprobs"] == [[-0.5, 7, "<7>"], [-0.25, 8, "<8>"]]
    assert meta["input_token_logprobs"] == [[None, 1, "<1>"], [-1.5, 2, "<2>"]]
    assert meta["input_top_logprobs"] == [None, [[-1.0, 4, "<4>"]]]
    assert all(type(e[1]) is int for e in meta["output_token_logprobs"] + meta["output_top_logprobs"][0])
    plain = NativeReplies([req], token_text=lambda t: "unused", with_text=False, weight_version="v1")
    assert plain.result(last, sample)["meta_info"]["output_token_logprobs"][0] == [-0.5, 7, None]
    quiet = NativeReplies([GenerateReq(rid="q", text="x")], lambda t: "", False, "v")
    assert "output_token_logprobs" not in quiet.result(chunk("q", "", [], True), SampleSoFar())["meta_info"]


class CharTokenizer:
    """Token id i is the character chr(i): text is exactly the ids."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_stop_regex_is_checked_then_stops_at_its_first_match() -> None:
    with pytest.raises(SamplingParamsError) as bad:
        SamplingParams.from_dict({"stop_regex": "(open"})
    assert bad.value.field == "stop_regex"
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict({"stop_regex": ["x", "y?"]})  # matches the empty text
    params = SamplingParams.from_dict({"stop_regex": [r"\d\d", "end$"], "max_new_tokens": 50})
    checker = StopChecker(set(), 1000, CharTokenizer())
    req = Req(rid="s", origin_input_ids=[1], sampling_params=params)
    for ch in "ab1c22":
        assert req.finish_reason is None, req.output_ids
        req.output_ids.append(ord(ch))
        checker.check(req)
    assert req.finish_reason == {"type": "stop", "matched": "22"}
    other = Req(rid="t", origin_input_ids=[1], sampling_params=params)
    for ch in "the end":
        other.output_ids.append(ord(ch))
        checker.check(other)
    assert other.finish_reason == {"type": "stop", "matched": "end"}
