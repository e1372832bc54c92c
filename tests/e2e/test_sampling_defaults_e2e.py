"""Sampling defaults from the model, end to end through launch.py (issue 47): a tiny Llama whose
generation_config.json sets temperature 0.0 (greedy).

* with --sampling-defaults model (the default), a request without temperature is greedy on every
  front door (ZMQ, /generate, /v1/completions, /v1/chat/completions), and a request that sets a
  temperature is sampled;
* with --sampling-defaults openai the file is ignored: no temperature samples at 1.0;
* /get_model_info (and the ZMQ server info) show the defaults in force, the start-up log names them;
* an OpenAI request with a bad max_tokens gets a 400 naming max_tokens.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from tests.support.server_fixtures import API_KEY, CLIENT_TIMEOUT_S, base_args
from tests.support.server_process import ServedClient, launch_server

MODEL = "tiny-greedy"
PROMPT = "The quick brown fox"
MESSAGES: Any = [{"role": "user", "content": "Hello! How are you today?"}]
TOKENS = 12
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def greedy_checkpoint(tiny_checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a generation_config.json that asks for greedy decoding."""
    folder = tmp_path_factory.mktemp("greedy") / "llama"
    shutil.copytree(tiny_checkpoints.path("llama"), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "do_sample": True}))
    return folder


def _launch(folder: Path, *extra: str) -> Iterator[ServedClient]:
    args = base_args(folder, "--api-key", API_KEY, "--served-model-name", MODEL, *extra)
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def server(greedy_checkpoint: Path) -> Iterator[ServedClient]:
    yield from _launch(greedy_checkpoint)


@pytest.fixture(scope="module")
def openai_server(greedy_checkpoint: Path) -> Iterator[ServedClient]:
    yield from _launch(greedy_checkpoint, "--sampling-defaults", "openai")


def base_url(server: ServedClient) -> str:
    assert server.server.http_address is not None
    return server.server.http_address


def http(server: ServedClient, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url(server) + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def oai(server: ServedClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(server) + "/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)


# Each front door: the output ids (or text) of one request with these sampling fields added.


def zmq_door(server: ServedClient, fields: dict[str, Any]) -> Any:
    return server.generate(PROMPT, {"max_new_tokens": TOKENS, "ignore_eos": True, **fields})["output_ids"]


def native_door(server: ServedClient, fields: dict[str, Any]) -> Any:
    params = {"max_new_tokens": TOKENS, "ignore_eos": True, **fields}
    status, body = http(server, "POST", "/generate", {"text": PROMPT, "sampling_params": params})
    assert status == 200, body
    return body["output_ids"]


def completions_door(server: ServedClient, fields: dict[str, Any]) -> Any:
    r = oai(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=TOKENS, extra_body={"ignore_eos": True}, **fields
    )
    return r.choices[0].text


def chat_door(server: ServedClient, fields: dict[str, Any]) -> Any:
    r = oai(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=TOKENS, extra_body={"ignore_eos": True}, **fields
    )
    return r.choices[0].message.content


DOORS = {"zmq": zmq_door, "generate": native_door, "completions": completions_door, "chat": chat_door}


@pytest.mark.parametrize("door", DOORS)
def test_no_temperature_is_the_models_greedy_on_every_front_door(server: ServedClient, door: str) -> None:
    run = DOORS[door]
    greedy = run(server, {"temperature": 0})
    assert run(server, {}) == greedy
    assert run(server, {"seed": 7}) == greedy  # a seed alone does not make it sampled
    sampled = [run(server, {"temperature": 1.0, "seed": s}) for s in SEEDS]
    assert any(s != greedy for s in sampled), "a request that sets a temperature must be sampled"


def test_openai_defaults_ignore_the_file(openai_server: ServedClient) -> None:
    for run in (zmq_door, native_door):
        greedy = run(openai_server, {"temperature": 0})
        unset = [run(openai_server, {"seed": s}) for s in SEEDS]
        assert unset == [run(openai_server, {"temperature": 1.0, "seed": s}) for s in SEEDS]  # built-in 1.0
        assert any(u != greedy for u in unset)
    status, info = http(openai_server, "GET", "/get_model_info")
    assert status == 200 and info["sampling_defaults"] == "openai" and info["default_sampling_params"] == {}
    assert info["effective_sampling_params"]["temperature"] == 1.0
    assert "--sampling-defaults openai" in openai_server.server.log_tail(1 << 20)


def test_model_info_and_the_log_show_the_defaults(server: ServedClient, greedy_checkpoint: Path) -> None:
    status, info = http(server, "GET", "/get_model_info")
    assert status == 200, info
    assert info["sampling_defaults"] == "model" and info["default_sampling_params"] == {"temperature": 0.0}
    assert info["default_sampling_params_source"] == str(greedy_checkpoint / "generation_config.json")
    assert info["effective_sampling_params"] == {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    assert info["served_model_name"] == MODEL and info["is_generation"] is True
    assert server.server_info()["model"]["default_sampling_params"] == {"temperature": 0.0}  # the ZMQ view
    log = server.server.log_tail(1 << 20)
    assert "sampling defaults for fields a request leaves unset: temperature=0," in log
    assert "the model's temperature from" in log


@pytest.mark.parametrize("door", ["chat", "completions"])
def test_a_bad_max_tokens_is_refused_by_its_name(server: ServedClient, door: str) -> None:
    client = oai(server)
    with pytest.raises(openai.BadRequestError) as exc:
        if door == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10**6)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    body = exc.value.body
    assert exc.value.status_code == 400 and exc.value.param == "max_tokens", body
    message = body["message"] if isinstance(body, dict) else str(body)
    assert "max_tokens" in message and "max_new_tokens" not in message and "max_completion_tokens" not in message
