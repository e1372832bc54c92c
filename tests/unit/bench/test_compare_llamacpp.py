"""bench.compare --baseline llamacpp without llama.cpp: its flags, the side-by-side table, and
one run against a stand-in llama-server (a small HTTP server speaking /health and
/v1/completions) that records how it was started and what it was sent."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import pytest

from bench import compare, serving
from bench.common import cpu_description, read_json
from bench.llamacpp_baseline import ENGINE, LlamaServerConfig
from bench.workloads import single
from runtime.checkpoints.model_source import checkpoint_folder
from tests.support.gguf_files import write_checkpoint_gguf

FAKE_SERVER = '''#!{python}
"""A stand-in llama-server: logs its argv and every request body to {log}; answers exactly max_tokens."""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
if argv == ["--version"]:
    print("version: 0 (stand-in)")
    sys.exit(0)
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": argv}}) + "\\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200 if self.path == "/health" else 404, {{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open({log!r}, "a") as f:
            f.write(json.dumps({{"body": body}}) + "\\n")
        self.reply(200, {{"choices": [{{"text": "x", "index": 0, "finish_reason": "length"}}],
                         "usage": {{"completion_tokens": body["max_tokens"], "prompt_tokens": len(body["prompt"])}}}})

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
'''


def test_flags_name_what_the_llamacpp_baseline_needs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        compare.parse_args(["--baseline", "llamacpp"])  # no --llamacpp-server
    with pytest.raises(SystemExit):
        compare.parse_args(["--gguf", str(tmp_path / "m.gguf")])  # a llama.cpp flag for another baseline
    with pytest.raises(SystemExit):
        compare.parse_args(["--baseline", "llamacpp", "--llamacpp-server", "x", "--slots", "0"])
    args, rest = compare.parse_args(["--baseline", "llamacpp", "--llamacpp-server", "x", "--tp-size", "1"])
    assert args.workload == ["single", "uniform"] and args.slots == 64 and rest == ["--tp-size", "1"]
    assert compare.parse_args([])[0].workload == ["uniform"]
    config = LlamaServerConfig(
        "/bin/llama-server", "m.gguf", slots=4, threads=2, ctx_per_slot=256, extra_args=("--flash-attn",)
    )
    argv = config.argv(8080)
    assert argv[argv.index("-np") + 1] == "4" and argv[argv.index("-c") + 1] == "1024"
    assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == "2" and argv[-1] == "--flash-attn"


def test_side_by_side_rows_and_the_cpu_named() -> None:
    rows = [
        {"engine": "ours", "workload": "single", "output_tok_s": 30.0, "latency_p50_s": 4.0},
        {"engine": "base", "workload": "single", "output_tok_s": 60.0, "latency_p50_s": 2.0},
        {"engine": "ratio ours/base", "workload": "single", "output_tok_s": 0.5},
        {"engine": "base", "workload": "uniform", "output_tok_s": 90.0, "latency_p50_s": 9.0},
    ]
    (single,) = compare.side_by_side(rows, {"single": 128, "uniform": 64}, "ours", "base")  # uniform: ours missing
    assert single["ratio"] == 0.5 and single["ours_ms"] == 4000.0 / 128 and single["base_ms"] == 2000.0 / 128
    assert math.isnan(compare.side_by_side(rows, {}, "ours", "base")[0]["ours_ms"])
    assert [title for _, title in compare.side_columns("llama.cpp")][3] == "tinyserve / llama.cpp"
    cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fma avx2\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\n"
    assert cpu_description(cpuinfo) == "AMD EPYC, 2 cores, AVX2-only"


def test_a_llamacpp_run_starts_the_server_with_our_slots_and_threads_and_sends_the_same_prompts(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "server.jsonl"
    server = tmp_path / "llama-server"
    server.write_text(FAKE_SERVER.format(python=sys.executable, log=str(log)))
    server.chmod(0o755)
    gguf = write_checkpoint_gguf(tiny_llama_path, tmp_path / "tiny.gguf")
    out = tmp_path / "cmp.json"
    assert (
        compare.main(
            [
                "--baseline",
                "llamacpp",
                "--llamacpp-server",
                str(server),
                "--gguf",
                str(gguf),
                "--slots",
                "3",
                "--llamacpp-ctx-per-slot",
                "256",
                "--threads",
                "1",
                "--skip-ours",
                "--workload",
                "single",
                "uniform",
                "--num-requests",
                "2",
                "--max-new-tokens",
                "3",
                "--workload-arg",
                "prompt_len=5",
                "--repeat",
                "2",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert "tinyserve vs llamacpp" in capsys.readouterr().out
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    (argv,) = [e["argv"] for e in entries if "argv" in e]  # one server for every run
    assert argv[argv.index("-m") + 1] == str(gguf) and argv[argv.index("-np") + 1] == "3"
    assert argv[argv.index("-c") + 1] == "768" and argv[argv.index("-t") + 1] == "1"
    bodies = [e["body"] for e in entries if "body" in e]
    data = read_json(out)
    folder = str(checkpoint_folder(str(gguf)))  # the folder both engines read
    prompts = []  # each repeat its own prompts (seed + repeat): no repeat is answered from a prefix cache
    for seed in (0, 1):
        wanted = argparse.Namespace(
            workload=["single", "uniform"], workload_arg=["prompt_len=5"], num_requests=2, max_new_tokens=3, seed=seed
        )
        prompts.append(sorted(r.input_ids for w in serving.build_workloads(wanted, folder) for r in w.requests))
    assert prompts[0] != prompts[1]
    assert len(bodies) == 2 * 2 * 4  # per repeat: each workload's warm-up and timed run (2 requests each)
    assert sorted(b["prompt"] for b in bodies if b["max_tokens"] == 3) == sorted(prompts[0] + prompts[1])
    assert {b["max_tokens"] for b in bodies} == {2, 3}  # warm-ups ask for 2 tokens
    assert all(
        b["temperature"] == 0.0 and b["ignore_eos"] and b["cache_prompt"] is False and not b["stream"] for b in bodies
    )
    rows = [r for r in data["summary"] if r["engine"] == ENGINE]
    assert [r["workload"] for r in rows] == ["single", "uniform"] and all(r["repeats"] == 2 for r in rows)
    assert data["settings"]["baseline_info"]["version"] == "version: 0 (stand-in)"
    assert os.path.basename(data["settings"]["baseline_info"]["gguf"]) == "tiny.gguf"


def test_single_is_one_request_at_a_time_of_128_to_128() -> None:
    (alone,) = single().requests
    assert len(alone.input_ids) == 128 and alone.max_new_tokens == 128
    chat = single(num_requests=3)
    assert [r.after for r in chat.requests] == [None, 0, 1] and chat.max_parallel == 1
