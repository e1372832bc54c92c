"""``ChunkMeta``: what an output carries beside its text, typed from the detokenizer to the client.
Only the fields set travel; token ids in logprob entries stay integers through the typed decoders;
the client's ``meta`` dict holds exactly the fields set."""

from __future__ import annotations

import msgspec

from runtime.protocol.messages import BatchStrOut, ChunkMeta, GenerateChunk, StrOutput, TokenizerInput


def test_only_the_fields_set_travel_and_come_back_typed() -> None:
    meta = ChunkMeta(
        prompt_tokens=9,
        completion_tokens=2,
        cached_tokens=0,
        output_token_logprobs=[[-0.5, 70], [-1.25, 71]],
        input_token_logprobs=[[None, 5], [-1.5, 6]],
    )
    chunk = GenerateChunk(rid="r", text="ab", output_ids=[70, 71], finished=False, meta=meta)
    raw = msgspec.msgpack.encode(chunk)
    assert b"latency" not in raw and b"grammar_cache_hit" not in raw  # unset fields are not sent
    back = msgspec.msgpack.decode(raw, type=GenerateChunk)
    assert back.meta == meta
    assert [type(token) for _, token in back.meta.output_token_logprobs or ()] == [int, int]
    assert back.meta.cached_tokens == 0  # a zero count is a value, not an absence
    assert back.meta.as_dict() == {
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.5, 70], [-1.25, 71]],
        "input_token_logprobs": [[None, 5], [-1.5, 6]],
    }


def test_an_output_without_meta_decodes_to_an_empty_one() -> None:
    out = BatchStrOut(outputs=[StrOutput(rid="r", text_delta="x", new_output_ids=[1])])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=TokenizerInput)
    assert isinstance(back, BatchStrOut) and back.outputs[0].meta == ChunkMeta()
    assert back.outputs[0].meta.as_dict() == {}


def test_a_mistyped_field_is_refused_at_the_boundary() -> None:
    chunk = {"type": "chunk", "rid": "r", "text": "", "output_ids": [], "finished": True, "meta": {"index": "0"}}
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(chunk), type=GenerateChunk)
    except msgspec.ValidationError as exc:
        assert "meta.index" in str(exc)
    else:
        raise AssertionError("a string index was accepted")
