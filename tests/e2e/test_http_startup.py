"""Start-up of a server with the HTTP front end, from a hub id:

* ``--model-path ORG/NAME`` resolves through huggingface_hub from a hub cache folder made
  here (``HF_HUB_OFFLINE=1``: never the network); a revision picks its snapshot; a repo
  that is not cached, or has no safetensors, is a clear error;
* ``/health`` answers 503 while the scheduler is not ready (it is held with SIGSTOP, so
  the window is certain), then 200; the served model name defaults to the hub id;
* ``ps`` shows the process titles (tinyserve::scheduler_TP0, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from runtime.checkpoints.hub import HubError, resolve_hub_path
from runtime.protocol.child_process import child_pids
from tests.support import REPO_ROOT as REPO
from tests.support.server_fixtures import base_args, wait_gone, wait_until
from tests.support.server_process import ServerProcess

pytest_plugins = ["tests.support.server_fixtures"]

REPO_ID = "tinyserve-test/tiny-llama"
COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def add_to_hub_cache(
    cache: Path, repo_id: str, src: Path, commit: str, ref: str | None = "main", skip: tuple[str, ...] = ()
) -> Path:
    """Lay ``src``'s files out as huggingface_hub caches a snapshot (refs/REF -> commit)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(src, snapshot, ignore=shutil.ignore_patterns(*skip))
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture()
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty hub cache, offline, for in-process resolution."""
    import huggingface_hub

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_resolve_from_the_cache(offline_hub: Path, tiny_llama_path: Path) -> None:
    main = add_to_hub_cache(offline_hub, REPO_ID, tiny_llama_path, COMMIT_MAIN)
    v1 = add_to_hub_cache(offline_hub, REPO_ID, tiny_llama_path, COMMIT_V1, ref="v1")
    assert Path(resolve_hub_path(REPO_ID)) == main
    assert Path(resolve_hub_path(REPO_ID, revision="v1")) == v1
    assert Path(resolve_hub_path(REPO_ID, revision=COMMIT_V1)) == v1


def test_hub_errors_are_clear(offline_hub: Path, tiny_llama_path: Path) -> None:
    with pytest.raises(HubError, match=r"nobody/nothing is not in the hub cache .* HF_HUB_OFFLINE is set"):
        resolve_hub_path("nobody/nothing")
    add_to_hub_cache(offline_hub, "old/pickles", tiny_llama_path, COMMIT_MAIN, skip=("*.safetensors",))
    with pytest.raises(HubError, match="no \\*.safetensors weights"):
        resolve_hub_path("old/pickles")
    assert Path(resolve_hub_path("old/pickles", need_weights=False)).is_dir()  # a tokenizer-only repo is fine


def test_launch_reports_an_uncached_hub_id(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--model-path", "nobody/nothing", "--device", "cpu", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert "nobody/nothing is not in the hub cache" in proc.stderr


def test_chat_template_file_replaces_the_tokenizers(tmp_path: Path, tiny_llama_path: Path) -> None:
    from runtime.text.tokenizer import load_tokenizer

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    tok = load_tokenizer(str(tiny_llama_path), str(template))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<user>hi<assistant>"
    assert load_tokenizer(str(tiny_llama_path)).chat_template != tok.chat_template


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post(url: str, body: Any) -> tuple[int, Any, Any]:
    """(status, headers, JSON body) of a POST that is expected to be refused."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode()
    except OSError:
        return ""


def _children_by_title(server: ServerProcess) -> dict[str, int]:
    if server.process.poll() is not None:
        raise AssertionError(f"the server exited with {server.process.returncode}:\n{server.log_tail()}")
    return {_title(p): p for p in child_pids(server.pid)}


def test_health_is_503_until_the_scheduler_is_ready_and_titles_show(tmp_path: Path, tiny_llama_path: Path) -> None:
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, REPO_ID, tiny_llama_path, COMMIT_MAIN)
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    http_port = _free_port()
    args = base_args(Path(REPO_ID), "--port", "0", "--http-port", str(http_port))
    server = ServerProcess(args, env=env, wait=False)
    url = f"http://127.0.0.1:{http_port}"
    try:
        # Hold the scheduler before it can be ready: the HTTP server must answer "starting".
        scheduler = wait_until(
            lambda: _children_by_title(server).get("tinyserve::scheduler_TP0"), 60, "the scheduler's process title"
        )
        os.kill(scheduler, signal.SIGSTOP)
        try:

            def health() -> tuple[int, Any] | None:
                try:
                    return _get(url + "/health")
                except (urllib.error.URLError, ConnectionError):
                    return None  # not listening yet

            status, body = wait_until(health, 60, "the HTTP server to listen")
            assert status == 503 and body["error"]["code"] == "starting"
            assert _get(url + "/v1/models")[0] == 503
            # the generation routes too, with a body and the key, and each says when to retry
            for path, body in (
                ("/v1/completions", {"model": REPO_ID, "prompt": "hi", "logprobs": 1}),
                ("/v1/chat/completions", {"model": REPO_ID, "messages": [{"role": "user", "content": "hi"}]}),
                ("/generate", {"text": "hi"}),
                ("/tokenize", {"prompt": "hi"}),
            ):
                status, headers, reply = _post(url + path, body)
                assert (status, reply["error"]["code"], headers.get("Retry-After")) == (503, "starting", "1"), path
            assert server.address is None  # not ready either
        finally:
            os.kill(scheduler, signal.SIGCONT)
        server.wait_ready(120)
        assert server.http_address == url
        assert _get(url + "/health")[0] == 200
        status, models = _get(url + "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [REPO_ID]
        titles = _children_by_title(server)
        assert {"tinyserve::scheduler_TP0", "tinyserve::detokenizer", "tinyserve::tokenizer"} <= set(titles)
    finally:
        code = server.stop()
    assert code == 0
    assert wait_gone(list(titles.values()), 10) == []
