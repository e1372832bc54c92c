"""SamplingParams: strict parsing of client dicts, range checks, msgpack round trip."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from runtime.protocol.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams, SamplingParamsError


def test_defaults_from_none_and_empty_dict() -> None:
    for d in (None, {}):
        p = SamplingParams.from_dict(d)
        assert p == SamplingParams()
        assert p.max_new_tokens == 128 and p.temperature == 1.0 and p.top_k == -1
        assert not p.is_greedy
        assert p.stop_strs == []


def test_unknown_field_is_named() -> None:
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.from_dict({"temperature": 0.5, "temprature": 0.1})
    assert ei.value.field == "temprature"
    assert "temprature" in str(ei.value)


def test_non_dict_rejected() -> None:
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", "abc"),
        ("temperature", "1.5"),  # numeric strings are not numbers either
        ("temperature", True),  # bool is not a number
        ("top_p", None),
        ("max_new_tokens", True),
        ("max_new_tokens", 1.5),
        ("top_k", 2.0),
        ("seed", 1.0),
        ("n", False),
        ("stop", ["ok", 3]),
        ("stop", 7),
        ("stop_token_ids", [1, True]),
        ("stop_token_ids", "1"),
        ("ignore_eos", "yes"),
        ("ignore_eos", 1),
    ],
)
def test_wrong_type_names_field(field: str, value: Any) -> None:
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.from_dict({field: value})
    assert ei.value.field == field
    assert field in str(ei.value)


def test_int_accepted_for_float() -> None:
    p = SamplingParams.from_dict({"temperature": 0, "top_p": 1, "repetition_penalty": 2})
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.repetition_penalty == 2.0
    assert p.is_greedy


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("max_new_tokens", -1),
        ("min_new_tokens", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", 3.0),
        ("presence_penalty", -3.0),
        ("n", 0),
        ("top_logprobs_num", -1),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [-1]),
        ("seed", 2**64),
    ],
)
def test_out_of_range_names_field_and_value(field: str, value: Any) -> None:
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.from_dict({field: value})
    assert ei.value.field == field
    assert field in str(ei.value)
    # The message shows the offending value (for a list, the offending element).
    shown = value[-1] if isinstance(value, list) else value
    assert repr(shown) in str(ei.value)


def test_min_new_tokens_bounded_by_max() -> None:
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.from_dict({"max_new_tokens": 4, "min_new_tokens": 5})
    assert ei.value.field == "min_new_tokens"
    SamplingParams.from_dict({"max_new_tokens": 5, "min_new_tokens": 5})


def test_vocab_bounds_need_vocab_size() -> None:
    p = SamplingParams.from_dict({"stop_token_ids": [0, 99], "top_logprobs_num": 50})
    p.validate(vocab_size=100)
    with pytest.raises(SamplingParamsError) as ei:
        p.validate(vocab_size=99)
    assert ei.value.field == "stop_token_ids" and "99" in str(ei.value)
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams(top_logprobs_num=101).validate(vocab_size=100)
    assert ei.value.field == "top_logprobs_num"


def test_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams.from_dict({"top_k": 0})


def test_derived_views() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1, temperature=0.8).is_greedy
    assert not SamplingParams(top_k=2, temperature=0.8).is_greedy
    assert SamplingParams(stop="x").stop_strs == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_strs == ["a", "b"]
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties


@pytest.mark.parametrize(
    "d",
    [
        {},
        {"max_new_tokens": 7, "temperature": 0, "stop": "\n\n"},
        {
            "max_new_tokens": 64,
            "min_new_tokens": 3,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "frequency_penalty": -0.5,
            "presence_penalty": 0.5,
            "stop": ["END", "###"],
            "stop_token_ids": [2, 3],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
            "seed": 2**63 + 5,
            "n": 4,
            "top_logprobs_num": 5,
        },
    ],
)
def test_msgpack_round_trip(d: dict[str, Any]) -> None:
    p = SamplingParams.from_dict(d)
    raw = msgspec.msgpack.encode(p)
    back = msgspec.msgpack.Decoder(SamplingParams).decode(raw)
    assert back == p
    for key, value in d.items():
        assert getattr(back, key) == value

    class Envelope(msgspec.Struct):
        rid: str
        sampling_params: SamplingParams

    env = msgspec.msgpack.Decoder(Envelope).decode(msgspec.msgpack.encode(Envelope("r1", p)))
    assert env.sampling_params == p


def test_defaults_are_omitted_on_the_wire() -> None:
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams())) == {}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(top_k=5))) == {"top_k": 5}


# ---- logit_bias -----------------------------------------------------------------------


def test_logit_bias_parsed_once_into_ids_and_values() -> None:
    p = SamplingParams.from_dict({"logit_bias": {"5": 100, "17": -2.5}})
    p.validate(vocab_size=18)
    assert p.logit_bias_entries == ((5, 17), (100.0, -2.5))
    assert p.logit_bias_entries is p.logit_bias_entries  # cached: the sampler never re-parses
    assert SamplingParams().logit_bias_entries == ((), ())
    # The cache stays on this side of the wire; the decoded copy parses for itself.
    raw = msgspec.msgpack.encode(p)
    assert msgspec.msgpack.decode(raw) == {"logit_bias": {"5": 100.0, "17": -2.5}}
    back = msgspec.msgpack.Decoder(SamplingParams).decode(raw)
    assert back == p and back.logit_bias_entries == ((5, 17), (100.0, -2.5))


@pytest.mark.parametrize(
    "bias,shown",
    [
        ({"x": 1.0}, "'x'"),  # not a decimal token id
        ({" 5": 1.0}, "' 5'"),
        ({"1_0": 1.0}, "'1_0'"),
        ({"5.0": 1.0}, "'5.0'"),
        ({"-1": 1.0}, "-1"),  # an id below 0
        ({"5": 100.5}, "100.5"),  # a bias out of [-100, 100]
        ({"5": -101}, "-101"),
        ({"5": float("nan")}, "nan"),
        ({"5": float("inf")}, "inf"),
        ({"5": 1.0, "05": 2.0}, "'05'"),  # the same id twice
        ({str(i): 1.0 for i in range(1025)}, "1025"),  # more than MAX_LOGIT_BIAS_ENTRIES
        ({"5": "1"}, "str"),  # wrong types
        ({"5": True}, "bool"),
        (["5"], "array"),
    ],
)
def test_logit_bias_errors_name_the_field(bias: Any, shown: str) -> None:
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.from_dict({"logit_bias": bias})
    assert ei.value.field == "logit_bias"
    assert "logit_bias" in str(ei.value) and shown in str(ei.value)


def test_logit_bias_ids_bounded_by_vocab_size() -> None:
    p = SamplingParams.from_dict({"logit_bias": {"0": -100, "99": 100}})
    p.validate(vocab_size=100)
    with pytest.raises(SamplingParamsError) as ei:
        p.validate(vocab_size=99)
    assert ei.value.field == "logit_bias" and "99" in str(ei.value)
    assert MAX_LOGIT_BIAS_ENTRIES == 1024
    SamplingParams.from_dict({"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)}})
