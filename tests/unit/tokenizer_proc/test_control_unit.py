"""The front door's side of SGLang's operational routes without processes: a recording router and
scheduler socket.

* /abort_request's abort by client rid reaches every client's request of that rid (and only those),
  each ending with a last chunk of finish reason abort and a scheduler abort; abort_all reaches all;
* a profile start and a weight update reach the scheduler as typed ``SchedControlReq`` fields, the
  update's model path resolved first (a path that names nothing is refused before the scheduler);
* a successful update moves the model path and weight_version that /get_model_info and /server_info
  report, even when its caller stopped waiting;
* SGLang's bodies: the defaults and switches SGLang reads (profiler dir, stacks), strict types.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest
from pydantic import ValidationError

from runtime.config.args import ServerArgs
from runtime.protocol.messages import (
    ControlReply,
    ErrorReply,
    GenerateChunk,
    GenerateReq,
    ProfileOptions,
    ProfileReq,
    SchedAbortReq,
    SchedControlOut,
    SchedControlReq,
    UpdateWeightsReq,
    WeightUpdate,
)
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.control_bodies import AbortBody, ProfileBody, UpdateWeightsBody
from tokenizer_proc.request_builder import ModelLimits
from tokenizer_proc.tokenizer_manager import TokenizerManager

LIMITS = ModelLimits(vocab_size=100, context_len=1000, max_req_input_len=500, max_total_tokens=1000)


class Tokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * max(1, len(text) // 10)


class Recorder:
    """The scheduler socket: what the front door sent it."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


class Router:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    async def send(self, identity: bytes, msg: Any) -> None:
        self.sent.append((identity, msg))

    async def send_raw(self, identity: bytes, payload: bytes) -> None:
        pass


def manager() -> tuple[TokenizerManager, Router, Recorder]:
    router, sched = Router(), Recorder()
    args = dataclasses.replace(ServerArgs(), model_path="/models/a")
    return TokenizerManager(args, Tokenizer(), LIMITS, router, sched), router, sched  # type: ignore[arg-type]


def frame(msg: Any) -> list[bytes]:
    return [msgspec.msgpack.encode(msg)]


def test_abort_by_rid_reaches_that_rid_on_every_client_and_abort_all_the_rest() -> None:
    async def main() -> None:
        m, router, sched = manager()
        for client, rid in ((b"c1", "x"), (b"c2", "x"), (b"c3", "y")):
            await m.handle_client_frames(client, frame(GenerateReq(rid=rid, input_ids=[1, 2], stream=True)))
        internal = {s.rid for s in sched.sent}
        assert await m.abort_requests("x", False, "aborted by /abort_request") == 2
        last = {who: msg for who, msg in router.sent if isinstance(msg, GenerateChunk)}
        assert set(last) == {b"c1", b"c2"}
        for chunk in last.values():
            assert chunk.rid == "x" and chunk.finished
            assert chunk.finish_reason == {"type": "abort", "message": "aborted by /abort_request"}
        aborted = {msg.rid for msg in sched.sent if isinstance(msg, SchedAbortReq)}
        assert len(aborted) == 2 and aborted < internal
        assert m.table.contains(b"c3", "y") and m.table.num_groups == 1
        assert await m.abort_requests("nobody", False, "why") == 0
        assert await m.abort_requests("", True, "all") == 1 and m.table.is_empty()

    asyncio.run(main())


def test_profile_and_weight_updates_reach_the_scheduler_typed(tmp_path: Path) -> None:
    async def main() -> None:
        m, router, sched = manager()
        options = ProfileOptions(output_dir="/tmp/t", profile_id="id", num_steps=2)
        await m.handle_client_frames(b"c", frame(ProfileReq(rid="p", start=True, options=options)))
        assert sched.sent[-1] == SchedControlReq(rid=sched.sent[-1].rid, kind="start_profile", profile=options)
        await m.handle_client_frames(b"c", frame(ProfileReq(rid="s", start=False)))
        assert (sched.sent[-1].kind, sched.sent[-1].profile) == ("stop_profile", None)
        update = WeightUpdate(model_path=str(tmp_path), weight_version="v2", abort_all_requests=True)
        await m.handle_client_frames(b"c", frame(UpdateWeightsReq(rid="u", update=update)))
        sent = sched.sent[-1]
        assert (sent.kind, sent.weights) == ("update_weights", update)  # a local folder names itself
        assert m.model_info()["weight_version"] == "default"
        payload = {"success": True, "message": "ok", "num_paused_requests": 0, "model_path": str(tmp_path)}
        await m.control.handle_out(SchedControlOut(sent.rid, "update_weights", {**payload, "weight_version": "v2"}))
        assert router.sent[-1] == (
            b"c",
            ControlReply(rid="u", kind="update_weights", payload={**payload, "weight_version": "v2"}),
        )
        assert (m.model_info()["model_path"], m.model_info()["weight_version"]) == (str(tmp_path), "v2")
        info = m.compose_server_info({})
        assert info["weight_version"] == "v2" and info["model"]["model_path"] == str(tmp_path)
        # a caller that stopped waiting (timeout) still moves what the server reports
        await m.handle_client_frames(b"c", frame(UpdateWeightsReq(rid="u2", update=WeightUpdate(str(tmp_path)))))
        late = sched.sent[-1].rid
        m.control.drop(late)
        await m.control.handle_out(SchedControlOut(late, "update_weights", {**payload, "weight_version": "v3"}))
        assert m.model_info()["weight_version"] == "v3"

    asyncio.run(main())


def test_a_model_path_that_names_nothing_is_refused_before_the_scheduler(tmp_path: Path) -> None:
    async def main() -> None:
        m, router, sched = manager()
        missing = str(tmp_path / "weights.gguf")
        await m.handle_client_frames(b"c", frame(UpdateWeightsReq(rid="u", update=WeightUpdate(missing))))
        assert not sched.sent
        ((_, err),) = router.sent
        assert isinstance(err, ErrorReply) and err.code == "invalid_request" and missing in err.message

    asyncio.run(main())


def test_profile_body_defaults_follow_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("SGLANG_PROFILE_WITH_STACK", raising=False)
    default = ProfileBody().options()
    assert (default.output_dir, default.num_steps, default.activities) == ("/tmp", None, None)
    assert default.with_stack and default.record_shapes and float(default.profile_id) > 0
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", "/traces")
    monkeypatch.setenv("SGLANG_PROFILE_WITH_STACK", "false")
    body = ProfileBody.model_validate_json(
        '{"num_steps": 0, "profile_id": "7", "profile_prefix": "run", "start_step": 3, "activities": ["CPU"]}'
    )
    opts = body.options()
    assert (opts.output_dir, opts.profile_id, opts.num_steps, opts.activities) == ("/traces", "run-7", None, ["CPU"])
    assert not opts.with_stack and opts.record_shapes
    assert body.model_extra == {"start_step": 3}  # not served: ignored (with one warning)
    with pytest.raises(oai.BadRequest, match="num_steps"):
        ProfileBody(num_steps=-1).options()


def test_bodies_are_strict_and_take_sglang_fields() -> None:
    with pytest.raises(ValidationError):
        AbortBody.model_validate_json('{"rid": 5}')
    assert AbortBody.model_validate_json('{"rid": null, "abort_all": true, "finished_reason": null}').abort_all
    with pytest.raises(ValidationError):
        UpdateWeightsBody.model_validate_json('{"load_format": null}')  # model_path is required
    body = UpdateWeightsBody.model_validate_json(
        '{"model_path": "/m", "abort_all_requests": true, "weight_version": "v1", "flush_cache": true, "is_async": false}'
    )
    assert body.update() == WeightUpdate(model_path="/m", weight_version="v1", abort_all_requests=True)
