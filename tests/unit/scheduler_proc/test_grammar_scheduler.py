"""Constrained requests through an in-process Scheduler on the tiny real model (CPU, fp32).

The tiny model is random, so what it writes is nonsense, but every constrained output must
still match its grammar (decoded with the tokenizer, special tokens skipped), free requests
must not notice constrained ones, a slow grammar must delay only its own request, and the
memory invariant must hold whatever happened (timeouts, aborts, retractions, jump-forward).
Every test runs with the inline worker and with the overlap worker.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest
import torch

from runtime.config.args import ServerArgs
from runtime.protocol.messages import BatchTokenIDOut, SchedAbortReq, SchedErrorOut, TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from runtime.text.grammar.backend import GrammarBackend
from scheduler_proc import grammar_queue
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_scheduler import assert_idle_invariant

# Generous: a loop waiting for a compile steps an empty scheduler as fast as it can meanwhile.
STEP_TIMEOUT_S = 120.0

EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
WORDS = r"[a-z ]+"  # never forces anything, never completes before max_new_tokens on the tiny model
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "city", "age", "ok"],
}
TAGS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[^0-9]{1,10}$"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
            "minItems": 2,
            "maxItems": 4,
        },
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "age"],
}
# Strings are bounded by ``pattern``, not ``maxLength``: xgrammar 0.2.8 compiles a length-bounded
# string to a class that admits raw control characters (invalid JSON), see
# tests/unit/runtime/text/grammar/test_grammar.py::test_length_bounded_json_string_refuses_control_characters.
PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "Once upon a time",
    "Give me some JSON",
    "numbers 1 2 3",
    "lazy dog jumps",
    "A B C D",
    "over the hills",
    "tiny models talk",
    "far away",
    "say it",
    "end",
]


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "overlap"])
def overlap(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model's forwards are too small to share, and on a loaded
    2-core machine the OpenMP team of two spins against the other processes (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path) -> Any:
    from runtime.text.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_llama_path))


class Harness:
    """Builds schedulers on the tiny model, submits requests, collects what they produce."""

    def __init__(self, path: Path, tokenizer: Any, overlap: bool) -> None:
        self.path, self.tokenizer, self.overlap = path, tokenizer, overlap
        self.made: list[Scheduler] = []

    def scheduler(self, max_total_tokens: int = 4096, **overrides: Any) -> Scheduler:
        args = ServerArgs(
            model_path=str(self.path),
            device="cpu",
            dtype="float32",
            max_total_tokens=max_total_tokens,
            disable_overlap_schedule=not self.overlap,
            **overrides,
        )
        sched = Scheduler(args)
        assert sched.worker.overlap == self.overlap
        self.made.append(sched)
        return sched

    def submit(
        self, sched: Scheduler, rid: str, prompt: str, return_logprob: bool = False, stream: bool = False, **params: Any
    ) -> None:
        params.setdefault("temperature", 0.0)
        sched.handle_message(
            TokenizedGenerateReq(
                rid=rid,
                input_ids=self.tokenizer.encode(prompt),
                sampling_params=SamplingParams.from_dict(params),
                return_logprob=return_logprob,
                stream=stream,
            )
        )

    @staticmethod
    def collect(sched: Scheduler, results: dict[str, dict[str, Any]]) -> None:
        for msg in sched.take_outbox():
            if isinstance(msg, SchedErrorOut):
                assert msg.rid not in results, f"{msg.rid}: an error after output"
                results[msg.rid] = {"error": msg.code, "message": msg.message, "finished": True}
                continue
            assert isinstance(msg, BatchTokenIDOut)
            for out in msg.outputs:
                entry = results.setdefault(out.rid, {"ids": [], "finished": False, "logprobs": []})
                assert not entry["finished"], f"{out.rid}: output after its last chunk"
                entry["ids"].extend(out.new_output_ids)
                entry["chunks"] = entry.get("chunks", 0) + 1
                entry["logprobs"].extend(out.output_logprobs or [])
                entry["finished"] = out.finished
                entry["reason"] = out.finish_reason

    def run(
        self, sched: Scheduler, results: dict[str, dict[str, Any]] | None = None, timeout_s: float = STEP_TIMEOUT_S
    ) -> dict[str, dict[str, Any]]:
        """Step until idle (a compile still running on a grammar thread keeps it busy; the steps
        meanwhile are empty and quick, so the bound is time, not a step count)."""
        results = {} if results is None else results
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sched.step()
            self.collect(sched, results)
            if sched.is_idle():
                return results
        raise AssertionError("scheduler did not go idle")

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        for sched in self.made:
            sched.grammars.close()
            sched.worker.close()


@pytest.fixture
def h(tiny_llama_path: Path, tokenizer: Any, overlap: bool) -> Iterator[Harness]:
    harness = Harness(tiny_llama_path, tokenizer, overlap)
    yield harness
    harness.close()


Gate = tuple[set[str], threading.Event, threading.Event]


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    """``(blocked_texts, started, release)``: a compile of a constraint whose text is in
    ``blocked_texts`` sets ``started`` and then blocks its compile thread until ``release``."""
    blocked: set[str] = set()
    started, release = threading.Event(), threading.Event()
    compile_ = GrammarBackend.compile

    def compile(self: GrammarBackend, kind: str, text: str) -> Any:
        if text in blocked:
            started.set()
            assert release.wait(60), "the test never released the blocked compile"
        return compile_(self, kind, text)

    monkeypatch.setattr(GrammarBackend, "compile", compile)
    yield blocked, started, release
    release.set()  # never leave a compile thread blocked


def start_blocked_email(h: Harness, gate: Gate, rid: str, **overrides: Any) -> Scheduler:
    """A scheduler (``overrides``: its flags) whose first request, ``rid`` (PROMPTS[0], regex EMAIL),
    waits for its compile until the gate's ``release``."""
    blocked, _, _ = gate
    blocked.add(EMAIL)
    sched = h.scheduler(**overrides)
    h.submit(sched, rid, PROMPTS[0], max_new_tokens=64, regex=EMAIL)
    return sched


def assert_email(h: Harness, result: dict[str, Any]) -> str:
    text = h.text(result["ids"])
    assert result["finished"] and result["reason"]["type"] == "stop", result
    assert re.fullmatch(EMAIL, text), text
    return text


def assert_schema(h: Harness, result: dict[str, Any], schema: dict[str, Any]) -> Any:
    text = h.text(result["ids"])
    assert result["finished"] and result["reason"]["type"] == "stop", result
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def assert_clean(sched: Scheduler) -> None:
    assert sched.is_idle()
    assert len(sched.grammars) == 0 and sched.queues.is_empty() and sched.inflight is None
    assert_idle_invariant(sched)


# ---- outputs match their grammar ------------------------------------------------------


def test_regex_and_json_schema_outputs_match(h: Harness) -> None:
    sched = h.scheduler()
    h.submit(sched, "email", PROMPTS[0], max_new_tokens=64, regex=EMAIL)
    h.submit(sched, "person", PROMPTS[1], max_new_tokens=96, json_schema=PERSON)
    h.submit(sched, "tags", PROMPTS[2], max_new_tokens=128, json_schema=json.dumps(TAGS))
    h.submit(sched, "yesno", PROMPTS[3], max_new_tokens=16, ebnf='root ::= ("yes" | "no") " " [0-9]')
    results = h.run(sched)
    assert_email(h, results["email"])
    assert_schema(h, results["person"], PERSON)
    assert_schema(h, results["tags"], TAGS)
    assert re.fullmatch(r"(yes|no) [0-9]", h.text(results["yesno"]["ids"]))
    assert results["yesno"]["reason"]["type"] == "stop"
    # The stop token that completed each grammar is the last output token (skipped in the text).
    eos = h.tokenizer.eos_token_id
    for rid in ("email", "person", "tags", "yesno"):
        assert results[rid]["ids"][-1] == eos and results[rid]["reason"]["matched"] == eos
        assert eos not in results[rid]["ids"][:-1]
    assert sched.grammars.stats.constrained_requests == 4 and sched.grammars.stats.grammar_compiles == 4
    assert_clean(sched)


def test_length_limit_before_the_grammar_completes(h: Harness) -> None:
    sched = h.scheduler()
    h.submit(sched, "short", PROMPTS[0], max_new_tokens=3, json_schema=PERSON)
    h.submit(sched, "words", PROMPTS[1], max_new_tokens=20, regex=WORDS)
    results = h.run(sched)
    for rid, limit in (("short", 3), ("words", 20)):
        assert results[rid]["reason"] == {"type": "length", "length": limit}
        assert len(results[rid]["ids"]) == limit
    assert re.fullmatch(WORDS, h.text(results["words"]["ids"]))
    assert '{"name": "'.startswith(h.text(results["short"]["ids"])) or h.text(results["short"]["ids"]).startswith(
        '{"name": "'
    )
    assert_clean(sched)


def test_min_new_tokens_beyond_a_complete_grammar(h: Harness) -> None:
    """min_new_tokens longer than anything the grammar allows: the request ends with stop when its
    grammar is complete (not with an abort on a token the grammar refuses); min_new_tokens still
    holds while the grammar allows going on."""
    sched = h.scheduler()
    h.submit(sched, "short", PROMPTS[0], max_new_tokens=16, min_new_tokens=8, regex="yes|no")
    h.submit(sched, "sampled", PROMPTS[1], max_new_tokens=16, min_new_tokens=8, regex="yes|no", temperature=1.0, seed=3)
    h.submit(sched, "open", PROMPTS[2], max_new_tokens=12, min_new_tokens=10, regex=r"[a-z]+")
    results = h.run(sched)
    eos = h.tokenizer.eos_token_id
    for rid in ("short", "sampled"):
        assert results[rid]["reason"] == {"type": "stop", "matched": eos}, results[rid]
        assert h.text(results[rid]["ids"]) in ("yes", "no") and results[rid]["ids"][-1] == eos
    assert len(results["open"]["ids"]) >= 10 and eos not in results["open"]["ids"][:10]
    assert re.fullmatch(r"[a-z]+", h.text(results["open"]["ids"]))
    assert_clean(sched)


def test_complete_grammar_ends_an_ignore_eos_request(h: Harness) -> None:
    """ignore_eos does not let a request go on past the end of its grammar: the stop token the
    grammar took ends it with stop."""
    sched = h.scheduler()
    h.submit(sched, "email", PROMPTS[0], max_new_tokens=64, ignore_eos=True, regex=EMAIL)
    h.submit(sched, "person", PROMPTS[1], max_new_tokens=96, ignore_eos=True, json_schema=PERSON)
    results = h.run(sched)
    assert_email(h, results["email"])
    assert_schema(h, results["person"], PERSON)
    assert_clean(sched)


# ---- free requests do not notice constrained ones -------------------------------------------


def test_free_requests_unchanged_by_constrained_neighbours(h: Harness) -> None:
    alone = h.scheduler()
    for i in range(3):
        h.submit(alone, f"free{i}", PROMPTS[4 + i], max_new_tokens=16)
    want = h.run(alone)
    assert_clean(alone)

    mixed = h.scheduler()
    h.submit(mixed, "email", PROMPTS[0], max_new_tokens=64, regex=EMAIL)
    for i in range(3):
        h.submit(mixed, f"free{i}", PROMPTS[4 + i], max_new_tokens=16)
    h.submit(mixed, "person", PROMPTS[1], max_new_tokens=96, json_schema=PERSON)
    got = h.run(mixed)
    for i in range(3):
        assert got[f"free{i}"]["ids"] == want[f"free{i}"]["ids"], f"free{i}"
        assert got[f"free{i}"]["reason"] == {"type": "length", "length": 16}
    assert_email(h, got["email"])
    assert_schema(h, got["person"], PERSON)
    assert mixed.stats["num_decode_batches"] > 0
    assert_clean(mixed)


# ---- a slow compile delays only its own request -----------------------------------------------


def test_slow_compile_delays_only_its_request(h: Harness, gate: Gate) -> None:
    _, started, release = gate
    sched = start_blocked_email(h, gate, "slow")
    for i in range(3):
        h.submit(sched, f"free{i}", PROMPTS[4 + i], max_new_tokens=12)
    assert started.wait(30), "the compile never started"
    results: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not all(results.get(f"free{i}", {}).get("finished") for i in range(3)):
        sched.step()
        h.collect(sched, results)
        assert time.monotonic() < deadline, "timed out"
    for i in range(3):
        assert results[f"free{i}"]["reason"] == {"type": "length", "length": 12}
    # The constrained one is still waiting for its grammar, holding nothing, sending nothing.
    assert "slow" not in results
    assert len(sched.grammars) == 1 and sched.queues.is_empty()
    assert not sched.is_idle()
    assert sched.receive_timeout_ms() == 1  # the loop polls the grammar, it does not block for 1 s
    assert sched.check_memory().ok
    release.set()
    h.run(sched, results)
    assert_email(h, results["slow"])
    assert_clean(sched)


def test_slow_compile_does_not_delay_other_constrained_requests(h: Harness, gate: Gate) -> None:
    """Compiles run on several threads: another grammar compiles and its request finishes while
    the slow one is still compiling; a request for the slow grammar itself shares its compile."""
    _, started, release = gate
    sched = start_blocked_email(h, gate, "slow")
    assert started.wait(30), "the compile never started"
    h.submit(sched, "slow-twin", PROMPTS[1], max_new_tokens=64, regex=EMAIL)
    h.submit(sched, "person", PROMPTS[2], max_new_tokens=96, json_schema=PERSON)
    results: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not results.get("person", {}).get("finished"):
        sched.step()
        h.collect(sched, results)
        assert time.monotonic() < deadline, "timed out"
    assert_schema(h, results["person"], PERSON)
    assert "slow" not in results and "slow-twin" not in results and len(sched.grammars) == 2
    release.set()
    h.run(sched, results)
    assert_email(h, results["slow"]) and assert_email(h, results["slow-twin"])
    stats = sched.grammars.stats
    assert stats.grammar_compiles == 2 and stats.grammar_cache_hits == 1  # the twin shared the slow compile
    assert_clean(sched)


@pytest.mark.parametrize("overlap", [True], ids=["overlap"])  # only overlap keeps a step in flight between steps
def test_grammar_ready_while_a_step_is_in_flight_mixed_chunk(h: Harness, gate: Gate) -> None:
    """With --enable-mixed-chunk, a step may be planned ahead only while nothing waits (a mixed
    batch's decode part takes host inputs). A grammar that becomes ready while a decode step is in
    flight puts its request in the waiting queue: the scheduler must see it before deciding to plan
    ahead, not build a mixed batch over a request whose token is still in flight."""
    assert h.overlap
    _, started, release = gate
    sched = start_blocked_email(h, gate, "email", enable_mixed_chunk=True)
    h.submit(sched, "free", PROMPTS[1], max_new_tokens=24)
    assert started.wait(30)
    results: dict[str, dict[str, Any]] = {}
    for _ in range(4):  # the free request prefills, then decodes with a step in flight after each step
        sched.step()
        h.collect(sched, results)
    assert sched.inflight is not None and [r.rid for r in sched.queues.running] == ["free"]
    release.set()
    for waiting in sched.grammars._waiting:  # the compile is done: the next poll finds it ready
        waiting.compiled.result(timeout=30)
    h.run(sched, results)
    assert_email(h, results["email"])
    assert results["free"]["reason"] == {"type": "length", "length": 24}
    assert sched.stats["num_mixed_batches"] > 0
    assert_clean(sched)


# ---- compile timeout ----------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_compile_timeout_fails_only_that_request(h: Harness, gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked, started, release = gate
    blocked.add(EMAIL)
    clock = FakeClock()
    monkeypatch.setattr(grammar_queue, "time", clock)
    sched = h.scheduler(grammar_compile_timeout=5.0)
    h.submit(sched, "slow", PROMPTS[0], max_new_tokens=64, regex=EMAIL)
    assert started.wait(30)
    results: dict[str, dict[str, Any]] = {}
    for _ in range(5):
        sched.step()
    clock.now += 4.9
    for _ in range(5):
        sched.step()
    h.collect(sched, results)
    assert results == {} and len(sched.grammars) == 1  # not yet
    clock.now += 0.2
    sched.step()
    h.collect(sched, results)
    assert results["slow"]["error"] == "invalid_request"
    message = results["slow"]["message"]
    assert message.startswith("regex: ") and "did not compile within 5 s" in message
    assert "--grammar-compile-timeout" in message
    assert len(sched.grammars) == 0 and sched.is_idle()
    assert_idle_invariant(sched)
    # The scheduler goes on serving, free and constrained requests (the timed-out compile still runs).
    h.submit(sched, "next", PROMPTS[1], max_new_tokens=8)
    h.run(sched, results)
    assert results["next"]["reason"] == {"type": "length", "length": 8}
    release.set()
    h.submit(sched, "after", PROMPTS[2], max_new_tokens=96, json_schema=PERSON)
    h.run(sched, results)
    assert_schema(h, results["after"], PERSON)
    assert "slow" in results and results["slow"].get("ids") is None  # nothing sent after the error
    assert_clean(sched)


def test_invalid_grammar_at_compile_fails_with_reason(h: Harness) -> None:
    """A constraint that reaches the scheduler unchecked and does not compile ends with the
    compile's reason (invalid_request); the others in the same batch are served."""
    sched = h.scheduler()
    bad = SamplingParams(max_new_tokens=8, temperature=0.0)
    bad.regex = "[a-z"  # bypasses from_dict/validate, as a request that skipped the tokenizer's check
    sched.handle_message(TokenizedGenerateReq(rid="bad", input_ids=h.tokenizer.encode(PROMPTS[0]), sampling_params=bad))
    h.submit(sched, "good", PROMPTS[1], max_new_tokens=64, regex=EMAIL)
    results = h.run(sched)
    assert results["bad"]["error"] == "invalid_request"
    assert results["bad"]["message"].startswith("regex: invalid regular expression: ")
    assert_email(h, results["good"])
    assert_clean(sched)


# ---- aborts ---------------------------------------------------------------------------------------


def test_abort_while_waiting_for_grammar(h: Harness, gate: Gate) -> None:
    _, started, release = gate
    sched = start_blocked_email(h, gate, "waiting")
    h.submit(sched, "also", PROMPTS[1], max_new_tokens=64, regex=EMAIL)  # shares its compile
    h.submit(sched, "free", PROMPTS[2], max_new_tokens=6)
    assert started.wait(30)
    sched.step()
    sched.handle_message(SchedAbortReq(rid="waiting"))
    results: dict[str, dict[str, Any]] = {}
    h.collect(sched, results)
    assert results["waiting"]["finished"] and results["waiting"]["reason"]["type"] == "abort"
    assert results["waiting"]["ids"] == []
    assert len(sched.grammars) == 1
    sched.handle_message(SchedAbortReq(rid=""))  # abort all: the other waiting one and the free one
    h.collect(sched, results)
    assert results["also"]["reason"]["type"] == "abort" and len(sched.grammars) == 0
    h.run(sched, results)
    assert results["free"]["reason"]["type"] == "abort"
    assert sched.stats["num_aborted"] == 3
    release.set()
    # The compiles finish on their threads with nobody waiting for them; nothing changes.
    h.submit(sched, "later", PROMPTS[3], max_new_tokens=64, regex=EMAIL)
    h.run(sched, results)
    assert_email(h, results["later"])
    assert_clean(sched)


def generated(sched: Scheduler, rid: str) -> int:
    """Output tokens of ``rid`` so far, while it is in the scheduler's queues (0 before it is)."""
    found = [r for r in [*sched.queues.waiting, *sched.queues.holders()] if r.rid == rid]
    return len(found[0].output_ids) if found else 0


def test_abort_mid_decode(h: Harness) -> None:
    sched = h.scheduler()
    h.submit(sched, "long", PROMPTS[0], max_new_tokens=200, regex=WORDS)
    h.submit(sched, "json", PROMPTS[1], max_new_tokens=200, json_schema=TAGS)
    h.submit(sched, "free", PROMPTS[2], max_new_tokens=30)
    results: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while min(generated(sched, "long"), generated(sched, "json")) < 5:
        sched.step()
        h.collect(sched, results)
        assert time.monotonic() < deadline, "timed out"
    assert "long" not in results and "json" not in results  # not streamed: nothing sent before the end
    sched.handle_message(SchedAbortReq(rid="long"))
    sched.handle_message(SchedAbortReq(rid="json"))
    h.run(sched, results)
    for rid in ("long", "json"):
        assert results[rid]["finished"] and results[rid]["reason"]["type"] == "abort", rid
        assert 0 < len(results[rid]["ids"]) < 200
    assert re.fullmatch(WORDS, h.text(results["long"]["ids"]))
    assert results["free"]["reason"] == {"type": "length", "length": 30}
    assert sched.stats["num_aborted"] == 2
    assert_clean(sched)


# ---- retraction -------------------------------------------------------------------------------


@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump-forward", "no-jump-forward"])
def test_retraction_keeps_outputs(h: Harness, jump_forward: bool) -> None:
    """12 constrained requests of 48 tokens in a 200-token pool: decode must retract, and every
    request ends exactly as with room to spare (its matcher keeps its state across the retraction).
    With jump-forward on, only regexes that force nothing: a jump gives the request's row back
    and re-admits it with its whole budget reserved, which is itself a release valve."""

    def submit_all(sched: Scheduler) -> None:
        for i, prompt in enumerate(PROMPTS):
            if i % 3 == 0 and not jump_forward:
                h.submit(sched, f"r{i}", prompt, max_new_tokens=48, json_schema=TAGS)
            else:
                h.submit(sched, f"r{i}", prompt, max_new_tokens=48, regex=WORDS if i % 2 else r"[a-z]+( [a-z]+)*")

    flags = {} if jump_forward else {"disable_jump_forward": True}
    roomy = h.scheduler(**flags)
    submit_all(roomy)
    want = h.run(roomy)
    assert roomy.stats["num_retractions"] == 0
    tight = h.scheduler(max_total_tokens=200, **flags)
    submit_all(tight)
    got = h.run(tight)
    assert tight.stats["num_retractions"] > 0 and tight.stats["num_retracted_reqs"] > 0
    for rid in want:
        assert got[rid]["ids"] == want[rid]["ids"], rid
        assert got[rid]["reason"] == want[rid]["reason"], rid
        text = h.text(got[rid]["ids"])
        if rid in ("r0", "r3", "r6", "r9") and not jump_forward:
            if got[rid]["reason"]["type"] == "stop":
                jsonschema.validate(json.loads(text), TAGS)
            else:
                assert len(got[rid]["ids"]) == 48
        else:
            assert re.fullmatch(WORDS, text), (rid, text)
    assert_clean(roomy)
    assert_clean(tight)


# ---- jump-forward ---------------------------------------------------------------------------------

FIXED_KEYS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "country": {"type": "string", "enum": ["France", "Japan", "Peru"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 9999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population", "capital"],
}
JUMP_TEXTS: dict[tuple[bool, bool], list[str]] = {}  # (overlap, jump-forward) -> texts, compared across runs


def run_fixed_keys(h: Harness, **flags: Any) -> tuple[Scheduler, dict[str, dict[str, Any]]]:
    sched = h.scheduler(**flags)
    for i in range(4):
        h.submit(sched, f"j{i}", PROMPTS[i], max_new_tokens=128, json_schema=FIXED_KEYS)
    h.submit(sched, "free", PROMPTS[5], max_new_tokens=12)
    return sched, h.run(sched)


@pytest.mark.parametrize("jump_forward", [True, False], ids=["on", "off"])
def test_jump_forward(h: Harness, jump_forward: bool) -> None:
    sched, results = run_fixed_keys(h, disable_jump_forward=not jump_forward)
    assert sched.jump_forward == jump_forward
    texts = []
    for i in range(4):
        value = assert_schema(h, results[f"j{i}"], FIXED_KEYS)
        assert list(value) == ["city", "country", "population", "capital"]
        texts.append(h.text(results[f"j{i}"]["ids"]))
    if jump_forward:
        # Each object forces at least its keys and separators after the first token.
        assert sched.stats["jump_forward_tokens"] >= 4 * len(tokens_of(h, '"country": "'))
    else:
        assert sched.stats["jump_forward_tokens"] == 0
    assert results["free"]["reason"] == {"type": "length", "length": 12}
    assert_clean(sched)
    JUMP_TEXTS[(h.overlap, jump_forward)] = texts
    other = JUMP_TEXTS.get((h.overlap, not jump_forward))
    if other is not None:
        print(f"\njump-forward on/off texts equal ({'overlap' if h.overlap else 'serial'}): {texts == other}")
        for a, b in zip(texts, other):
            print(f"  {a!r}\n  {b!r}")


def tokens_of(h: Harness, text: str) -> list[int]:
    return h.tokenizer.encode(text, add_special_tokens=False)


def test_jump_forward_streams_forced_tokens(h: Harness) -> None:
    """A streamed request gets its forced tokens in its chunks: the chunks add up to the output a
    non-streamed twin gets."""
    sched = h.scheduler(stream_interval=1)
    h.submit(sched, "streamed", PROMPTS[0], stream=True, max_new_tokens=128, json_schema=FIXED_KEYS)
    h.submit(sched, "whole", PROMPTS[0], max_new_tokens=128, json_schema=FIXED_KEYS)
    results = h.run(sched)
    assert sched.stats["jump_forward_tokens"] > 0
    assert results["streamed"]["ids"] == results["whole"]["ids"]
    assert_schema(h, results["streamed"], FIXED_KEYS)
    assert results["whole"]["chunks"] == 1 and results["streamed"]["chunks"] > 5
    assert_clean(sched)


def test_jump_forward_off_without_radix_cache(h: Harness) -> None:
    sched, results = run_fixed_keys(h, disable_radix_cache=True)
    assert not sched.jump_forward and sched.stats["jump_forward_tokens"] == 0
    for i in range(4):
        assert_schema(h, results[f"j{i}"], FIXED_KEYS)
    assert_clean(sched)


def test_jump_forward_skips_logprob_requests(h: Harness) -> None:
    """Forced tokens have no logprobs: a request that returns them decodes every token."""
    sched = h.scheduler()
    h.submit(sched, "lp", PROMPTS[0], return_logprob=True, max_new_tokens=128, json_schema=FIXED_KEYS)
    results = h.run(sched)
    assert_schema(h, results["lp"], FIXED_KEYS)
    assert sched.stats["jump_forward_tokens"] == 0
    assert len(results["lp"]["logprobs"]) == len(results["lp"]["ids"])
    assert all(lp <= 0.0 for lp in results["lp"]["logprobs"])
    assert_clean(sched)


def test_jump_forward_up_to_the_length_limit(h: Harness) -> None:
    """A jump never goes past max_new_tokens; one that reaches it finishes the request by length
    with the forced tokens' KV never computed, and the memory invariant holds."""
    sched = h.scheduler()
    for limit in (2, 3, 5):
        h.submit(sched, f"l{limit}", PROMPTS[limit], max_new_tokens=limit, json_schema=FIXED_KEYS)
    results = h.run(sched)
    prefix = '{"city": "'
    for limit in (2, 3, 5):
        r = results[f"l{limit}"]
        assert r["reason"] == {"type": "length", "length": limit} and len(r["ids"]) == limit
        text = h.text(r["ids"])
        assert prefix.startswith(text) or text.startswith(prefix), text
    assert sched.stats["jump_forward_tokens"] > 0
    assert_clean(sched)


# ---- several samples of one schema --------------------------------------------------------------


def test_same_schema_different_seeds(h: Harness) -> None:
    """What the tokenizer makes of n=2: two requests with the same schema and their own seeds."""
    sched = h.scheduler()
    schema = json.dumps(PERSON)
    for seed in (1, 2):
        h.submit(sched, f"s{seed}", PROMPTS[0], max_new_tokens=128, temperature=1.0, seed=seed, json_schema=schema)
    results = h.run(sched)
    for seed in (1, 2):
        assert_schema(h, results[f"s{seed}"], PERSON)
    stats = sched.grammars.stats
    assert stats.constrained_requests == 2 and stats.grammar_compiles == 1 and stats.grammar_cache_hits == 1
    assert_clean(sched)
    # Seeded: the same seed gives the same output again (its matcher is its own, fresh).
    again = h.scheduler()
    h.submit(again, "s1", PROMPTS[0], max_new_tokens=128, temperature=1.0, seed=1, json_schema=schema)
    assert h.run(again)["s1"]["ids"] == results["s1"]["ids"]
    assert_clean(again)


# ---- other batch shapes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        {"page_size": 4},
        {"chunked_prefill_size": 8, "enable_mixed_chunk": True},
        {"page_size": 4, "chunked_prefill_size": 8, "enable_mixed_chunk": True},
    ],
    ids=["page4", "chunked-mixed", "page4-chunked-mixed"],
)
def test_outputs_same_across_batch_shapes(h: Harness, flags: dict[str, Any]) -> None:
    """Pages, chunked prompts and mixed prefill+decode batches put constrained rows elsewhere in
    the batch (and jump-forward re-prefills through page-aligned prefixes): the greedy outputs are
    those of the plain configuration, every mask row on its own request."""
    long_prompt = " ".join(PROMPTS)

    def submit_all(sched: Scheduler) -> dict[str, dict[str, Any]]:
        for i in range(4):
            h.submit(
                sched,
                f"j{i}",
                long_prompt if i % 2 else PROMPTS[i],
                max_new_tokens=128,
                json_schema=FIXED_KEYS if i < 2 else TAGS,
            )
        h.submit(sched, "email", long_prompt, max_new_tokens=64, regex=EMAIL)
        h.submit(sched, "free", long_prompt, max_new_tokens=20)
        return h.run(sched)

    plain = h.scheduler()
    want = submit_all(plain)
    shaped = h.scheduler(**flags)
    got = submit_all(shaped)
    for rid in want:
        assert got[rid]["ids"] == want[rid]["ids"], rid
    for i in range(4):
        assert_schema(h, got[f"j{i}"], FIXED_KEYS if i < 2 else TAGS)
    assert_email(h, got["email"])
    if flags.get("enable_mixed_chunk"):
        assert shaped.stats["num_mixed_batches"] > 0
    assert shaped.stats["jump_forward_tokens"] > 0
    assert_clean(plain)
    assert_clean(shaped)


def test_grammar_queue_counts_against_the_queue_bound_and_deadlines_reach_it(h: Harness, gate: Gate) -> None:
    """--max-queued-requests counts requests waiting for their grammar; a deadline aborts one there."""
    _, started, release = gate
    sched = start_blocked_email(h, gate, "waiting", max_queued_requests=3)
    params = SamplingParams.from_dict({"max_new_tokens": 64, "temperature": 0.0, "regex": EMAIL})
    sched.handle_message(
        TokenizedGenerateReq(
            rid="late",
            input_ids=h.tokenizer.encode(PROMPTS[1]),
            sampling_params=params,
            deadline=time.monotonic() - 1.0,
        )
    )
    h.submit(sched, "free", PROMPTS[2], max_new_tokens=6)  # 2 in the grammar queue + 1 waiting: the bound
    h.submit(sched, "over", PROMPTS[3], max_new_tokens=6)
    results: dict[str, dict[str, Any]] = {}
    h.collect(sched, results)
    assert results["over"]["error"] == "overloaded" and len(results) == 1
    assert started.wait(30)
    sched.step()  # the deadline passed: out of the grammar queue at once
    h.collect(sched, results)
    assert results["late"]["reason"] == {"type": "abort", "message": "timeout"} and results["late"]["ids"] == []
    release.set()
    h.run(sched, results)
    assert_email(h, results["waiting"])
    assert results["free"]["reason"]["type"] == "length"
    assert sched.stats["num_timed_out"] == 1 and sched.stats["num_refused_overloaded"] == 1
    assert_clean(sched)
