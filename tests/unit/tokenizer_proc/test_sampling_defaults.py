"""Sampling defaults from the model (issue 47): a request's unset sampling fields take the model's
generation_config.json values (SGLang's --sampling-defaults model), else the built-in ones.

* what is read: SGLang's five fields only, as the file sets them; a value the server would refuse
  is dropped (with its reason), never handed to a request that did not send it;
* GGUF files: prepare writes generation_config.json from llama.cpp's general.sampling.* metadata,
  else from the shipped default of the embedded model; the file wins;
* applying: per field, the request's value wins; --sampling-defaults openai ignores the file;
* OpenAI refusals name the field the client sent (max_tokens, not max_new_tokens).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from runtime.checkpoints.gguf.prepare import prepare_gguf
from runtime.checkpoints.sampling_defaults import (
    SMOLLM2_SAMPLING_DEFAULTS,
    gguf_sampling,
    read_model_sampling,
)
from runtime.config.args import ServerArgs
from runtime.protocol.field_refs import FieldRef, bare_name, render
from runtime.protocol.messages import GenerateReq
from runtime.protocol.sampling_params import SamplingParams, SamplingParamsError
from tests.support.checkpoints import TinyCheckpoints
from tests.support.gguf_files import write_checkpoint_gguf
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.request_builder import ModelLimits, Rejected, RequestBuilder
from tokenizer_proc.sampling_defaults import SamplingDefaults

LIMITS = ModelLimits(vocab_size=100, context_len=64, max_req_input_len=60, max_total_tokens=1000)


def _folder(tmp_path: Path, config: Any) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def _params(builder: RequestBuilder, sampling_params: Any) -> Any:
    return builder.build(GenerateReq(rid="r", input_ids=[1, 2], sampling_params=sampling_params))[0].sampling_params


# ---------------------------------------------------------------------- reading generation_config.json


def test_reads_sglangs_fields_as_the_file_sets_them(tmp_path: Path) -> None:
    config = {
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "do_sample": False,  # ignored, as SGLang and vLLM ignore it: the temperature decides
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_new_tokens": 2048,  # not a sampling default (SGLang leaves it to the request)
    }
    model = read_model_sampling(_folder(tmp_path, config))
    assert model.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert model.source == str(tmp_path / "generation_config.json") and model.ignored == {}


def test_keys_the_file_leaves_out_stay_out(tmp_path: Path) -> None:
    """transformers' GenerationConfig.to_dict() would add its own top_k 50: no model author chose it."""
    assert read_model_sampling(_folder(tmp_path, {"eos_token_id": 2, "temperature": None})).values == {}
    assert read_model_sampling(tmp_path / "no-such-folder").values == {}


@pytest.mark.parametrize("top_k, expected", [(0, -1), (-5, -1), (40, 40), (40.0, 40), (1, 1)])
def test_top_k_off_is_minus_one(tmp_path: Path, top_k: Any, expected: int) -> None:
    """HF and llama.cpp turn top_k off with 0 (llama.cpp with any value <= 0); here off is -1."""
    assert read_model_sampling(_folder(tmp_path, {"top_k": top_k})).values == {"top_k": expected}


def test_a_value_the_server_refuses_is_dropped_with_its_reason(tmp_path: Path) -> None:
    config = {"temperature": "hot", "top_p": 0.0, "top_k": 2.5, "min_p": 0.1, "repetition_penalty": True}
    model = read_model_sampling(_folder(tmp_path, config))
    assert model.values == {"min_p": 0.1}
    assert set(model.ignored) == {"temperature", "top_p", "top_k", "repetition_penalty"}
    assert "must be in (0, 1]" in model.ignored["top_p"]


@pytest.mark.parametrize("text", ["[1, 2]", "{not json"])
def test_an_unreadable_file_gives_no_defaults(tmp_path: Path, text: str) -> None:
    (tmp_path / "generation_config.json").write_text(text)
    model = read_model_sampling(tmp_path)
    assert model.values == {} and list(model.ignored) == ["generation_config.json"]


# ---------------------------------------------------------------------- GGUF files


def test_gguf_sampler_keys_map_to_generation_config_names() -> None:
    metadata = {
        "general.sampling.temp": 0.699999988079071,  # f32 0.7
        "general.sampling.top_k": 20,
        "general.sampling.top_p": 0.949999988079071,
        "general.sampling.min_p": 0.0,
        "general.sampling.penalty_repeat": 1.0499999523162842,
        "general.sampling.mirostat": 2,  # no field here
        "general.name": "x",
    }
    assert gguf_sampling(metadata) == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.95,
        "min_p": 0.0,
        "repetition_penalty": 1.05,
    }
    assert gguf_sampling({"general.name": "x"}) == {}


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TINYSERVE_CACHE", str(root))
    return root


def _sampler_metadata(writer: Any) -> None:
    writer.add_float32("general.sampling.temp", 0.3)
    writer.add_int32("general.sampling.top_k", 0)


def test_prepare_writes_the_files_sampler_metadata_over_the_shipped_default(
    tiny_checkpoints: TinyCheckpoints, tmp_path: Path, private_cache: Path
) -> None:
    src = tiny_checkpoints.path("llama")
    plain = write_checkpoint_gguf(src, tmp_path / "plain.gguf", tokenizer=False)
    tagged = write_checkpoint_gguf(src, tmp_path / "tagged.gguf", tokenizer=False, extra=_sampler_metadata)
    assert read_model_sampling(prepare_gguf(plain)).values == {}  # no metadata, no fallback: none
    shipped = prepare_gguf(plain, fallback_sampling=SMOLLM2_SAMPLING_DEFAULTS)
    assert shipped != prepare_gguf(plain)  # the fallback is part of the folder's key
    assert read_model_sampling(shipped).values == {"temperature": 0.2, "top_p": 0.9}
    own = prepare_gguf(tagged, fallback_sampling=SMOLLM2_SAMPLING_DEFAULTS)
    assert read_model_sampling(own).values == {"temperature": 0.3, "top_k": -1}  # the file says otherwise


# ---------------------------------------------------------------------- applying them


def test_the_requests_own_values_win_field_by_field(tmp_path: Path) -> None:
    defaults = SamplingDefaults("model", read_model_sampling(_folder(tmp_path, {"temperature": 0.0, "top_p": 0.9})))
    builder = RequestBuilder(tokenizer=None, limits=LIMITS, sampling_defaults=defaults.values)
    unset = _params(builder, None)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.0, 0.9, -1) and unset.is_greedy
    assert _params(builder, {"max_new_tokens": 3}).temperature == 0.0
    mixed = _params(builder, {"temperature": 0.8})
    assert (mixed.temperature, mixed.top_p) == (0.8, 0.9)  # temperature the request's, top_p the model's
    assert _params(RequestBuilder(tokenizer=None, limits=LIMITS), None).temperature == 1.0  # built-in


def test_a_request_error_names_only_what_the_client_sent() -> None:
    builder = RequestBuilder(tokenizer=None, limits=LIMITS, sampling_defaults={"temperature": 0.2})
    with pytest.raises(Rejected) as exc:
        _params(builder, {"top_p": 0})
    assert exc.value.param == "top_p"
    with pytest.raises(Rejected) as exc:
        _params(builder, ["not", "a", "dict"])
    assert exc.value.param == "<root>"


def test_openai_mode_ignores_the_file(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"temperature": 0.0})
    openai = SamplingDefaults.load(ServerArgs(model_path=str(folder), sampling_defaults="openai"))
    model = SamplingDefaults.load(ServerArgs(model_path=str(folder)))
    assert openai.values == {} and model.values == {"temperature": 0.0}
    assert openai.info() == {
        "sampling_defaults": "openai",
        "default_sampling_params": {},
        "default_sampling_params_source": None,
        "effective_sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
        },
        "ignored": {},
    }
    assert model.info()["effective_sampling_params"]["temperature"] == 0.0
    assert model.info()["default_sampling_params_source"] == str(folder / "generation_config.json")


def test_the_start_up_log_says_what_is_in_force(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = _folder(tmp_path, {"temperature": 0.2, "top_p": "x"})
    with caplog.at_level(logging.INFO, logger="tokenizer_proc.sampling_defaults"):
        SamplingDefaults.load(ServerArgs(model_path=str(folder))).log()
        SamplingDefaults.load(ServerArgs(model_path=str(folder), sampling_defaults="openai")).log()
    lines = [r.getMessage() for r in caplog.records]
    assert "ignoring the model's sampling default top_p" in lines[0]
    assert "temperature=0.2, top_p=1" in lines[1] and "the model's temperature from" in lines[1]
    assert "temperature=1, top_p=1" in lines[2] and "--sampling-defaults openai" in lines[2]


# ---------------------------------------------------------------------- OpenAI refusals name the client's field


def _chat(**fields: Any) -> oai.ChatCompletionRequest:
    return oai.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_a_chat_refusal_names_max_tokens_when_the_client_sent_it() -> None:
    legacy, current = _chat(max_tokens=10**6), _chat(max_completion_tokens=10**6)
    both = _chat(max_tokens=5, max_completion_tokens=10**6)
    assert oai.openai_param("max_new_tokens", True, legacy) == "max_tokens"
    assert oai.openai_param("max_new_tokens", True, current) == "max_completion_tokens"
    assert oai.openai_param("max_new_tokens", True, both) == "max_completion_tokens"  # the one used
    completion = oai.CompletionRequest(model="m", prompt="a", max_tokens=10**6)
    assert oai.openai_param("max_new_tokens", False, completion) == "max_tokens"


def test_a_refusals_message_uses_the_clients_names() -> None:
    too_long = (
        "prompt (9 tokens) + ",
        FieldRef("max_new_tokens"),
        " (1000000) = 1000009 exceeds the context length 512",
    )
    assert render(too_long, oai.openai_names(True, _chat(max_tokens=10**6))).startswith(
        "prompt (9 tokens) + max_tokens ("
    )
    assert render(too_long).startswith("prompt (9 tokens) + max_new_tokens (")  # the server's own (ZMQ) names
    negative = (FieldRef("max_new_tokens", True), ": must be >= 0, got -1")
    assert render(negative, oai.openai_names(False)) == "max_tokens: must be >= 0, got -1"
    assert render(negative) == "sampling_params.max_new_tokens: must be >= 0, got -1"
    assert render(negative, bare_name) == "max_new_tokens: must be >= 0, got -1"  # SGLang's body
    above = (FieldRef("min_new_tokens", True), ": must be <= ", FieldRef("max_new_tokens"), " (4)")
    assert render(above, oai.openai_names(True)) == "min_tokens: must be <= max_completion_tokens (4)"
    top_p = (FieldRef("top_p", True), ": must be in (0, 1]")
    assert render(top_p, oai.openai_names(True)) == "top_p: must be in (0, 1]"


def test_a_sampling_refusal_keeps_its_fields_as_references() -> None:
    """SamplingParams' checks name the fields they refuse (and mention) as references, so no front door
    has to find them in the text."""
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(max_new_tokens=4, min_new_tokens=9).validate()
    assert str(caught.value) == "sampling_params.min_new_tokens: must be <= max_new_tokens (4), got 9"
    assert (
        caught.value.parts[0] == FieldRef("min_new_tokens", True) and FieldRef("max_new_tokens") in caught.value.parts
    )
    assert render(caught.value.parts, oai.openai_names(False)) == "min_tokens: must be <= max_tokens (4), got 9"
