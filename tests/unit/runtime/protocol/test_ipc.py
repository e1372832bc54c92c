"""Typed sockets: round trips of every internal message, malformed frames are logged and
skipped (never raised), and the ROUTER reports a vanished client."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from runtime.protocol.ipc import AsyncPullSocket, AsyncRouter, ClientBusy, ClientGone, PullSocket, PushSocket
from runtime.protocol.messages import (
    BatchStrOut,
    BatchTokenIDOut,
    DetokenizerInput,
    ReqOutput,
    SchedAbortReq,
    SchedControlOut,
    SchedControlReq,
    SchedErrorOut,
    SchedulerInput,
    StrOutput,
    TokenizedGenerateReq,
    TokenizerInput,
)
from runtime.protocol.sampling_params import SamplingParams


@pytest.fixture()
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/sock"


def test_round_trip_of_every_scheduler_input(endpoint: str) -> None:
    pull: PullSocket[object] = PullSocket(endpoint, SchedulerInput, bind=True)
    push: PushSocket[object] = PushSocket(endpoint, SchedulerInput, bind=False)
    msgs = [
        TokenizedGenerateReq(
            rid="a",
            input_ids=[1, 2, 3],
            sampling_params=SamplingParams(temperature=0.0, stop=["x"]),
            stream=True,
            return_logprob=True,
            top_logprobs_num=2,
        ),
        SchedAbortReq(rid="a"),
        SchedControlReq(rid="c", kind="server_info"),
    ]
    try:
        for m in msgs:
            push.send(m)
        assert pull.poll(5000)
        got = []
        while len(got) < len(msgs):
            assert pull.poll(5000)
            got += pull.recv_all_nowait()
        assert got == msgs
        assert pull.recv_nowait() is None
        assert pull.recv(timeout_ms=10) is None
    finally:
        push.close()
        pull.close()


def test_round_trip_of_detokenizer_and_tokenizer_inputs(endpoint: str) -> None:
    out = ReqOutput(
        rid="r",
        new_output_ids=[5],
        finished=True,
        finish_reason={"type": "stop", "matched": 7},
        prompt_tokens=3,
        completion_tokens=1,
        output_logprobs=[-0.5],
        stop_strs=["ab"],
    )
    for union, msgs in (
        (
            DetokenizerInput,
            [
                BatchTokenIDOut(outputs=[out]),
                SchedErrorOut(rid="r", code="too_long", message="m"),
                SchedControlOut(rid="c", kind="flush_cache", payload={"success": True}),
            ],
        ),
        (TokenizerInput, [BatchStrOut(outputs=[StrOutput(rid="r", text_delta="é", new_output_ids=[5])])]),
    ):
        pull: PullSocket[object] = PullSocket(endpoint, union, bind=True)
        push: PushSocket[object] = PushSocket(endpoint, union, bind=False)
        try:
            for m in msgs:
                push.send(m)
            got = [pull.recv(timeout_ms=5000) for _ in msgs]
            assert got == msgs
        finally:
            push.close()
            pull.close()


def test_malformed_frames_are_logged_and_skipped(endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    pull: PullSocket[object] = PullSocket(endpoint, SchedulerInput, bind=True)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint)
    good = SchedAbortReq(rid="ok")
    try:
        with caplog.at_level(logging.ERROR, logger="runtime.protocol.ipc"):
            raw.send(b"\xc1 not msgpack")  # 0xc1 is never valid msgpack
            raw.send(msgspec.msgpack.encode({"type": "no_such_tag", "rid": "x"}))  # valid msgpack, wrong schema
            raw.send(msgspec.msgpack.encode({"type": "sched_abort", "rid": 5}))  # wrong field type
            raw.send(b"")
            raw.send(msgspec.msgpack.encode(good))
            assert pull.poll(5000)
            got = None
            while got is None:  # the frames may trickle in; bad ones are skipped, never raised
                assert pull.poll(5000)
                got = pull.recv_nowait()
        assert got == good
        errors = [r for r in caplog.records if "malformed frame" in r.getMessage()]
        assert len(errors) == 4
    finally:
        raw.close()
        pull.close()


def test_async_pull_skips_malformed_frames(endpoint: str) -> None:
    async def main() -> object:
        ctx = zmq.asyncio.Context()
        pull: AsyncPullSocket[object] = AsyncPullSocket(endpoint, TokenizerInput, ctx, bind=True)
        raw = ctx.socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(endpoint)
        await raw.send(b"garbage")
        await raw.send(msgspec.msgpack.encode(SchedErrorOut(rid="r", code="c", message="m")))
        try:
            return await asyncio.wait_for(pull.recv(), 5)
        finally:
            raw.close()
            pull.close()
            ctx.term()

    assert asyncio.run(main()) == SchedErrorOut(rid="r", code="c", message="m")


def test_router_picks_a_free_port_and_reports_gone_clients() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = AsyncRouter(ctx, "tcp://127.0.0.1:0")
        assert router.port > 0
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, b"client-1")
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(router.endpoint)
        try:
            await dealer.send(b"hello")
            identity, frames = await asyncio.wait_for(router.recv(), 5)
            assert (identity, frames) == (b"client-1", [b"hello"])
            await router.send(identity, SchedAbortReq(rid="x"))
            assert msgspec.msgpack.decode(await asyncio.wait_for(dealer.recv(), 5))["rid"] == "x"
            with pytest.raises(ClientGone):
                await router.send(b"never-connected", SchedAbortReq(rid="y"))
        finally:
            dealer.close()
            router.close()
            ctx.term()

    asyncio.run(main())


def test_router_send_queue_is_bounded_per_client(endpoint: str) -> None:
    """A client that does not read fills its own queue (ClientBusy: the reply is dropped);
    another client on the same ROUTER is still served."""

    async def main() -> int:
        ctx = zmq.asyncio.Context()
        router = AsyncRouter(ctx, endpoint, sndhwm=8)
        idle, reader = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for name, sock in ((b"idle", idle), (b"reader", reader)):
            sock.setsockopt(zmq.ROUTING_ID, name)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 8)
            sock.connect(router.endpoint)
            await sock.send(b"hello")
            await asyncio.wait_for(router.recv(), 5)
        try:
            payload = b"x" * 4096
            sent = 0
            with pytest.raises(ClientBusy):
                while sent < 100_000:  # the socket buffers in between hold a bounded amount
                    await router.send_raw(b"idle", payload)
                    sent += 1
            await router.send(b"reader", SchedAbortReq(rid="still served"))
            assert msgspec.msgpack.decode(await asyncio.wait_for(reader.recv(), 5))["rid"] == "still served"
            return sent
        finally:
            idle.close()
            reader.close()
            router.close()
            ctx.term()

    assert 8 <= asyncio.run(main()) < 100_000
