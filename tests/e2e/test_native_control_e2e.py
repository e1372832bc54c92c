"""SGLang's operational routes end to end, over raw HTTP as SGLang's clients send them, against one
server on the tiny Llama (CPU, fp32, --api-key):

* /server_info answers as /get_server_info does (SGLang's frontend calls the former);
* /abort_request ends a long stream by its rid (the stream's last event says abort), whichever
  connection sent it; abort_all ends an HTTP stream and a ZMQ stream alike; an unknown rid is a 200
  that aborted nothing;
* /start_profile (a GET with no body, as SGLang's frontend sends, or a POST with SGLang's body) and
  /stop_profile write a Chrome trace that parses as JSON; num_steps stops by itself; a stop without
  a start and a second start are 400s with their codes;
* /update_weights_from_disk swaps in a second checkpoint of the same model: /generate then equals
  transformers on the new weights, /get_model_info and /server_info report the weight_version; a
  checkpoint of another architecture is a 400 and the weights served stay; an update sent while a
  request streams waits for it (the stream is the old weights' tokens all through).

After each test the server is idle with no KV slot leaked.
"""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from runtime.client import Client
from tests.support.checkpoints import hf_greedy, load_hf_model, random_prompt
from tests.support.server_fixtures import (
    API_KEY,
    CLIENT_TIMEOUT_S,
    assert_idle_and_nothing_leaked,
    base_args,
    http_json,
    is_idle,
    wait_until,
)
from tests.support.server_process import launch_server

pytest_plugins = ["tests.support.server_fixtures"]

LONG = 480  # tokens of a stream that is still running when the test acts on it (context: 512)
DURING = 240  # the stream an update waits for (compared with transformers token by token)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(tiny_llama_path: Path, profiles: Path) -> Iterator[Client]:
    # SGLang's variable: where traces go when /start_profile names no output_dir
    env = {"SGLANG_TORCH_PROFILER_DIR": str(profiles / "default")}
    with launch_server(
        base_args(tiny_llama_path, "--api-key", API_KEY), extra_env=env, client_timeout=CLIENT_TIMEOUT_S
    ) as client:
        yield client


@pytest.fixture(autouse=True)
def idle_after(server: Client) -> Iterator[None]:
    yield
    assert_idle_and_nothing_leaked(server)


class Stream:
    """A native /generate stream read event by event, as the server sends them."""

    def __init__(self, server: Client, body: dict[str, Any]) -> None:
        host, port = server.server.http_address.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=CLIENT_TIMEOUT_S)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
        self.conn.request("POST", "/generate", json.dumps({**body, "stream": True}), headers)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.ids: list[int] = []
        self.last: dict[str, Any] = {}

    def next(self) -> dict[str, Any] | None:
        """The next event (None at [DONE])."""
        while True:
            line = self.resp.readline()
            assert line, "the stream ended without [DONE]"
            if line.startswith(b"data: "):
                break
        if line.strip() == b"data: [DONE]":
            return None
        event: dict[str, Any] = json.loads(line[len(b"data: ") :])
        self.ids = event["output_ids"]  # (SGLang's stream: the ids so far)
        self.last = event
        return event

    def rest(self) -> "Stream":
        while self.next() is not None:
            pass
        self.conn.close()
        return self


def long_body(rid: str, prompt: list[int], max_new_tokens: int = LONG) -> dict[str, Any]:
    return {"rid": rid, "input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}}


def greedy(server: Client, prompt: list[int], n: int) -> list[int]:
    status, reply = http_json(
        server, "POST", "/generate", {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": n}}
    )
    assert status == 200, reply
    ids: list[int] = reply["output_ids"]
    return ids


def test_server_info_is_also_served_as_sglang_names_it(server: Client) -> None:
    status, info = http_json(server, "GET", "/server_info")
    assert (
        status == 200
        and info["max_total_tokens"] == http_json(server, "GET", "/get_server_info")[1]["max_total_tokens"]
    )
    assert info["weight_version"] == "default" and info["memory_invariant"]["ok"]
    assert http_json(server, "GET", "/server_info", key=None)[0] == 401
    # SGLang's layout, which its Model Gateway parses: the flags and the model's entries at the top
    # level as plain values (an object under "model" made the gateway drop the whole reply)
    assert (info["tp_size"], info["dp_size"], info["max_total_num_tokens"]) == (1, 1, info["max_total_tokens"])
    assert isinstance(info["model_path"], str) and info["served_model_name"] and "model" not in info


# ---------------------------------------------------------------------- aborts


def test_abort_request_ends_a_long_stream_by_its_rid(server: Client) -> None:
    stream = Stream(server, long_body("long-one", random_prompt(12, 300, seed=1)))
    assert stream.next() is not None  # running
    # SGLang's load report (the gateway's power_of_two reads num_tokens): the stream holds KV
    status, load = http_json(server, "GET", "/get_load")
    assert status == 200 and [(r["dp_rank"], r["num_reqs"], r["num_waiting_reqs"]) for r in load] == [(0, 1, 0)]
    assert load[0]["num_tokens"] >= 12
    status, reply = http_json(server, "POST", "/abort_request", {"rid": "long-one", "abort_all": False, "extra": 1})
    assert (status, reply["aborted"]) == (200, 1), reply
    stream.rest()
    assert stream.last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(stream.ids) < LONG
    assert http_json(server, "POST", "/abort_request", {"rid": "no-such-request"})[1]["aborted"] == 0
    wait_until(lambda: is_idle(server), 30, "the aborted stream's KV to be freed")
    assert http_json(server, "GET", "/get_load")[1][0]["num_tokens"] == 0


def test_abort_all_ends_http_and_zmq_requests(server: Client) -> None:
    stream = Stream(server, long_body("http-one", random_prompt(12, 300, seed=2)))
    assert stream.next() is not None
    zmq = server.generate(
        input_ids=random_prompt(12, 300, seed=3), sampling_params={**GREEDY, "max_new_tokens": LONG}, stream=True
    )
    first = next(zmq)
    status, reply = http_json(server, "POST", "/abort_request", {"abort_all": True})
    assert status == 200 and reply["aborted"] == 2, reply
    chunks = [first, *zmq]
    assert chunks[-1]["finish_reason"]["type"] == "abort"
    assert stream.rest().last["meta_info"]["finish_reason"]["type"] == "abort"


# ---------------------------------------------------------------------- profiling


def trace_events(path: str | Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads(Path(path).read_text())["traceEvents"]
    return events


def test_profile_start_and_stop_write_a_chrome_trace(server: Client, profiles: Path) -> None:
    # SGLang's frontend: a GET with no body (the output folder from SGLANG_TORCH_PROFILER_DIR)
    status, started = http_json(server, "GET", "/start_profile")
    assert status == 200 and started["success"] and started["output_dir"] == str(profiles / "default"), started
    status, again = http_json(server, "POST", "/start_profile", {"output_dir": str(profiles)})
    assert (status, again["error"]["code"]) == (400, "profile_already_started"), again
    greedy(server, random_prompt(8, 300, seed=4), 4)
    status, stopped = http_json(server, "GET", "/stop_profile")
    assert status == 200 and stopped["num_steps"] == 4, stopped
    (trace,) = stopped["trace_files"]
    assert Path(trace).parent == profiles / "default"
    assert any(e.get("name", "").startswith("aten::") for e in trace_events(trace))
    status, refused = http_json(server, "POST", "/stop_profile")
    assert (status, refused["error"]["code"]) == (400, "profile_not_started"), refused


def test_profile_of_num_steps_stops_by_itself(server: Client, profiles: Path) -> None:
    body = {"output_dir": str(profiles), "num_steps": 2, "activities": ["CPU"], "with_stack": False, "profile_id": "n2"}
    status, started = http_json(server, "POST", "/start_profile", body)
    assert status == 200, started
    greedy(server, random_prompt(8, 300, seed=5), 6)
    trace = profiles / "n2-TP-0.trace.json"
    wait_until(trace.is_file, 30, "the trace of a profile of 2 steps")
    trace_events(trace)  # parses
    status, refused = http_json(server, "POST", "/stop_profile")
    assert status == 400 and "stopped by itself after 2 forward steps" in refused["error"]["message"]


# ---------------------------------------------------------------------- weight updates


def test_update_weights_from_disk(
    server: Client, tiny_llama_path: Path, tiny_llama_other_weights: Path, tiny_checkpoints: Any
) -> None:
    prompt = random_prompt(12, 300, seed=6)
    want_a = hf_greedy(load_hf_model(tiny_llama_path), prompt, 8)[0]
    want_b = hf_greedy(load_hf_model(tiny_llama_other_weights), prompt, 8)[0]
    assert want_a != want_b and greedy(server, prompt, 8) == want_a

    body = {
        "model_path": str(tiny_llama_other_weights),
        "load_format": None,
        "abort_all_requests": False,
        "weight_version": "rl-1",
    }
    status, reply = http_json(server, "POST", "/update_weights_from_disk", body)
    assert status == 200 and reply == {"success": True, "message": reply["message"], "num_paused_requests": 0}
    assert greedy(server, prompt, 8) == want_b
    model = http_json(server, "GET", "/get_model_info")[1]
    assert (model["model_path"], model["weight_version"]) == (str(tiny_llama_other_weights), "rl-1")
    assert http_json(server, "GET", "/server_info")[1]["weight_version"] == "rl-1"

    other = tiny_checkpoints.path("qwen3")  # another architecture: refused, B serves on
    status, reply = http_json(server, "POST", "/update_weights_from_disk", {"model_path": str(other)})
    assert status == 400 and not reply["success"] and "Qwen3ForCausalLM" in reply["message"], reply
    assert greedy(server, prompt, 8) == want_b

    # An update sent while a request streams on A waits for it: the stream is A's all through.
    assert http_json(server, "POST", "/update_weights_from_disk", {"model_path": str(tiny_llama_path)})[0] == 200
    stream = Stream(server, long_body("during", prompt, DURING))
    assert stream.next() is not None
    replied: dict[str, Any] = {}

    def update_to_b() -> None:
        replied["status"], replied["reply"] = http_json(
            server, "POST", "/update_weights_from_disk", {"model_path": str(tiny_llama_other_weights)}
        )

    updater = threading.Thread(target=update_to_b)
    updater.start()
    stream.rest()
    updater.join(CLIENT_TIMEOUT_S)
    log = server.server.log_tail(20_000)
    assert replied["status"] == 200 and replied["reply"]["success"], replied
    assert stream.ids == hf_greedy(load_hf_model(tiny_llama_path), prompt, DURING)[0]
    # the scheduler had the stream running when the update came: it waited for it
    assert f"weight update from {tiny_llama_other_weights}: admission paused until 1 running request(s) finish" in log
    assert greedy(server, prompt, 8) == want_b
    assert (
        http_json(server, "POST", "/update_weights_from_disk", {"model_path": str(tiny_llama_path)})[0] == 200
    )  # (as found)


def test_the_python_client_profiles_and_updates_weights(server: Client, profiles: Path) -> None:
    """The same calls through the ZMQ client: a profile of one step, a reload (of the weights now
    served, under a new version name) and a refused one, answered as SGLang's routes answer."""
    started = server.start_profile(str(profiles / "zmq"), num_steps=1, profile_id="zmq")
    assert started["success"] and started["output_dir"] == str(profiles / "zmq")
    greedy(server, random_prompt(8, 300, seed=8), 3)
    trace = profiles / "zmq" / "zmq-TP-0.trace.json"
    wait_until(trace.is_file, 30, "the trace of a profile of 1 step")
    trace_events(trace)  # parses
    served = http_json(server, "GET", "/get_model_info")[1]["model_path"]
    reply = server.update_weights_from_disk(served, weight_version="via-zmq")
    assert reply["success"] and reply["num_paused_requests"] == 0, reply
    assert server.server_info()["weight_version"] == "via-zmq"
    refused = server.update_weights_from_disk(str(profiles))  # a folder with no checkpoint
    assert not refused["success"] and str(profiles) in refused["message"], refused
    assert server.server_info()["weight_version"] == "via-zmq"
