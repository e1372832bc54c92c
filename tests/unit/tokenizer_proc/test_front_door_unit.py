"""TokenizerManager's fairness and shutdown logic without processes: a recording router and
scheduler socket, and a tokenizer that can be held mid-encode (issue 17)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import msgspec

from runtime.config.args import ServerArgs
from runtime.protocol.ipc import ClientBusy
from runtime.protocol.messages import (
    AbortReq,
    ChunkMeta,
    ControlReply,
    ErrorReply,
    GenerateChunk,
    GenerateChunks,
    GenerateReq,
    SchedAbortReq,
    SchedControlReq,
    ServerInfoReq,
    StrOutput,
    TokenizedGenerateReq,
)
from tokenizer_proc.limits import OFFLOAD_BYTES
from tokenizer_proc.request_builder import ModelLimits
from tokenizer_proc.tokenizer_manager import TokenizerManager

LIMITS = ModelLimits(vocab_size=100, context_len=100_000, max_req_input_len=50_000, max_total_tokens=100_000)


class Tokenizer:
    """One id per 10 characters; ``hold`` blocks encode until ``release`` is set."""

    chat_template = None

    def __init__(self) -> None:
        self.hold = False
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.hold:
            self.entered.set()
            self.release.wait(10)
        return [1] * max(1, len(text) // 10)


class Router:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []
        self.busy: set[bytes] = set()

    async def send(self, identity: bytes, msg: Any) -> None:
        if identity in self.busy:
            raise ClientBusy(identity)
        self.sent.append((identity, msg))

    async def send_raw(self, identity: bytes, payload: bytes) -> None:
        pass


class Scheduler:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def manager(**args: Any) -> tuple[TokenizerManager, Router, Scheduler, Tokenizer]:
    router, sched, tok = Router(), Scheduler(), Tokenizer()
    m = TokenizerManager(dataclasses.replace(ServerArgs(), **args), tok, LIMITS, router, sched)  # type: ignore[arg-type]
    return m, router, sched, tok


def frame(msg: Any) -> list[bytes]:
    return [msgspec.msgpack.encode(msg)]


def test_an_abort_while_tokenizing_aborts_the_request_once_accepted() -> None:
    async def main() -> None:
        m, router, sched, tok = manager()
        tok.hold = True
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="big", text="a" * OFFLOAD_BYTES)))
        await asyncio.get_running_loop().run_in_executor(None, tok.entered.wait, 10)
        # The client loop was not held: another request is handled meanwhile.
        await m.handle_client_frames(b"c", frame(AbortReq(rid="big")))
        assert router.sent[-1] == (b"c", ControlReply(rid="big", kind="abort", payload={"aborted": True}))
        tok.release.set()
        await asyncio.wait_for(asyncio.gather(*m.tasks), 10)
        tokenized = [x for x in sched.sent if isinstance(x, TokenizedGenerateReq)]
        assert len(tokenized) == 1 and sched.sent[-1] == SchedAbortReq(rid=tokenized[0].rid)
        last = router.sent[-1][1]
        assert isinstance(last, GenerateChunk) and last.finished and last.finish_reason["type"] == "abort"
        assert m.table.is_empty()

    asyncio.run(main())


def test_control_calls_per_client_are_limited() -> None:
    async def main() -> None:
        m, router, sched, _ = manager(max_controls_per_client=2)
        for i in range(3):
            await m.handle_client_frames(b"c", frame(ServerInfoReq(rid=str(i))))
        await m.handle_client_frames(b"other", frame(ServerInfoReq(rid="o")))
        assert sum(isinstance(x, SchedControlReq) for x in sched.sent) == 3
        errors = [msg for _, msg in router.sent if isinstance(msg, ErrorReply)]
        assert [(e.rid, e.code) for e in errors] == [("2", "too_many_requests")]
        assert "--max-controls-per-client" in errors[0].message

    asyncio.run(main())


def test_requests_per_client_are_limited_counting_samples() -> None:
    async def main() -> None:
        m, router, _, _ = manager(max_requests_per_client=3)
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="a", input_ids=[1], sampling_params={"n": 2})))
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="b", input_ids=[1], sampling_params={"n": 2})))
        await m.handle_client_frames(b"d", frame(GenerateReq(rid="b", input_ids=[1], sampling_params={"n": 2})))
        errors = [(who, msg.rid, msg.code) for who, msg in router.sent if isinstance(msg, ErrorReply)]
        assert errors == [(b"c", "b", "too_many_requests")]
        assert (m.table.samples_in_flight(b"c"), m.table.samples_in_flight(b"d")) == (2, 2)

    asyncio.run(main())


def test_a_client_that_does_not_read_loses_its_stream() -> None:
    async def main() -> None:
        m, router, sched, _ = manager()
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="s", input_ids=[1], stream=True)))
        internal = sched.sent[-1].rid
        router.busy.add(b"c")
        await m.outputs.handle_outputs([StrOutput(rid=internal, text_delta="x", new_output_ids=[1])])
        assert sched.sent[-1] == SchedAbortReq(rid=internal)
        assert m.stats["replies_dropped"] == 1 and m.table.is_empty()

    asyncio.run(main())


def test_a_steps_stream_chunks_reach_each_client_in_one_frame() -> None:
    """Three streams of client c, one of d and a non-stream request of c, all in one step's
    outputs: c gets its three chunks as one GenerateChunks frame (in output order), d its one
    chunk as a plain GenerateChunk; the non-stream request's reply waits for its end."""

    async def main() -> None:
        m, router, sched, _ = manager()
        for who, rid, stream in (
            (b"c", "s1", True),
            (b"c", "s2", True),
            (b"d", "t", True),
            (b"c", "s3", True),
            (b"c", "whole", False),
        ):
            await m.handle_client_frames(who, frame(GenerateReq(rid=rid, input_ids=[1], stream=stream)))
        internal = [x.rid for x in sched.sent if isinstance(x, TokenizedGenerateReq)]
        outs = [StrOutput(rid=r, text_delta=f"<{i}>", new_output_ids=[i]) for i, r in enumerate(internal)]
        outs[1] = StrOutput(
            rid=internal[1], text_delta="<1>", new_output_ids=[1], finished=True, finish_reason={"type": "length"}
        )
        await m.outputs.handle_outputs(outs)
        assert [who for who, _ in router.sent] == [b"c", b"d"]
        (_, batch), (_, single) = router.sent
        assert isinstance(batch, GenerateChunks) and isinstance(single, GenerateChunk)
        assert [(c.rid, c.text, c.finished) for c in batch.chunks] == [
            ("s1", "<0>", False),
            ("s2", "<1>", True),
            ("s3", "<3>", False),
        ]
        assert (single.rid, single.text) == ("t", "<2>")
        assert not m.table.contains(b"c", "s2") and m.table.contains(b"c", "whole")  # s2 finished; the rest run on
        router.busy.add(b"c")  # a client that stops reading loses every stream of the frame
        await m.outputs.handle_outputs(
            [
                StrOutput(rid=internal[0], text_delta="x", new_output_ids=[5]),
                StrOutput(rid=internal[3], text_delta="y", new_output_ids=[6]),
            ]
        )
        assert SchedAbortReq(rid=internal[0]) in sched.sent and SchedAbortReq(rid=internal[3]) in sched.sent
        assert not m.table.contains(b"c", "s1") and not m.table.contains(b"c", "s3") and m.table.contains(b"d", "t")

    asyncio.run(main())


def test_shutdown_answers_everything_in_flight_and_refuses_the_rest() -> None:
    async def main() -> None:
        m, router, sched, _ = manager()
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="g", input_ids=[1])))
        await m.handle_client_frames(b"d", frame(ServerInfoReq(rid="i")))
        internal = next(x.rid for x in sched.sent if isinstance(x, TokenizedGenerateReq))
        await m.shutdown()
        assert SchedAbortReq(rid=internal) in sched.sent
        await m.handle_client_frames(b"e", frame(GenerateReq(rid="late", input_ids=[1])))
        replies = {(who, msg.rid): msg.code for who, msg in router.sent if isinstance(msg, ErrorReply)}
        assert replies == {
            (b"c", "g"): "server_shutdown",
            (b"d", "i"): "server_shutdown",
            (b"e", "late"): "server_shutdown",
        }
        assert m.table.num_groups == 0 and not m.control.pending

    asyncio.run(main())


def test_abort_all_without_api_key_is_the_callers_own_with_it_everyones() -> None:
    async def main() -> None:
        for key, expected in ((None, {"mine"}), ("k", {"mine", "theirs"})):
            m, router, _, _ = manager(api_key=key)
            await m.handle_client_frames(b"me", frame(GenerateReq(rid="mine", input_ids=[1], api_key=key)))
            await m.handle_client_frames(b"you", frame(GenerateReq(rid="theirs", input_ids=[1], api_key=key)))
            await m.handle_client_frames(b"me", frame(AbortReq(rid="x", all=True, api_key=key)))
            aborted = {msg.rid for _, msg in router.sent if isinstance(msg, GenerateChunk)}
            assert aborted == expected, key
            assert router.sent[-1][1].payload == {"aborted": len(expected)}

    asyncio.run(main())


def test_deadline_is_absolute_monotonic_from_arrival_and_checked() -> None:
    import time

    async def main() -> None:
        m, router, sched, _ = manager(request_timeout=5.0)
        before = time.monotonic()
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="default", input_ids=[1])))
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="own", input_ids=[1], deadline_s=0.5)))
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="bad", input_ids=[1], deadline_s=0.0)))
        after = time.monotonic()
        default, own = [x for x in sched.sent if isinstance(x, TokenizedGenerateReq)]
        assert before + 5.0 <= default.deadline <= after + 5.0  # --request-timeout
        assert before + 0.5 <= own.deadline <= after + 0.5  # the request's own wins
        errors = [msg for _, msg in router.sent if isinstance(msg, ErrorReply)]
        assert [(e.rid, e.code) for e in errors] == [("bad", "invalid_request")] and "deadline_s" in errors[0].message
        m2, _, sched2, _ = manager()
        await m2.handle_client_frames(b"c", frame(GenerateReq(rid="none", input_ids=[1])))
        assert sched2.sent[0].deadline is None  # no flag, no field: no deadline

    asyncio.run(main())


def test_an_overloaded_sample_fails_its_request_once() -> None:
    from runtime.protocol.messages import SchedErrorOut

    async def main() -> None:
        m, router, sched, _ = manager()
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="a", input_ids=[1], sampling_params={"n": 2})))
        first, second = [x.rid for x in sched.sent if isinstance(x, TokenizedGenerateReq)]
        await m.outputs.handle_sched_error(SchedErrorOut(second, "overloaded", "the server is overloaded"))
        await m.outputs.handle_sched_error(SchedErrorOut(first, "overloaded", "the server is overloaded"))
        errors = [msg for _, msg in router.sent if isinstance(msg, ErrorReply)]
        assert [(e.rid, e.code) for e in errors] == [("a", "overloaded")]
        assert SchedAbortReq(rid=first) in sched.sent  # the other sample is moot
        assert m.stats["requests_refused_overloaded"] == 1
        assert m.table.is_empty()

    asyncio.run(main())


def test_token_ids_logprob_is_checked_and_gathered_into_the_whole_reply() -> None:
    """SGLang's token_ids_logprob: ids of the vocabulary, at most 1024, each refusal an invalid_request
    naming the field; with or without return_logprob the ids (and the prompt start) reach the
    scheduler, and a non-stream reply gathers output_token_ids_logprobs over its chunks and keeps the
    first chunk's input_token_ids_logprobs."""
    from tokenizer_proc.request_builder import MAX_TOKEN_IDS_LOGPROB, Rejected, RequestBuilder

    builder = RequestBuilder(Tokenizer(), LIMITS)
    too_many = list(range(50)) * (MAX_TOKEN_IDS_LOGPROB // 50 + 1)
    for bad, why in (
        ([3, 100], "token id 100 is outside the vocabulary [0, 100)"),
        ([-1], "token id -1 is outside"),
        ([1.5], "integers, got 1.5"),
        ([True], "integers, got True"),
        ("7", "must be a list"),
        (too_many, f"at most 1024 token ids, got {len(too_many)}"),
    ):
        try:
            builder.build(GenerateReq(rid="x", input_ids=[1], token_ids_logprob=bad))  # type: ignore[arg-type]
        except Rejected as exc:
            assert (exc.code, exc.param) == ("invalid_request", "token_ids_logprob")
            assert exc.message.startswith("token_ids_logprob: ") and why in exc.message, exc.message
        else:
            raise AssertionError(f"{bad!r} was accepted")
    (ok,) = builder.build(GenerateReq(rid="x", input_ids=[1, 2, 3], token_ids_logprob=[99, 0, 99], logprob_start_len=1))
    assert (ok.token_ids_logprob, ok.logprob_start_len, ok.return_logprob) == ([99, 0, 99], 1, False)
    (empty,) = builder.build(GenerateReq(rid="x", input_ids=[1], token_ids_logprob=[], logprob_start_len=0))
    assert empty.token_ids_logprob is None and empty.logprob_start_len == -1  # [] names none, as in SGLang
    assert len(builder.build(GenerateReq(rid="x", input_ids=[1], token_ids_logprob=too_many[:1024]))) == 1

    async def main() -> None:
        m, router, sched, _ = manager()
        await m.handle_client_frames(b"c", frame(GenerateReq(rid="bad", input_ids=[1], token_ids_logprob=[100])))
        await m.handle_client_frames(
            b"c", frame(GenerateReq(rid="whole", input_ids=[1, 2], token_ids_logprob=[4, 2], logprob_start_len=0))
        )
        errors = [msg for _, msg in router.sent if isinstance(msg, ErrorReply)]
        assert [(e.rid, e.code) for e in errors] == [("bad", "invalid_request")]
        assert "token_ids_logprob" in errors[0].message
        (internal,) = [x.rid for x in sched.sent if isinstance(x, TokenizedGenerateReq)]
        prompt = [None, [[-0.5, 4], [-1.5, 2]]]
        steps = [[[-1.0, 4], [-2.0, 2]]], [[[-3.0, 4], [-0.25, 2]], [[-4.0, 4], [-0.5, 2]]]
        first = ChunkMeta(output_token_ids_logprobs=steps[0], input_token_ids_logprobs=prompt)
        await m.outputs.handle_outputs([StrOutput(rid=internal, text_delta="a", new_output_ids=[5], meta=first)])
        last = StrOutput(
            rid=internal,
            text_delta="bc",
            new_output_ids=[6, 7],
            finished=True,
            finish_reason={"type": "length"},
            meta=ChunkMeta(output_token_ids_logprobs=steps[1]),
        )
        await m.outputs.handle_outputs([last])
        replies = [msg for _, msg in router.sent if isinstance(msg, GenerateChunk)]
        assert len(replies) == 1 and replies[0].output_ids == [5, 6, 7]
        assert replies[0].meta.output_token_ids_logprobs == steps[0] + steps[1]
        assert replies[0].meta.input_token_ids_logprobs == prompt
        assert m.table.is_empty()

    asyncio.run(main())
