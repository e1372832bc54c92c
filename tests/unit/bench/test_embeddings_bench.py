"""bench/embeddings.py's and bench/embedding_runner.py's pieces without a model, a server or sentence-transformers: the sentence plan
(fresh sentences for every batch), the /v1/embeddings client against a stand-in server, the cosine
check, the summary's medians, ratios and headline, and the flags."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import combinations
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from bench import embedding_runner as runner
from bench import embeddings
from bench.common import format_table

# ---------------------------------------------------------------------- sentences


def test_every_batch_of_the_plan_is_fresh_and_the_plan_is_reproducible() -> None:
    plan = runner.sentence_plan(batch_size=24, repeats=3, lanes=2, seed=5)
    assert sorted(plan) == [(lane, rep) for lane in range(2) for rep in (runner.WARMUP, 0, 1, 2)]
    for batch in plan.values():
        assert len(batch) == 24 == len(set(batch)) and all(s.strip() for s in batch)
    for (key_a, a), (key_b, b) in combinations(plan.items(), 2):
        assert not set(a) & set(b), f"{key_a} and {key_b} share sentences: a server could answer from a cache"
    assert runner.sentence_plan(24, 3, 2, seed=5) == plan
    other = runner.sentence_plan(24, 3, 2, seed=6)
    assert other[(0, 0)] != plan[(0, 0)]


def test_draw_sentences_is_seeded_and_steps_around_what_to_avoid() -> None:
    first = runner.draw_sentences(40, seed=1)
    assert runner.draw_sentences(40, seed=1) == first
    assert set(runner.draw_sentences(40, seed=2)) != set(first)
    # Avoiding the whole first draw forces a longer draw of the same stream: all fresh.
    after = runner.draw_sentences(40, seed=1, avoid=set(first))
    assert len(after) == 40 == len(set(after)) and not set(after) & set(first)


# ---------------------------------------------------------------------- the client


def test_chunks_and_answers_in_input_order() -> None:
    items = [str(i) for i in range(10)]
    assert [len(c) for c in runner.chunks(items, 4)] == [4, 4, 2]
    assert runner.chunks(items, None) == [items]
    with pytest.raises(ValueError):
        runner.chunks(items, 0)
    payload = {
        "data": [{"index": 1, "embedding": [0.0, 1.0]}, {"index": 0, "embedding": [1.0, 0.0]}],
        "usage": {"prompt_tokens": 7},
    }
    assert runner.parse_embeddings(payload, 2) == ([[1.0, 0.0], [0.0, 1.0]], 7)
    with pytest.raises(runner.EmbeddingsError):
        runner.parse_embeddings(payload, 3)  # a vector missing
    doubled = {"data": payload["data"] + [{"index": 1, "embedding": [0.0, 1.0]}]}
    with pytest.raises(runner.EmbeddingsError):
        runner.parse_embeddings(doubled, 2)
    with pytest.raises(runner.EmbeddingsError):
        runner.parse_embeddings({"error": {"message": "no"}}, 2)


def vector_of(text: str) -> list[float]:
    """The stand-in server's embedding: a function of the text alone, so order mix-ups show."""
    return [float(len(text)), float(sum(map(ord, text)) % 97), 1.0]


class StandIn(BaseHTTPRequestHandler):
    """/v1/embeddings as OpenAI shapes it, answered in reverse index order; 404 for a model named 'nope'."""

    protocol_version = "HTTP/1.1"
    bodies: list[dict[str, Any]] = []

    def do_GET(self) -> None:
        ok = self.path == "/v1/models"
        self.reply(200 if ok else 404, {"object": "list", "data": [{"id": "minilm", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.bodies.append({"path": self.path, **body})
        if body["model"] == "nope":
            self.reply(404, {"error": {"message": "model 'nope' not found"}})
            return
        data = [{"index": i, "embedding": vector_of(t), "object": "embedding"} for i, t in enumerate(body["input"])]
        self.reply(200, {"data": data[::-1], "usage": {"prompt_tokens": 3 * len(data)}})

    def reply(self, status: int, payload: dict[str, Any]) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[str]:
    StandIn.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_client_sends_one_call_or_concurrent_chunks_and_keeps_the_order(stand_in: str) -> None:
    sentences = runner.draw_sentences(10, seed=3)
    client = runner.EmbeddingsClient(stand_in, "all-minilm-l6-v2")
    assert client.served_model() == "minilm"
    client.model = "minilm"
    whole = client.embed(sentences, None)
    assert [b["input"] for b in StandIn.bodies] == [sentences]
    assert StandIn.bodies[0] == {
        "path": "/v1/embeddings",
        "model": "minilm",
        "input": sentences,
        "encoding_format": "float",
    }
    np.testing.assert_array_equal(whole.vectors, np.asarray([vector_of(s) for s in sentences], dtype=np.float32))
    assert whole.prompt_tokens == 30 and whole.seconds > 0

    StandIn.bodies = []
    chunked = client.embed(sentences, 4)
    assert sorted(len(b["input"]) for b in StandIn.bodies) == [2, 4, 4]
    assert sorted(s for b in StandIn.bodies for s in b["input"]) == sorted(sentences)
    np.testing.assert_array_equal(chunked.vectors, whole.vectors)  # reassembled in the batch's order
    assert chunked.prompt_tokens == 30

    record = runner.run_record("tinyserve", "1 call", 0, 2, whole)
    assert record["embeddings"] == 10 and record["dim"] == 3
    assert record["embeddings_per_s"] == pytest.approx(10 / whole.seconds)
    with pytest.raises(runner.EmbeddingsError, match="404"):
        runner.EmbeddingsClient(stand_in, "nope").embed(sentences, None)


def test_run_server_warms_every_way_then_measures_fresh_batches(stand_in: str) -> None:
    plan = runner.sentence_plan(batch_size=6, repeats=2, lanes=2, seed=0)
    ways = runner.server_ways(4)
    runs, first = runner.run_server("x", runner.EmbeddingsClient(stand_in, "m"), plan, ways, repeats=2)
    assert [(r["way"], r["repeat"]) for r in runs] == [
        ("1 call", 0),
        ("concurrent calls of 4", 0),
        ("1 call", 1),
        ("concurrent calls of 4", 1),
    ]
    sent = [tuple(b["input"]) for b in StandIn.bodies]
    warm = {tuple(plan[(0, -1)]), tuple(plan[(1, -1)][:4]), tuple(plan[(1, -1)][4:])}
    assert set(sent[:3]) == warm  # every way's warm-up first (the concurrent calls in any order)
    measured = {s for batch in sent[3:] for s in batch}
    assert measured == {s for key, batch in plan.items() if key[1] >= 0 for s in batch}
    assert sorted(first) == [0, 1]
    np.testing.assert_array_equal(first[1], np.asarray([vector_of(s) for s in plan[(1, 0)]], dtype=np.float32))


# ---------------------------------------------------------------------- checking and summarising


def test_min_cosine_matches_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 5, generator=gen)
    b = a + 0.3 * torch.randn(8, 5, generator=gen)
    b[3] *= 7.0  # scale does not change a cosine
    oracle = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1).min().item()
    assert runner.min_cosine(a.numpy(), b.numpy()) == pytest.approx(oracle, abs=1e-12)
    assert runner.min_cosine(a.numpy(), a.numpy()) == pytest.approx(1.0)
    assert math.isnan(runner.min_cosine(a.numpy(), b.numpy()[:4]))  # a vector missing: no figure


def fake_run(engine: str, way: str, repeat: int, seconds: float, tokens: int | None = None) -> dict[str, Any]:
    return {
        "engine": engine,
        "way": way,
        "lane": 0,
        "repeat": repeat,
        "embeddings": 256,
        "seconds": seconds,
        "embeddings_per_s": 256 / seconds,
        "prompt_tokens": tokens,
    }


def test_summary_medians_ratios_and_headline() -> None:
    runs = [
        *(fake_run("tinyserve", "1 call", i, s, 3200) for i, s in enumerate((0.5, 0.25, 0.4))),
        *(fake_run("tinyserve", "concurrent calls of 32", i, s, 3200) for i, s in enumerate((0.2, 0.3, 0.25))),
        *(fake_run("sentence-transformers", "encode, batch_size 32", i, s) for i, s in enumerate((1.0, 1.2, 0.8))),
        *(fake_run("sentence-transformers", "encode, batch_size 256", i, s) for i, s in enumerate((2.0, 2.0, 2.0))),
    ]
    cosines = {("tinyserve", "1 call"): 0.99999, ("tinyserve", "concurrent calls of 32"): 0.99998}
    rows = embeddings.summarize(runs, cosines)
    by_way = {r["way"]: r for r in rows}
    one, conc, st32 = by_way["1 call"], by_way["concurrent calls of 32"], by_way["encode, batch_size 32"]
    assert one["repeats"] == 3 and one["seconds"] == 0.4 and one["embeddings_per_s"] == 256 / 0.4
    assert one["each"] == "512, 1024, 640" and one["tokens_per_s"] == 3200 / 0.4
    assert st32["embeddings_per_s"] == 256.0 and math.isnan(st32["tokens_per_s"])
    # Ratios over sentence-transformers' BEST way (batch_size 32 here), never its slower one.
    assert one["vs_st"] == pytest.approx(2.5) and conc["vs_st"] == pytest.approx(4.0)
    assert math.isnan(st32["vs_st"]) and math.isnan(one["vs_llamacpp"])  # llama.cpp did not run
    assert one["min_cosine"] == 0.99999 and math.isnan(st32["min_cosine"])
    top = embeddings.headline(rows)
    assert top["way"] == "concurrent calls of 32" and top["vs_st"] == pytest.approx(4.0)
    assert top["st_embeddings_per_s"] == 256.0 and math.isnan(top["llamacpp_embeddings_per_s"])

    with_llama = rows + embeddings.summarize(
        [fake_run("llama.cpp", "1 call", 0, 0.5), fake_run("llama.cpp", "concurrent calls of 32", 0, 1.0)], {}
    )
    assert embeddings.best_rate(with_llama, "llama.cpp") == 512.0
    table = format_table([*rows, embeddings.not_run_row("llama.cpp", "give --llamacpp-server")], embeddings.COLUMNS)
    assert table.splitlines()[-1].split()[:3] == ["llama.cpp", "not", "run"]
    assert embeddings.headline([r for r in rows if r["engine"] != "tinyserve"]) == {}
    printed = {r["way"]: r["min_cosine"] for r in embeddings.table_rows(rows)}
    assert printed["1 call"] == "0.999990" and math.isnan(printed["encode, batch_size 32"])


def test_openmp_wait_is_the_servers_unless_the_user_set_one() -> None:
    from runtime.engine.cpu.process_env import CPU_OPENMP_ENV

    env: dict[str, str] = {"PATH": "/bin"}
    assert embeddings.openmp_env(env) == dict(CPU_OPENMP_ENV) and env["PATH"] == "/bin"
    own = {"GOMP_SPINCOUNT": "0"}
    assert embeddings.openmp_env(own) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "0"}
    assert own == {"GOMP_SPINCOUNT": "0"}  # one setting: the user's value keeps both of ours out


# ---------------------------------------------------------------------- flags


def test_flags_defaults_checks_and_llamacpp_command(tmp_path: Path) -> None:
    args, rest = embeddings.parse_args(["--max-running-requests", "256"])
    assert (args.repeats, args.batch_size, args.chunk, args.st_batch_size) == (5, 256, 32, [32, 256])
    assert args.model_path == "all-minilm-l6-v2" and args.dtype == "auto" and args.min_cosine == 0.999
    assert rest == ["--max-running-requests", "256"]  # for launch.py
    assert embeddings.parse_args(["--dtype", "float32"])[0].min_cosine == 0.9999  # fp32 against fp32
    for bad in (["--repeats", "0"], ["--chunk", "0"], ["--gguf", "m.gguf"], ["--address", "tcp://x:1"]):
        with pytest.raises(SystemExit):
            embeddings.parse_args(bad)
    args, _ = embeddings.parse_args(
        ["--llamacpp-server", "/bin/llama-server", "--gguf", str(tmp_path / "m.gguf"), "--llamacpp-arg=-ub=1024"]
    )
    argv = embeddings.llamacpp_config(args, threads=2).argv(8080)
    assert argv[argv.index("--pooling") + 1] == "mean" and "--embedding" in argv and argv[-1] == "-ub=1024"
    assert argv[argv.index("-np") + 1] == "64" and argv[argv.index("-c") + 1] == str(64 * 512)
    assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == "2"
