"""Ollama's routes on the real app, with a scripted front door in place of the tokenizer manager: what
a body becomes (the ``GenerateReq`` submitted), the NDJSON stream as sent (its content type, one object
a line, ``done`` last), Ollama's error body with the HTTP status (a refusal of the shared request path
naming Ollama's field, an unknown model's 404, an error after the first line as the last line), the key
check, the model description of ``/api/tags``, ``/api/show`` and ``/api/ps`` read from the checkpoint
folder, and the routes that answer without generating (``HEAD /``, the version, the load call, 501s)."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from runtime.config.args import ServerArgs
from runtime.protocol.field_refs import FieldRef
from runtime.protocol.messages import ChunkMeta, ErrorReply, GenerateChunk, GenerateReq
from tests.support.asgi import AsgiReply, call_app
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.server import build_app
from tokenizer_proc.ollama_models import model_facts, parameter_size
from tokenizer_proc.request_builder import Rejected

KEY = "secret"
CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
DONE = {"type": "stop", "matched": 2}


class ScriptedDoor:
    """A front door that answers every request with ``script`` (chunks, or an ErrorReply), or refuses
    it with ``refuse``; it keeps what it was sent."""

    def __init__(self, folder: Path, script: list[Any], refuse: Rejected | None = None) -> None:
        self.folder = folder
        self.script = script
        self.refuse = refuse
        self.tokenizer = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
        self.context_len = 2048
        self.metrics = None
        self.draining = False
        self.weight_version = "default"
        self.embedding = None  # a generation server
        self.reqs: list[GenerateReq] = []
        self.closed = 0
        self.queue: asyncio.Queue[Any] | None = None

    def model_info(self) -> dict[str, Any]:
        return {"model_path": str(self.folder), "effective_sampling_params": {"temperature": 0.2, "top_p": 0.9}}

    def open_local(self) -> tuple[bytes, asyncio.Queue[Any]]:
        self.queue = asyncio.Queue()
        return b"local", self.queue

    async def submit_local(self, identity: bytes, req: GenerateReq) -> int:
        self.reqs.append(req)
        if self.refuse is not None:
            raise self.refuse
        assert self.queue is not None
        for item in self.script:
            self.queue.put_nowait(msgspec.structs.replace(item, rid=req.rid))
        return 1

    def close_local(self, identity: bytes) -> None:
        self.closed += 1


def gguf_folder(tmp_path: Path) -> Path:
    """A prepared GGUF checkpoint folder's metadata (no weights are read)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    tensors = [
        {"name": "token_embd.weight", "type": "Q8_0", "shape": [100, 64]},
        {"name": "blk.0.attn_q.weight", "type": "Q4_1", "shape": [64, 64]},
        {"name": "blk.1.attn_q.weight", "type": "Q4_1", "shape": [64, 64]},
        {"name": "blk.0.attn_norm.weight", "type": "F32", "shape": [64]},
    ]
    index = {"file": "/models/tiny.gguf", "size": 123456, "mtime_ns": 1_700_000_000_000_000_000, "tensors": tensors}
    (tmp_path / "gguf.json").write_text(json.dumps(index))
    return tmp_path


def pieces(*texts: str, reason: str = "stop") -> list[GenerateChunk]:
    finish = {"type": reason, "matched": 2}
    out = [GenerateChunk("", t, [i], False) for i, t in enumerate(texts[:-1])]
    return out + [GenerateChunk("", texts[-1], [9], True, finish, ChunkMeta(5, len(texts), finish_reason=finish))]


def app_with(
    tmp_path: Path, script: list[Any], refuse: Rejected | None = None, **args: Any
) -> tuple[Any, ScriptedDoor]:
    folder = gguf_folder(tmp_path)
    server_args = ServerArgs(model_path=str(folder), served_model_name="tiny", api_key=KEY, **args)
    context = HttpContext(server_args, 1 << 20)
    door = ScriptedDoor(folder, script, refuse)
    context.attach(door)  # type: ignore[arg-type]
    return build_app(context), door


def post(app: Any, path: str, body: dict[str, Any], key: str | None = KEY) -> AsgiReply:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    return call_app(app, "POST", path, json.dumps(body).encode(), headers)


def get(app: Any, path: str, method: str = "GET") -> AsgiReply:
    return call_app(app, method, path, b"", {"authorization": f"Bearer {KEY}"})


def test_chat_whole(tmp_path: Path) -> None:
    app, door = app_with(tmp_path, pieces("Hel", "lo", "!"))
    body = {"model": "tiny:latest", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    reply = post(app, "/api/chat", {**body, "options": {"temperature": 0, "num_predict": 3}})
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    out = reply.json()
    assert out["model"] == "tiny:latest" and out["message"] == {"role": "assistant", "content": "Hello!"}
    assert out["done"] and out["done_reason"] == "stop" and out["eval_count"] == 3 and out["prompt_eval_count"] == 5
    assert all(isinstance(out[k], int) and out[k] >= 0 for k in ("total_duration", "load_duration", "eval_duration"))
    [req] = door.reqs
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert req.sampling_params == {"n": 1, "temperature": 0, "max_new_tokens": 3} and req.stream
    assert door.closed >= 1


def test_chat_streams_ndjson_by_default(tmp_path: Path) -> None:
    app, _ = app_with(tmp_path, pieces("Hel", "lo", "!"))
    reply = post(app, "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status == 200 and reply.headers["content-type"] == "application/x-ndjson"
    lines = reply.body.split(b"\n")
    assert lines[-1] == b""
    objects = [json.loads(line) for line in lines[:-1]]
    assert [o["done"] for o in objects] == [False, False, False, True]
    assert "".join(o["message"]["content"] for o in objects) == "Hello!"
    assert objects[-1]["done_reason"] == "stop" and objects[-1]["eval_count"] == 3


def test_generate_stream_and_raw(tmp_path: Path) -> None:
    app, door = app_with(tmp_path, pieces("4", "2", reason="length"))
    reply = post(app, "/api/generate", {"model": "tiny", "prompt": "6*7=", "raw": True})
    objects = [json.loads(line) for line in reply.body.splitlines()]
    assert "".join(o["response"] for o in objects) == "42" and objects[-1]["done_reason"] == "length"
    assert door.reqs[0].text == "6*7=" and door.reqs[0].messages is None


def test_load_call_generates_nothing(tmp_path: Path) -> None:
    app, door = app_with(tmp_path, [])
    for path, body in (("/api/generate", {"model": "tiny"}), ("/api/chat", {"model": "tiny", "messages": []})):
        out = post(app, path, body).json()
        assert out["done"] is True and out["done_reason"] == "load"
    assert door.reqs == []


def test_unknown_model_is_ollamas_404(tmp_path: Path) -> None:
    app, door = app_with(tmp_path, [])
    for path in ("/api/chat", "/api/generate", "/api/show"):
        reply = post(app, path, {"model": "llama3", "prompt": "x", "messages": [{"role": "user", "content": "x"}]})
        assert reply.status == 404 and reply.json() == {"error": 'model "llama3" not found, try pulling it first'}
    assert door.reqs == []


def test_errors_are_ollamas_shape_naming_ollamas_fields(tmp_path: Path) -> None:
    too_long = Rejected(
        "too_long", ("prompt (9 tokens) + ", FieldRef("max_new_tokens"), " (9000) = 9009 exceeds"), "max_new_tokens"
    )
    app, _ = app_with(tmp_path, [], refuse=too_long)
    reply = post(app, "/api/generate", {"model": "tiny", "prompt": "x", "options": {"num_predict": 9000}})
    assert reply.status == 400 and reply.json() == {
        "error": "prompt (9 tokens) + options.num_predict (9000) = 9009 exceeds"
    }
    bad_type = post(app, "/api/chat", {"model": "tiny", "messages": [], "options": {"top_k": "many"}})
    assert bad_type.status == 400 and bad_type.json()["error"].startswith("options.top_k:")
    assert (
        post(app, "/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"})
        .json()["error"]
        .startswith("suffix:")
    )
    assert set(post(app, "/api/chat", {"messages": []}).json()) == {"error"}  # no model


def test_an_error_after_the_first_line_is_the_last_line(tmp_path: Path) -> None:
    app, _ = app_with(
        tmp_path, [GenerateChunk("", "Hi", [1], False), ErrorReply("", "out_of_memory", "out of KV memory")]
    )
    reply = post(app, "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    objects = [json.loads(line) for line in reply.body.splitlines()]
    assert objects[0]["message"]["content"] == "Hi" and objects[-1] == {"error": "out of KV memory"}


def test_the_key_is_checked(tmp_path: Path) -> None:
    app, _ = app_with(tmp_path, pieces("x"))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    for key in (None, "wrong"):
        reply = post(app, "/api/chat", body, key=key)
        assert reply.status == 401 and set(reply.json()) == {"error"}
    assert call_app(app, "GET", "/api/tags").status == 401
    # the liveness probe and the version need no key
    assert call_app(app, "HEAD", "/").status == 200
    assert call_app(app, "GET", "/api/version").json()["version"]


def test_tags_show_ps(tmp_path: Path) -> None:
    app, _ = app_with(tmp_path, [], tool_call_parser="hermes", reasoning_parser="qwen3")
    [model] = get(app, "/api/tags").json()["models"]
    assert model["name"] == model["model"] == "tiny:latest" and model["size"] == 123456
    assert model["digest"].startswith("sha256:") and model["modified_at"].startswith("2023-11-14T")
    details = {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": "15K",  # 100*64 + 2*64*64 + 64
        "quantization_level": "Q4_1",
    }
    assert model["details"] == details
    shown = post(app, "/api/show", {"model": "tiny"}).json()
    assert shown["details"] == details and shown["capabilities"] == ["completion", "tools", "thinking"]
    assert shown["model_info"]["general.architecture"] == "llama"
    assert shown["model_info"]["llama.context_length"] == 2048 and shown["model_info"]["llama.block_count"] == 2
    assert shown["parameters"] == "temperature 0.2\ntop_p 0.9" and "{% for m in messages %}" in shown["template"]
    assert f"FROM {tmp_path}" in shown["modelfile"]
    [loaded] = get(app, "/api/ps").json()["models"]
    assert loaded["name"] == "tiny:latest" and loaded["size_vram"] == 0 and loaded["context_length"] == 2048
    assert loaded["expires_at"] > "2100"


def test_what_is_not_served_says_so(tmp_path: Path) -> None:
    app, _ = app_with(tmp_path, [])
    embed = post(app, "/api/embed", {"model": "tiny", "input": "hi"})
    assert embed.status == 501 and "embeddings are not served" in embed.json()["error"]
    pull = post(app, "/api/pull", {"model": "llama3"})
    assert pull.status == 501 and "/api/pull is not supported" in pull.json()["error"]


def test_safetensors_facts(tmp_path: Path) -> None:
    """A safetensors checkpoint: the parameters counted from its header, its size from the file."""
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "model_type": "qwen3"}))
    header = {
        "a": {"dtype": "BF16", "shape": [1000, 1000], "data_offsets": [0, 0]},
        "b": {"dtype": "F32", "shape": [10], "data_offsets": [0, 0]},
        "__metadata__": {"format": "pt"},
    }
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)
    facts = model_facts(str(tmp_path))
    assert facts.format == "safetensors" and facts.architecture == "qwen3"
    assert facts.parameter_count == 1_000_010 and facts.quantization == "BF16"
    assert facts.size == (tmp_path / "model.safetensors").stat().st_size


@pytest.mark.parametrize(
    "count, text", [(None, ""), (134_515_008, "135M"), (7_615_616_512, "7.6B"), (70_553_706_496, "71B"), (512, "512")]
)
def test_parameter_size(count: int | None, text: str) -> None:
    assert parameter_size(count) == text
