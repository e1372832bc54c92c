"""SGLang's native /generate as SGLang answers it, end to end on the session's tiny Llama server:
SGLang's whole request body (per-prompt lists, a batch's rid prefix, None sampling parameters,
SGLang's own parameter names, stop_regex, unknown fields ignored, unserved ones refused by name) and
its reply (meta_info keys, ``[logprob, id, text|null]`` entries with integer ids, cumulative stream
events), with logprob values against transformers in fp32. The frontend language that relies on
all of this is tests/e2e/test_sglang_frontend_e2e.py."""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch

pytest.register_assert_rewrite("server_fixtures")

from runtime.client import Client  # noqa: E402
from tests.support.checkpoints import random_prompt  # noqa: E402
from tests.support.server_fixtures import http_json, is_idle, wait_until  # noqa: E402

pytest_plugins = ["tests.support.server_fixtures"]

GREEDY = {"temperature": 0, "ignore_eos": True}
# SGLang's meta_info keys of a finished sample (SGLang's TokenizerManager writes them)
SGLANG_META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}


def logprobs_of(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of ``ids`` (row i predicts token i + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_in_sglang_shape_equal_transformers(llama_server: Client, hf_reference: Callable[[str], Any]) -> None:
    """Every logprob list SGLang returns, as triples with the token's text, ids as ints, values as
    transformers computes them: prompt from position 0 (its first entry has a null logprob and a null
    top list), output, the top-2 lists and the logprobs of named ids at every position."""
    model, tokenizer = hf_reference("llama")
    prompt = random_prompt(12, model.config.vocab_size, seed=707)
    named = [3, 11, 42]
    status, r = http_json(
        llama_server,
        "POST",
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {**GREEDY, "max_new_tokens": 5},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "token_ids_logprob": named,
            "return_text_in_logprobs": True,
        },
    )
    assert status == 200, r
    meta = r["meta_info"]
    assert SGLANG_META_KEYS <= set(meta) and meta["id"] and meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 5
    whole = prompt + r["output_ids"]
    want = logprobs_of(model, whole)
    rows = {  # the row that predicts each listed token, per list
        "input": list(range(-1, len(prompt) - 1)),
        "output": list(range(len(prompt) - 1, len(whole) - 1)),
    }
    for side, tokens in (("input", prompt), ("output", r["output_ids"])):
        entries = meta[f"{side}_token_logprobs"]
        assert [e[1] for e in entries] == tokens and all(type(e[1]) is int for e in entries)
        assert [e[2] for e in entries] == [tokenizer.decode([t]) for t in tokens]
        for entry, row, top, by_id in zip(
            entries, rows[side], meta[f"{side}_top_logprobs"], meta[f"{side}_token_ids_logprobs"]
        ):
            if row < 0:  # the first prompt token: nothing predicts it
                assert entry[0] is None and top is None and by_id is None
                continue
            assert entry[0] == pytest.approx(float(want[row, entry[1]]), abs=1e-4)
            values, ids = want[row].topk(2)
            assert [e[1] for e in top] == ids.tolist() and all(type(e[1]) is int for e in top)
            assert [e[0] for e in top] == pytest.approx(values.tolist(), abs=1e-4)
            assert [e[1] for e in by_id] == named and [e[2] for e in by_id] == [tokenizer.decode([t]) for t in named]
            assert [e[0] for e in by_id] == pytest.approx([float(want[row, t]) for t in named], abs=1e-4)
    # the ZMQ client asks the same (its meta keeps the server's [logprob, id] pairs)
    zmq = llama_server.generate(
        input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 5}, token_ids_logprob=named
    )
    pairs = zmq["meta"]["output_token_ids_logprobs"]
    assert [[t for _, t in row] for row in pairs] == [named] * 5
    assert [lp for row in pairs for lp, _ in row] == pytest.approx(
        [e[0] for row in meta["output_token_ids_logprobs"] for e in row], abs=1e-5
    )
    # without return_text_in_logprobs the text is null, as in SGLang
    status, plain = http_json(
        llama_server,
        "POST",
        "/generate",
        {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 2}, "return_logprob": True},
    )
    assert status == 200 and plain["meta_info"]["input_token_logprobs"] == []
    assert [e[2] for e in plain["meta_info"]["output_token_logprobs"]] == [None, None]


def test_a_batch_takes_per_prompt_fields_and_a_rid_prefix(llama_server: Client) -> None:
    """SGLang's batch: a list of sampling_params and of return_logprob (one per prompt), a string rid
    expanded to rid_0, rid_1; None parameters are their defaults; the second prompt asked no logprobs."""
    prompts = [[5, 6, 7], [8, 9]]
    body = {
        "input_ids": prompts,
        "sampling_params": [
            {**GREEDY, "max_new_tokens": 3, "json_schema": None, "stop": []},
            {**GREEDY, "max_new_tokens": 2, "top_k": None, "stop_regex": []},
        ],
        "return_logprob": [True, False],
        "rid": "family",
        "model": "added-by-a-gateway",
    }
    status, r = http_json(llama_server, "POST", "/generate", body)
    assert status == 200, r
    assert [x["meta_info"]["id"] for x in r] == ["family_0", "family_1"]
    assert [x["output_ids"] for x in r] == [
        llama_server.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": n})["output_ids"]
        for p, n in zip(prompts, (3, 2))
    ]
    assert len(r[0]["meta_info"]["output_token_logprobs"]) == 3 and "output_token_logprobs" not in r[1]["meta_info"]
    status, err = http_json(llama_server, "POST", "/generate", {**body, "return_logprob": [True]})
    assert status == 400 and err["error"]["param"] == "return_logprob"


def test_a_stream_sends_everything_so_far_in_each_event(llama_server: Client) -> None:
    """SGLang's default streaming: each event's text, output ids and logprobs are cumulative, and its
    finish_reason is null until the last."""
    body = {"text": "hello there", "sampling_params": {**GREEDY, "max_new_tokens": 6}, "return_logprob": True}
    status, events = http_json(llama_server, "POST", "/generate", {**body, "stream": True})
    status_whole, whole = http_json(llama_server, "POST", "/generate", body)
    assert status == status_whole == 200
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    for before, after in zip(events, events[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    for event in events:
        meta = event["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(event["output_ids"])
        assert (meta["finish_reason"] is None) == (event is not events[-1])
    streamed, whole_entries = (r["meta_info"]["output_token_logprobs"] for r in (events[-1], whole))
    assert [e[1] for e in streamed] == [e[1] for e in whole_entries]
    assert [e[0] for e in streamed] == pytest.approx([e[0] for e in whole_entries], abs=1e-5)


def test_sglang_sampling_parameters(llama_server: Client) -> None:
    """stop_regex ends the output at its first match (the matched text left out, as a stop string is);
    sampling_seed is SGLang's name for seed; a bad pattern, or one matching the empty text, is a 400
    naming stop_regex; what would change the answer and is not served is refused by name."""
    prompt = [17, 23, 5, 88]
    full = llama_server.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 24})["text"]
    at = next(i for i in range(3, len(full) - 1) if full.find(full[i : i + 2]) == i)  # first occurrence at i
    pattern = re.escape(full[at]) + "[" + re.escape(full[at + 1]) + "]"
    status, r = http_json(
        llama_server,
        "POST",
        "/generate",
        {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 24, "stop_regex": pattern}},
    )
    assert status == 200, r
    assert r["text"] == full[:at] and r["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[at : at + 2]}
    seeded = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}
    by_sglang_name = http_json(
        llama_server, "POST", "/generate", {"input_ids": prompt, "sampling_params": {**seeded, "sampling_seed": 11}}
    )[1]
    by_our_name = http_json(
        llama_server, "POST", "/generate", {"input_ids": prompt, "sampling_params": {**seeded, "seed": 11}}
    )[1]
    assert by_sglang_name["output_ids"] == by_our_name["output_ids"]
    for params, param in (
        ({"stop_regex": "(unclosed"}, "stop_regex"),
        ({"stop_regex": ["ok", "a*"]}, "stop_regex"),
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"no_such_param": 1}, "no_such_param"),
    ):
        status, err = http_json(llama_server, "POST", "/generate", {"input_ids": prompt, "sampling_params": params})
        assert status == 400 and err["error"]["param"] == param, (params, err)
    status, err = http_json(
        llama_server, "POST", "/generate", {"text": "a picture", "image_data": "http://example.com/cat.png"}
    )
    assert status == 400 and err["error"]["param"] == "image_data" and "image" in err["error"]["message"]
    wait_until(lambda: is_idle(llama_server), 30, "an idle server")
