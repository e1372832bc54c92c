"""Prompt (input) token logprobs, SGLang's ``token_ids_logprob`` and max_new_tokens 0, through an
in-process Scheduler over the real model (tiny fp32 Llama, torch-native CPU path), against transformers.

The reference is ``log_softmax(model(prompt).logits.float())`` gathered at each next prompt
token; top-k against ``topk`` of the same rows; named ids at the same rows, and at the rows of the
output tokens (one forward over prompt + output). Every message the scheduler sends goes through
the typed msgpack decoder the detokenizer uses, and every token id must come out an int. Every
test checks the memory invariant at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import msgspec
import pytest
import torch

from runtime.config.args import ServerArgs
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import BatchTokenIDOut, DetokenizerInput, SchedErrorOut, TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.checkpoints import hf_greedy, load_hf_model, random_prompt
from tests.support.stub_scheduler import assert_idle_invariant

ATOL = 1e-4
TOP_K = 3


@pytest.fixture(scope="module")
def path(tiny_checkpoints: Any) -> Path:
    return tiny_checkpoints.path("llama")


@pytest.fixture(scope="module")
def hf(path: Path) -> Any:
    return load_hf_model(path)


@pytest.fixture(scope="module")
def runner(path: Path) -> ModelRunner:
    """One runner for the module: every test's Scheduler takes its pools afresh (they start empty)."""
    return ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=2048,
        load_progress=False,
        max_running_requests=16,
    )


@pytest.fixture
def make(runner: ModelRunner) -> Iterator[Any]:
    made: list[Scheduler] = []

    def build(overlap: bool = False, **flags: Any) -> Scheduler:
        runner.req_to_token_pool.clear()
        args = ServerArgs(max_total_tokens=runner.max_total_tokens, disable_overlap_schedule=not overlap, **flags)
        sched = Scheduler(args, model_runner=runner)
        made.append(sched)
        return sched

    yield build
    for sched in made:
        sched.worker.close()


def reference(hf: Any, prompt: list[int], start: int) -> tuple[list[list[Any]], list[Any]]:
    """transformers' prompt logprobs from ``start`` (None for token 0) and top-k at each position."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens: list[list[Any]] = []
    tops: list[Any] = []
    for i in range(start, len(prompt)):
        if i == 0:
            tokens.append([None, prompt[0]])
            tops.append(None)
            continue
        tokens.append([float(logprobs[i - 1, prompt[i]]), prompt[i]])
        values, ids = logprobs[i - 1].topk(TOP_K)
        tops.append([[float(v), int(t)] for v, t in zip(values, ids)])
    return tokens, tops


def submit(
    sched: Scheduler,
    rid: str,
    prompt: list[int],
    max_new_tokens: int = 4,
    start: int = -1,
    top: int = TOP_K,
    stream: bool = False,
    token_ids: list[int] | None = None,
    return_logprob: bool | None = None,
) -> None:
    """``return_logprob`` defaults to whether prompt logprobs are asked (``start`` >= 0)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    logprob = start >= 0 if return_logprob is None else return_logprob
    sched.handle_message(
        TokenizedGenerateReq(
            rid=rid,
            input_ids=prompt,
            sampling_params=params,
            stream=stream,
            return_logprob=logprob,
            top_logprobs_num=top if logprob else 0,
            logprob_start_len=start,
            token_ids_logprob=token_ids,
        )
    )


def assert_int_ids(rows: list[Any] | None) -> None:
    """Every [logprob, token_id] pair of ``rows`` (None rows skipped) has an int id (JSON ``3``, not ``3.0``)."""
    for row in rows or ():
        for pair in row or ():
            assert type(pair[1]) is int, pair


def run(sched: Scheduler) -> dict[str, dict[str, Any]]:
    """Step until idle; per rid: output ids, finish reason, cached tokens, the prompt logprobs, the
    output and prompt logprobs of its token_ids_logprob ("named", "input_named": None when not sent)."""
    results: dict[str, dict[str, Any]] = {}
    decoder = msgspec.msgpack.Decoder(DetokenizerInput)  # the detokenizer's end of the socket
    for _ in range(10_000):
        sched.step()
        for sent in sched.take_outbox():
            msg = decoder.decode(msgspec.msgpack.encode(sent))
            assert not isinstance(msg, SchedErrorOut), msg
            assert isinstance(msg, BatchTokenIDOut)
            for out in msg.outputs:
                entry = results.setdefault(out.rid, {"ids": [], "outputs": 0, "named": None, "logprobs": None})
                entry["ids"] += out.new_output_ids
                entry["outputs"] += 1
                entry["reason"] = out.finish_reason
                entry["cached"] = out.cached_tokens
                if out.output_logprobs is not None:
                    entry["logprobs"] = (entry["logprobs"] or []) + out.output_logprobs
                if out.output_token_ids_logprobs is not None:
                    assert len(out.output_token_ids_logprobs) == len(out.new_output_ids)
                    entry["named"] = (entry["named"] or []) + out.output_token_ids_logprobs
                for rows in (out.output_top_logprobs, out.input_top_logprobs, out.output_token_ids_logprobs):
                    assert_int_ids(rows)
                assert_int_ids(out.input_token_ids_logprobs)
                assert_int_ids([out.input_token_logprobs])
                if out.input_token_logprobs is not None or out.input_token_ids_logprobs is not None:
                    assert "input" not in entry, "prompt logprobs are sent once"
                    entry["input"] = out.input_token_logprobs
                    entry["input_top"] = out.input_top_logprobs
                    entry["input_named"] = out.input_token_ids_logprobs
        if sched.is_idle():
            assert_idle_invariant(sched)
            return results
    raise AssertionError("scheduler did not go idle")


def assert_close(got: dict[str, Any], want: tuple[list[list[Any]], list[Any]], top: bool = True) -> None:
    tokens, tops = want
    assert [t for _, t in got["input"]] == [t for _, t in tokens]
    assert len(got["input"]) == len(tokens)
    for (g, _), (w, _) in zip(got["input"], tokens):
        assert (g is None) == (w is None)
        if w is not None:
            assert abs(g - w) < ATOL, (g, w)
    if not top:
        assert got["input_top"] is None
        return
    assert len(got["input_top"]) == len(tops)
    for g_row, w_row in zip(got["input_top"], tops):
        if w_row is None:
            assert g_row is None
            continue
        assert [t for _, t in g_row] == [t for _, t in w_row]
        assert all(abs(g - w) < ATOL for (g, _), (w, _) in zip(g_row, w_row))


def named_reference(
    hf: Any, prompt: list[int], output: list[int], ids: list[int], start: int = -1
) -> tuple[list[Any], list[Any]]:
    """transformers' logprobs of ``ids`` at each output token (the position before it) and, from
    ``start`` (-1: none), at each prompt token (None for token 0): [[logprob, id], ...] in ``ids`` order."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)

    def at(pos: int) -> list[list[Any]]:
        return [[float(logprobs[pos, t]), t] for t in ids]

    prompt_rows = [None if i == 0 else at(i - 1) for i in range(max(start, 0), len(prompt))] if start >= 0 else []
    return [at(len(prompt) - 1 + j) for j in range(len(output))], prompt_rows


def assert_named_close(got: list[Any] | None, want: list[Any]) -> None:
    """Per position [[logprob, id], ...] (or None) equal to the reference's, ids in order and as ints."""
    assert got is not None and len(got) == len(want)
    for g_row, w_row in zip(got, want):
        if w_row is None:
            assert g_row is None
            continue
        assert [t for _, t in g_row] == [t for _, t in w_row]
        assert all(abs(g - w) < ATOL for (g, _), (w, _) in zip(g_row, w_row)), (g_row, w_row)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("chunk", [-1, 8], ids=["whole", "chunk8"])
def test_token_ids_logprob_at_output_and_prompt_positions_equal_transformers(
    make, hf, runner, overlap: bool, chunk: int
) -> None:
    """One batch: a request with prompt logprobs from 0, top-k and ids (one twice, one the last of the
    vocabulary); one with other ids, prompt positions from 6 and no return_logprob (the ids come
    anyway, the plain logprobs not); one with ids at output positions only; one without any. Chunked
    or whole, serial or overlapped."""
    sched = make(overlap, chunked_prefill_size=chunk)
    vocab = runner.vocab_size
    prompts = {
        rid: random_prompt(n, vocab, seed=60 + n) for rid, n in (("all", 29), ("named", 23), ("out", 11), ("plain", 17))
    }
    ids = {"all": [5, 17, 5, vocab - 1], "named": [40, 2], "out": [9]}
    submit(sched, "all", prompts["all"], max_new_tokens=5, start=0, token_ids=ids["all"])
    submit(sched, "named", prompts["named"], max_new_tokens=5, start=6, token_ids=ids["named"], return_logprob=False)
    submit(sched, "out", prompts["out"], max_new_tokens=5, token_ids=ids["out"])
    submit(sched, "plain", prompts["plain"], max_new_tokens=5)
    results = run(sched)
    # Whole: the four prefills share one forward; chunk8: each 8-token forward serves one or two.
    assert sched.stats["num_prefill_batches"] == (1 if chunk < 0 else 10)
    for rid, prompt in prompts.items():
        assert results[rid]["ids"] == hf_greedy(hf, prompt, 5)[0], rid
    for rid, start in (("all", 0), ("named", 6), ("out", -1)):
        outputs, prompt_rows = named_reference(hf, prompts[rid], results[rid]["ids"], ids[rid], start)
        assert_named_close(results[rid]["named"], outputs)
        if start >= 0:
            assert_named_close(results[rid]["input_named"], prompt_rows)
    assert results["all"]["input_named"][0] is None  # prompt token 0 has no position before it
    assert_close(results["all"], reference(hf, prompts["all"], 0))
    assert len(results["all"]["logprobs"]) == 5
    # Without return_logprob: the named ids' logprobs only.
    assert results["named"]["logprobs"] is None and results["named"]["input"] is None
    assert results["named"]["input_top"] is None
    assert "input" not in results["out"] and results["out"]["logprobs"] is None
    assert results["plain"]["named"] is None and "input" not in results["plain"]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("chunk", [-1, 8], ids=["whole", "chunk8"])
def test_prompt_logprobs_equal_transformers(make, hf, runner, overlap: bool, chunk: int) -> None:
    sched = make(overlap, chunked_prefill_size=chunk)
    prompt = random_prompt(29, runner.vocab_size, seed=7)
    submit(sched, "from0", prompt, start=0)
    submit(sched, "from13", prompt, start=13)
    results = run(sched)
    assert_close(results["from0"], reference(hf, prompt, 0))
    assert_close(results["from13"], reference(hf, prompt, 13))
    greedy = hf_greedy(hf, prompt, 4)[0]
    assert results["from0"]["ids"] == results["from13"]["ids"] == greedy  # still sampled at the last position


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_repeated_request_still_gets_all_its_prompt_logprobs_with_the_radix_cache(
    make, hf, runner, overlap: bool
) -> None:
    sched = make(overlap, chunked_prefill_size=8)
    prompt = random_prompt(40, runner.vocab_size, seed=11)
    want = reference(hf, prompt, 21)
    submit(sched, "a", prompt, start=21)
    first = run(sched)["a"]
    submit(sched, "b", prompt, start=21)
    second = run(sched)["b"]
    assert_close(first, want)
    assert_close(second, want)
    assert second["ids"] == first["ids"]
    assert 0 < second["cached"] <= 20  # the cache served what comes before position 20 only
    submit(sched, "plain", prompt)  # without prompt logprobs the whole cached prompt is reused
    assert run(sched)["plain"]["cached"] >= 32
    submit(sched, "zero", prompt, start=0)
    zero = run(sched)["zero"]
    assert zero["cached"] == 0
    assert_close(zero, reference(hf, prompt, 0))


def test_prompt_logprobs_without_top_logprobs(make, hf, runner) -> None:
    sched = make()
    prompt = random_prompt(17, runner.vocab_size, seed=5)
    submit(sched, "r", prompt, start=3, top=0)
    assert_close(run(sched)["r"], reference(hf, prompt, 3), top=False)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_max_new_tokens_zero_prefills_and_finishes_by_length(make, hf, runner, overlap: bool, stream: bool) -> None:
    sched = make(overlap, chunked_prefill_size=8)
    prompt = random_prompt(21, runner.vocab_size, seed=3)
    submit(sched, "scored", prompt, max_new_tokens=0, start=1, stream=stream)
    submit(sched, "bare", prompt[:9], max_new_tokens=0, stream=stream)
    results = run(sched)
    for rid in ("scored", "bare"):
        assert results[rid]["ids"] == []
        assert results[rid]["reason"] == {"type": "length", "length": 0}
        assert results[rid]["outputs"] == 1
    assert_close(results["scored"], reference(hf, prompt, 1))
    assert "input" not in results["bare"]
    # Its prompt was prefilled and cached like any finished request's.
    submit(sched, "again", prompt, max_new_tokens=2)
    again = run(sched)["again"]
    assert again["cached"] >= 16
    assert again["ids"] == hf_greedy(hf, prompt, 2)[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_batch_mixing_prompt_logprobs_and_plain_requests(make, hf, runner, overlap: bool) -> None:
    sched = make(overlap)
    prompts = [random_prompt(n, runner.vocab_size, seed=20 + n) for n in (12, 25, 7)]
    submit(sched, "plain0", prompts[0], max_new_tokens=6)
    submit(sched, "scored", prompts[1], max_new_tokens=6, start=4)
    submit(sched, "plain2", prompts[2], max_new_tokens=6)
    results = run(sched)
    assert sched.stats["num_prefill_batches"] == 1  # all three in one forward
    for rid, prompt in zip(("plain0", "scored", "plain2"), prompts):
        assert results[rid]["ids"] == hf_greedy(hf, prompt, 6)[0], rid
    assert "input" not in results["plain0"] and "input" not in results["plain2"]
    assert_close(results["scored"], reference(hf, prompts[1], 4))


def test_batches_without_prompt_logprobs_compute_one_logit_row_per_request(make, runner, monkeypatch) -> None:
    sched = make(chunked_prefill_size=8)
    rows: list[int] = []
    forward = runner.compute_logits

    def counting(batch: Any) -> torch.Tensor:
        logits = forward(batch)
        rows.append(int(logits.shape[0]) - batch.batch_size)
        return logits

    monkeypatch.setattr(runner, "compute_logits", counting)
    submit(sched, "plain", random_prompt(20, runner.vocab_size, seed=1), max_new_tokens=3)
    run(sched)
    assert rows and not any(rows)
    submit(sched, "scored", random_prompt(20, runner.vocab_size, seed=2), max_new_tokens=3, start=10)
    run(sched)
    # Chunks [0, 8), [8, 16), [16, 20): rows 9..15 and 16..19, less each chunk's last (its sampling row).
    assert sum(rows) == 6 + 3


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_prompt_logprobs_in_a_mixed_batch_beside_decoding_requests(make, hf, runner, overlap: bool) -> None:
    """--enable-mixed-chunk: the scored prompt's chunks run in the same forwards as the decode steps
    of a running request, whose output stays transformers' greedy one; both name token ids, which the
    decode rows and the prompt rows of those forwards report."""
    sched = make(overlap, enable_mixed_chunk=True, chunked_prefill_size=8)
    first = random_prompt(10, runner.vocab_size, seed=31)
    scored = random_prompt(30, runner.vocab_size, seed=32)
    submit(sched, "decoding", first, max_new_tokens=12, token_ids=[3, 30])
    sched.step()
    submit(sched, "scored", scored, max_new_tokens=3, start=2, token_ids=[7])
    results = run(sched)
    assert sched.stats["num_mixed_batches"] >= 2
    assert results["decoding"]["ids"] == hf_greedy(hf, first, 12)[0]
    assert results["scored"]["ids"] == hf_greedy(hf, scored, 3)[0]
    assert_close(results["scored"], reference(hf, scored, 2))
    assert_named_close(results["decoding"]["named"], named_reference(hf, first, results["decoding"]["ids"], [3, 30])[0])
    outputs, prompt_rows = named_reference(hf, scored, results["scored"]["ids"], [7], 2)
    assert_named_close(results["scored"]["named"], outputs)
    assert_named_close(results["scored"]["input_named"], prompt_rows)


def test_prompt_logprobs_with_pages_of_four(path: Path, hf) -> None:
    """Page size 4: the cache match is page-aligned below the limit, and still every prompt logprob comes."""
    paged = ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=1024,
        page_size=4,
        load_progress=False,
        max_running_requests=8,
    )
    sched = Scheduler(
        ServerArgs(max_total_tokens=1024, page_size=4, disable_overlap_schedule=True, chunked_prefill_size=8),
        model_runner=paged,
    )
    prompt = random_prompt(27, paged.vocab_size, seed=41)
    for rid, start in (("a", 11), ("b", 11), ("c", 6)):
        submit(sched, rid, prompt, start=start)
        result = run(sched)[rid]
        assert_close(result, reference(hf, prompt, start))
        assert result["cached"] <= start - 1
    assert result["cached"] == 4  # the cached prefix before position 5, in whole pages


def test_prompt_logprobs_under_tensor_parallelism(path: Path, hf, thread_tp_group) -> None:
    """TP=2 (a thread per rank): the vocab-sharded logits are all-gathered, so every rank's
    scheduler computes the same prompt logprobs, equal to transformers'."""
    from tests.support.tp_threads import run_on_ranks

    runners = [
        ModelRunner(
            path,
            device="cpu",
            dtype="float32",
            attention_backend="torch_native",
            max_total_tokens=512,
            load_progress=False,
            max_running_requests=4,
            tp_rank=r,
            tp_size=2,
        )
        for r in range(2)
    ]
    assert runners[0].model.lm_head.weight.shape[0] < runners[0].vocab_size  # each rank has half the vocab
    prompt = random_prompt(19, runners[0].vocab_size, seed=53)

    def work(rank: int) -> dict[str, Any]:
        sched = Scheduler(
            ServerArgs(max_total_tokens=512, disable_overlap_schedule=True, chunked_prefill_size=8, tp_size=2),
            tp_rank=rank,
            model_runner=runners[rank],
        )
        submit(sched, "r", prompt, max_new_tokens=2, start=0, token_ids=[1, runners[0].vocab_size - 1])
        return run(sched)["r"]

    results = run_on_ranks(thread_tp_group, work)
    for result in results:
        assert_close(result, reference(hf, prompt, 0))
        assert result["ids"] == hf_greedy(hf, prompt, 2)[0]
        # Token ids on both halves of the sharded vocabulary, at the output and the prompt positions.
        outputs, prompt_rows = named_reference(hf, prompt, result["ids"], [1, runners[0].vocab_size - 1], 0)
        assert_named_close(result["named"], outputs)
        assert_named_close(result["input_named"], prompt_rows)


def test_the_host_copy_of_a_step_keeps_every_logprob_and_makes_ids_ints() -> None:
    """The worker's device-to-host path (cuda's overlap copies, then the lists the scheduler reads),
    run on CPU tensors: every logprob field arrives, and token ids are ints even from a float tensor."""
    from runtime.engine.model_runner import ModelOutput
    from scheduler_proc.model_worker import _host_copy, _to_result

    output = ModelOutput(
        next_token_ids=torch.tensor([3, 4]),
        logprobs=torch.tensor([-0.5, -1.5]),
        top_logprobs=(torch.tensor([[-0.5], [-0.25]]), torch.tensor([[3.0], [8.0]])),
        token_ids_logprobs=torch.tensor([[-2.0, -3.0], [-4.0, -5.0]]),
        input_token_logprobs=torch.tensor([-6.0]),
        input_top_logprobs=(torch.tensor([[-0.75]]), torch.tensor([[9]])),
        input_token_ids_logprobs=torch.tensor([[-7.0, -8.0]]),
    )
    result = _to_result(_host_copy(output))
    assert result.token_ids == [3, 4] and result.logprobs == [-0.5, -1.5]
    assert result.top_logprobs == ([[-0.5], [-0.25]], [[3], [8]])
    assert result.token_ids_logprobs == [[-2.0, -3.0], [-4.0, -5.0]]
    assert result.input_logprobs == [-6.0] and result.input_top_logprobs == ([[-0.75]], [[9]])
    assert result.input_token_ids_logprobs == [[-7.0, -8.0]]
    assert result.top_logprobs is not None and result.input_top_logprobs is not None
    assert all(type(t) is int for ids in (result.top_logprobs[1], result.input_top_logprobs[1]) for t in ids[0])
