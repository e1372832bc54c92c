"""llama.cpp's own server (``llama-server``) on a GGUF file, as a baseline for bench.compare.

llama.cpp is what most people run a small model on a CPU with, and its server batches requests
continuously over parallel slots, as tinyserve does: the fair comparison for a serving runtime.
``llama_server`` starts it under this process's pinning (the cpus are inherited, ``-t`` / ``-tb``
get the thread count), with as many slots as tinyserve's ``--max-running-requests`` and a
context of ``ctx_per_slot`` tokens per slot, and stops it on exit. ``run_llamacpp_baseline``
sends the workloads through the same HTTP client and code as tinyserve's HTTP runs
(bench/http_backend.py, bench/load_runner.py): token-id prompts, greedy, ``ignore_eos``,
exactly ``max_new_tokens`` tokens each; ``cache_prompt: false`` keeps llama-server from reusing
a slot's previous prompt, so repeats and warm-ups are not served from its cache (tinyserve's
prefix cache is flushed between runs for the same reason).

Build llama-server from llama.cpp's sources (``cmake -B build -DLLAMA_BUILD_SERVER=ON
-DGGML_NATIVE=ON && cmake --build build --target llama-server``) and give its path.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

ENGINE = "llama.cpp"
# Fields only llama-server reads: never serve a prompt from a slot's cache of the last one.
EXTRA_BODY = {"cache_prompt": False}


@dataclass(frozen=True)
class LlamaServerConfig:
    """How llama-server is started: the binary, the model, slots and threads (tinyserve's)."""

    server: str
    gguf: str
    slots: int
    threads: int
    ctx_per_slot: int = 1024
    extra_args: tuple[str, ...] = ()

    def argv(self, port: int) -> list[str]:
        """The command line: ``-np`` slots sharing ``-c`` = slots x ctx_per_slot tokens of context,
        ``-t`` / ``-tb`` threads for decode and prompt batches alike."""
        return [
            self.server,
            "-m",
            self.gguf,
            "-np",
            str(self.slots),
            "-c",
            str(self.slots * self.ctx_per_slot),
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self.extra_args,
        ]

    @property
    def model_name(self) -> str:
        return Path(self.gguf).stem


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    """llama-server answers /health with 200 once the model is loaded (503 while loading)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@contextlib.contextmanager
def llama_server(
    config: LlamaServerConfig,
    env: dict[str, str] | None = None,
    ready_timeout: float = 300.0,
    log_path: str | None = None,
) -> Iterator[str]:
    """A running llama-server (its ``http://127.0.0.1:PORT``), stopped on exit. Its output goes to
    ``log_path`` (default: discarded), and is named in the error if it does not come up."""
    if not os.access(config.server, os.X_OK):
        raise SystemExit(f"--llamacpp-server {config.server!r} is not an executable")
    if not Path(config.gguf).is_file():
        raise SystemExit(f"--gguf {config.gguf!r} is not a file")
    port = free_port()
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(config.argv(port), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + ready_timeout
        while not _healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"llama-server did not come up (exit code {proc.poll()}; "
                    f"its output: {log_path or 'discarded, give --llamacpp-log'})"
                )
            time.sleep(0.2)  # nothing to wait on but its HTTP answer
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()


def run_llamacpp_baseline(
    config: LlamaServerConfig,
    per_repeat: Sequence[Sequence[Any]],
    *,
    stream: bool,
    warmup: int,
    seed: int,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
) -> list[dict[str, Any]]:
    """Run records in serving.py's layout, one per (repeat, workload), from one llama-server:
    ``per_repeat[r]`` are repeat r's workloads (each repeat its own prompts)."""
    from bench.load_runner import run_workload
    from bench.serving import summarize_run, warm_up

    via = {"backend": "http", "model": config.model_name, "extra_body": EXTRA_BODY}
    runs: list[dict[str, Any]] = []
    with llama_server(config, env=env, log_path=log_path) as url:
        for rep, workloads in enumerate(per_repeat):
            for wl in workloads:
                warm_up(url, None, wl, warmup, stream=stream, **via)  # (as the timed run sends them)
                records, duration = run_workload(url, wl, stream=stream, seed=seed, **via)
                metrics = summarize_run(records, duration)
                if metrics["failed"]:
                    print(
                        f"warning: {metrics['failed']} llama.cpp requests failed in {wl.name}: {metrics['errors']}",
                        file=sys.stderr,
                    )
                runs.append(
                    {
                        "kind": "llamacpp_baseline",
                        "engine": ENGINE,
                        "workload": wl.spec(),
                        "repeat": rep,
                        "settings": {
                            "argv": config.argv(0)[1:],
                            "stream": stream,
                            "warmup": warmup,
                            "extra_body": EXTRA_BODY,
                        },
                        "metrics": metrics,
                    }
                )
    return runs


def version(server: str) -> str | None:
    """``llama-server --version``'s first line (its build), or None."""
    try:
        out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stdout + out.stderr).strip().splitlines()
    found = [line for line in lines if "version" in line.lower()]
    return (found or lines or [None])[0]


def describe(config: LlamaServerConfig) -> dict[str, Any]:
    """What the result file records of the baseline."""
    return {
        "server": config.server,
        "gguf": config.gguf,
        "version": version(config.server),
        "argv": json.dumps(config.argv(0)[1:]),
    }
