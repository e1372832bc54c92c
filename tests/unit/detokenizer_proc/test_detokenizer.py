"""Detokenizer: incremental decoding never emits a partial UTF-8 character, stream and
non-stream give the same text, stop strings never leak, per-request state is freed.

Uses the real byte-level BPE tokenizer of the tiny Llama test checkpoint: every
non-ASCII character below spans several tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from detokenizer_proc.detokenizer_manager import DetokenizerManager
from runtime.protocol.messages import BatchStrOut, BatchTokenIDOut, ReqOutput, SchedControlOut, SchedErrorOut
from runtime.text.tokenizer import load_tokenizer

TEXT = "héllo wörld 世界 🙂 ok, ünïcödé everywhere: 日本語のテキスト and more 🚀🚀 done"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path) -> Any:
    return load_tokenizer(str(tiny_llama_path))


def out(
    rid: str, ids: list[int], finished: bool = False, finish_reason: dict[str, Any] | None = None, **kw: Any
) -> BatchTokenIDOut:
    return BatchTokenIDOut(
        outputs=[
            ReqOutput(
                rid=rid,
                new_output_ids=ids,
                finished=finished,
                finish_reason=finish_reason,
                completion_tokens=len(ids),
                **kw,
            )
        ]
    )


def stream(
    manager: DetokenizerManager,
    rid: str,
    ids: list[int],
    sizes: list[int],
    finish_reason: dict[str, Any] | None = None,
    **kw: Any,
) -> list[str]:
    """Feed ``ids`` in pieces of ``sizes``; the last piece finishes the request."""
    deltas, pos = [], 0
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        piece = ids[pos:] if last else ids[pos : pos + size]
        pos += size
        res = manager.handle(
            out(
                rid,
                piece,
                finished=last,
                finish_reason=(finish_reason or {"type": "length", "length": len(ids)}) if last else None,
                **kw,
            )
        )
        assert isinstance(res, BatchStrOut)
        deltas.append(res.outputs[0].text_delta)
    return deltas


def test_token_by_token_never_emits_a_partial_character(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 2  # many multi-token characters
    m = DetokenizerManager(tokenizer)
    deltas = stream(m, "r", ids, [1] * len(ids))
    assert "".join(deltas) == TEXT
    for d in deltas:
        assert "\ufffd" not in d
    assert m.states == {}  # freed at finish


@pytest.mark.parametrize("seed", range(5))
def test_any_split_gives_the_non_stream_text(tokenizer: Any, seed: int) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    rng = random.Random(seed)
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(rng.randint(1, 4))
    m = DetokenizerManager(tokenizer)
    streamed = stream(m, "s", ids, sizes)
    whole = stream(m, "w", ids, [len(ids)])  # non-stream: one message at finish
    assert "".join(streamed) == whole[0] == TEXT
    assert all("\ufffd" not in d for d in streamed)


def test_invalid_bytes_from_a_model_are_kept_consistently(tokenizer: Any) -> None:
    """A random model can emit bytes that are not UTF-8: the stream shows the same
    replacement characters as the final text, never a partial one that changes later."""
    rng = random.Random(0)
    ids = [rng.randrange(3, len(tokenizer)) for _ in range(200)]
    m = DetokenizerManager(tokenizer)
    streamed = stream(m, "x", ids, [1] * len(ids))
    assert "".join(streamed) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("first_output_only", [False, True], ids=["every-output", "first-output-only"])
def test_stop_string_never_leaks_while_streaming(tokenizer: Any, first_output_only: bool) -> None:
    """Also when the stop strings come with the request's first output only (the scheduler
    need not resend them with every chunk)."""
    stop = "wörld 世"
    full = tokenizer.encode(TEXT, add_special_tokens=False)
    # the scheduler finishes at the first token whose text completes the stop string
    end = next(i for i in range(1, len(full) + 1) if stop in tokenizer.decode(full[:i]))
    ids = full[:end]
    expected = TEXT[: TEXT.index(stop)]
    m = DetokenizerManager(tokenizer)
    emitted = ""
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        stops = [stop, "never"] if i == 0 or not first_output_only else None
        res = m.handle(
            out(
                "r",
                [tid],
                finished=last,
                stop_strs=stops,
                finish_reason={"type": "stop", "matched": stop} if last else None,
            )
        )
        emitted += res.outputs[0].text_delta
        assert expected.startswith(emitted), emitted  # nothing of the stop string, ever
    assert emitted == expected
    assert "\ufffd" not in emitted


def test_no_stop_trim_keeps_the_stop_string(tokenizer: Any) -> None:
    stop = "ok,"
    full = tokenizer.encode(TEXT, add_special_tokens=False)
    end = next(i for i in range(1, len(full) + 1) if stop in tokenizer.decode(full[:i]))
    m = DetokenizerManager(tokenizer)
    deltas = stream(
        m,
        "r",
        full[:end],
        [1] * end,
        finish_reason={"type": "stop", "matched": stop},
        stop_strs=[stop],
        no_stop_trim=True,
    )
    assert "".join(deltas) == tokenizer.decode(full[:end])
    assert "".join(deltas).endswith(stop)


def test_matched_stop_token_is_not_in_the_text(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    stop_id = ids[-1]
    m = DetokenizerManager(tokenizer)
    res = m.handle(out("r", ids, finished=True, finish_reason={"type": "stop", "matched": stop_id}))
    assert res.outputs[0].text_delta == tokenizer.decode(ids[:-1])
    assert res.outputs[0].new_output_ids == ids  # the ids are reported as generated
    res = m.handle(out("k", ids, finished=True, finish_reason={"type": "stop", "matched": stop_id}, no_stop_trim=True))
    assert res.outputs[0].text_delta == "hello world"


def test_special_tokens_follow_skip_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    m = DetokenizerManager(tokenizer)
    assert m.handle(out("a", ids, finished=True)).outputs[0].text_delta == "hi"
    kept = m.handle(out("b", ids, finished=True, skip_special_tokens=False)).outputs[0].text_delta
    assert kept == "hi" + tokenizer.eos_token


def test_meta_and_logprobs_are_passed_on(tokenizer: Any) -> None:
    m = DetokenizerManager(tokenizer)
    res = m.handle(
        BatchTokenIDOut(
            outputs=[
                ReqOutput(
                    rid="r",
                    new_output_ids=[70, 71],
                    finished=True,
                    finish_reason={"type": "length", "length": 2},
                    prompt_tokens=9,
                    completion_tokens=2,
                    cached_tokens=4,
                    output_logprobs=[-0.1, -0.2],
                    output_top_logprobs=[[[-0.1, 70.0]], [[-0.2, 71.0]]],
                )
            ]
        )
    )
    o = res.outputs[0]
    assert o.finished and o.finish_reason == {"type": "length", "length": 2}
    assert (
        o.meta.as_dict()["prompt_tokens"] == 9
        and o.meta.as_dict()["completion_tokens"] == 2
        and o.meta.as_dict()["cached_tokens"] == 4
    )
    assert o.meta.as_dict()["output_token_logprobs"] == [[-0.1, 70], [-0.2, 71]]
    assert o.meta.as_dict()["output_top_logprobs"] == [[[-0.1, 70.0]], [[-0.2, 71.0]]]
    assert "input_token_logprobs" not in o.meta.as_dict() and "input_top_logprobs" not in o.meta.as_dict()


def test_prompt_logprobs_survive_the_message_round_trip(tokenizer: Any) -> None:
    """A request's first output carries its prompt logprobs (None for token 0) through msgpack."""
    import msgspec

    sent = BatchTokenIDOut(
        outputs=[
            ReqOutput(
                rid="r",
                new_output_ids=[],
                finished=True,
                finish_reason={"type": "length", "length": 0},
                input_token_logprobs=[[None, 5], [-1.5, 6]],
                input_top_logprobs=[None, [[-0.5, 9.0], [-1.5, 6.0]]],
            )
        ]
    )
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=BatchTokenIDOut)
    o = DetokenizerManager(tokenizer).handle(received).outputs[0]
    assert o.meta.as_dict()["input_token_logprobs"] == [[None, 5], [-1.5, 6]]
    assert o.meta.as_dict()["input_top_logprobs"] == [None, [[-0.5, 9.0], [-1.5, 6.0]]]
    assert o.new_output_ids == [] and o.text_delta == ""


def test_token_ids_logprobs_pass_on_and_every_token_id_stays_an_int(tokenizer: Any) -> None:
    """SGLang's token_ids_logprob (output and prompt positions) reach the meta under SGLang's names, and
    the ids of every [logprob, id] pair, top logprobs' too, are still ints after the typed msgpack
    decoder (a JSON client would otherwise see ``70.0``)."""
    import msgspec

    sent = BatchTokenIDOut(
        outputs=[
            ReqOutput(
                rid="r",
                new_output_ids=[70, 71],
                output_top_logprobs=[[[-0.1, 70]], [[-0.2, 71]]],
                output_token_ids_logprobs=[[[-3.0, 9], [-0.0, 4]], [[-2.5, 9], [-1.0, 4]]],
                input_token_logprobs=[[None, 5], [-1.5, 6]],
                input_top_logprobs=[None, [[-0.5, 9], [-1.5, 6]]],
                input_token_ids_logprobs=[None, [[-4.0, 9], [-2.0, 4]]],
            )
        ]
    )
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=BatchTokenIDOut)
    meta = DetokenizerManager(tokenizer).handle(received).outputs[0].meta.as_dict()
    assert meta["output_token_ids_logprobs"] == [[[-3.0, 9], [-0.0, 4]], [[-2.5, 9], [-1.0, 4]]]
    assert meta["input_token_ids_logprobs"] == [None, [[-4.0, 9], [-2.0, 4]]]
    pairs = [
        pair
        for key in (
            "output_top_logprobs",
            "input_top_logprobs",
            "output_token_ids_logprobs",
            "input_token_ids_logprobs",
        )
        for row in meta[key]
        for pair in row or ()
    ]
    assert len(pairs) == 10
    assert all(type(t) is int and type(lp) is float for lp, t in pairs), pairs
    plain = DetokenizerManager(tokenizer).handle(out("p", [70])).outputs[0].meta.as_dict()
    assert "output_token_ids_logprobs" not in plain and "input_token_ids_logprobs" not in plain


def test_an_embedding_passes_through_as_its_fp32_vector(tokenizer: Any) -> None:
    """An embedding request's one output (no tokens) reaches the meta with its vector exactly as the
    scheduler sent it, through the typed msgpack decoder both ways; no text, no state kept."""
    import msgspec

    vector = [0.25, -1.5, 3.0e-8, 0.0]
    sent = BatchTokenIDOut(
        outputs=[
            ReqOutput(
                rid="e",
                new_output_ids=[],
                finished=True,
                finish_reason={"type": "stop", "matched": None},
                prompt_tokens=7,
                embedding=vector,
            )
        ]
    )
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=BatchTokenIDOut)
    m = DetokenizerManager(tokenizer)
    out_msg = m.handle(received)
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(out_msg), type=BatchStrOut).outputs[0]
    assert again.meta.embedding == vector and again.meta.prompt_tokens == 7
    assert again.text_delta == "" and again.new_output_ids == [] and again.finished
    assert m.states == {}
    plain = m.handle(out("p", [70])).outputs[0].meta
    assert plain.embedding is None and "embedding" not in plain.as_dict()


def test_errors_free_state_and_control_passes_through(tokenizer: Any) -> None:
    m = DetokenizerManager(tokenizer)
    m.handle(out("r", tokenizer.encode("héllo", add_special_tokens=False)[:2]))
    assert "r" in m.states
    err = SchedErrorOut(rid="r", code="internal", message="boom")
    assert m.handle(err) is err
    assert m.states == {}
    ctl = SchedControlOut(rid="c", kind="server_info", payload={"num_running": 0})
    assert m.handle(ctl) is ctl


def test_many_requests_in_one_batch_keep_separate_state(tokenizer: Any) -> None:
    texts = ["日本語", "héllo", "🙂🙂", "plain"]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    m = DetokenizerManager(tokenizer)
    got = {str(i): "" for i in range(len(texts))}
    for step in range(max(map(len, ids))):
        outputs = []
        for i, seq in enumerate(ids):
            if step < len(seq):
                last = step == len(seq) - 1
                outputs.append(
                    ReqOutput(
                        rid=str(i),
                        new_output_ids=[seq[step]],
                        finished=last,
                        finish_reason={"type": "length", "length": len(seq)} if last else None,
                    )
                )
        for o in m.handle(BatchTokenIDOut(outputs=outputs)).outputs:
            got[o.rid] += o.text_delta
    assert [got[str(i)] for i in range(len(texts))] == texts
    assert m.states == {}
