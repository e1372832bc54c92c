"""Speculative decoding over the real model code (tiny checkpoints, CPU fp32, in-process schedulers).

Verification runs each request's last token and drafts as a short causal extend (the extend
attention path, the one-call CPU decode stack and the decode mirror stepping aside), so the
greedy tokens must be those of plain decoding, which the rest of the suite checks against
transformers; a seeded sampled request draws position j with the seed of step ``len(output)+j``,
so it too must emit what it emits without drafts.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from runtime.config.args import ServerArgs
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_scheduler import assert_idle_invariant, run_until_idle


def runner_for(path: Path, **kw: Any) -> ModelRunner:
    return ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        max_total_tokens=kw.pop("max_total_tokens", 2048),
        load_progress=False,
        **kw,
    )


def calls_for(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a passage (drafts find matches) and random ones, alternately."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, vocab) for _ in range(6 + i % 5)]
        out.append(base * 3 if i % 2 == 0 else [rng.randrange(3, vocab) for _ in range(10 + i % 7)])
    return out


def generate(
    runner: Any, prompts: list[list[int]], params: list[dict[str, Any]], spec: bool, tp_rank: int = 0, **args: Any
) -> dict[str, dict]:
    args.setdefault("disable_overlap_schedule", True)
    args.setdefault("speculative_max_step_tokens", 1 << 20)  # (every request drafts, however many run)
    sched = Scheduler(
        ServerArgs(max_total_tokens=runner.max_total_tokens, speculative_algorithm="ngram" if spec else None, **args),
        tp_rank=tp_rank,
        model_runner=runner,
    )
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        p = dict(p)
        logprobs = p.pop("return_logprob", False)
        sched.handle_message(
            TokenizedGenerateReq(
                rid=str(i), input_ids=prompt, return_logprob=logprobs, sampling_params=SamplingParams(**p)
            )
        )
    results = run_until_idle(sched)
    assert_idle_invariant(sched)
    results["stats"] = dict(sched.stats)
    return results


def ids(results: dict[str, dict]) -> dict[str, list[int]]:
    return {k: v["ids"] for k, v in results.items() if k != "stats"}


def test_greedy_equal_on_every_architecture_at_batch_1_and_32(tiny_checkpoint: tuple[str, Path]) -> None:
    _, path = tiny_checkpoint
    runner = runner_for(path)
    prompts = calls_for(runner.vocab_size, 32, seed=1)
    params = [{"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}] * 32
    on = generate(runner, prompts, params, spec=True)
    assert ids(on) == ids(generate(runner, prompts, params, spec=False))
    assert on["stats"]["spec_draft_tokens"] > 0
    one = generate(runner, prompts[:1], params[:1], spec=True)
    assert ids(one)["0"] == ids(on)["0"]


@pytest.mark.parametrize("name", ["mistral_swa", "qwen2_swa"])
def test_sliding_window_models(tiny_checkpoints: Any, name: str) -> None:
    """Drafts sit inside the window rules: a verify extend masks each position's own window, and the
    slots that left it are given back after the step as after a decode."""

    # (A runner per scheduler: the SWA slot map lives in the runner's pool, and a second scheduler's
    # allocator would start with the first one's cached slots still mapped.)
    def run(spec: bool) -> dict[str, list[int]]:
        runner = runner_for(tiny_checkpoints.path(name), max_total_tokens=1024)
        prompts = calls_for(runner.vocab_size, 3, seed=2)
        prompts[0] = prompts[0] * 2  # past both windows (16, 24)
        params = [{"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}] * 3
        return ids(generate(runner, prompts, params, spec=spec))

    assert run(True) == run(False)


def test_sampling_penalties_logprobs_chunks_and_prefix_hits(tiny_llama_path: Path) -> None:
    """Seeds, penalties, min_new_tokens, stop tokens and logprobs per accepted token, with 8-token
    chunks and a shared prefix, give what plain decoding gives."""
    runner = runner_for(tiny_llama_path)
    base = calls_for(runner.vocab_size, 2, seed=3)[0]
    prompts = [base + [5 + i] for i in range(6)]
    params = [
        {"max_new_tokens": 12, "temperature": 0.9, "seed": 11, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 5, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0.0, "repetition_penalty": 1.2, "frequency_penalty": 0.5},
        {"max_new_tokens": 12, "temperature": 0.0, "min_new_tokens": 8, "return_logprob": True},
        {"max_new_tokens": 12, "temperature": 0.0, "return_logprob": True, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0.0, "stop_token_ids": [7, 9, 11, 13]},
    ]
    on = generate(runner, prompts, params, spec=True, chunked_prefill_size=8)
    off = generate(runner, prompts, params, spec=False, chunked_prefill_size=8)
    assert ids(on) == ids(off)
    assert on["stats"]["cached_prompt_tokens"] > 0 and on["stats"]["spec_draft_tokens"] > 0


def test_logprobs_per_accepted_token(tiny_llama_path: Path) -> None:
    """The logprob of each accepted token (its top-k, its token_ids_logprob) is that of its own verify position."""
    from runtime.protocol.messages import BatchTokenIDOut

    runner = runner_for(tiny_llama_path)
    prompt = calls_for(runner.vocab_size, 1, seed=4)[0]
    got = {}
    for spec in (False, True):
        sched = Scheduler(
            ServerArgs(
                max_total_tokens=2048, disable_overlap_schedule=True, speculative_algorithm="ngram" if spec else None
            ),
            model_runner=runner,
        )
        sched.handle_message(
            TokenizedGenerateReq(
                rid="r",
                input_ids=prompt,
                return_logprob=True,
                top_logprobs_num=2,
                token_ids_logprob=[4, 1, runner.vocab_size - 1],
                sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True),
            )
        )
        outs = []
        while True:
            sched.step()
            outs += [o for m in sched.take_outbox() if isinstance(m, BatchTokenIDOut) for o in m.outputs]
            if sched.is_idle():
                break
        got[spec] = (
            [t for o in outs for t in o.new_output_ids],
            [lp for o in outs for lp in o.output_logprobs],
            [[t for _, t in top] for o in outs for top in o.output_top_logprobs],
            [[lp for lp, _ in row] for o in outs for row in o.output_token_ids_logprobs],
        )
        assert all(
            [t for _, t in row] == [4, 1, runner.vocab_size - 1] for o in outs for row in o.output_token_ids_logprobs
        )
        if spec:
            assert sched.stats["spec_accepted_drafts"] > 0
    assert got[True][0] == got[False][0] and got[True][2] == got[False][2]
    assert got[True][1] == pytest.approx(got[False][1], abs=1e-4)
    assert len(got[True][3]) == len(got[True][0]) == 16
    for with_spec, without in zip(got[True][3], got[False][3]):
        assert with_spec == pytest.approx(without, abs=1e-4)


def test_tensor_parallel_2(tiny_llama_path: Path, thread_tp_group: Any) -> None:
    """TP=2 (a thread per rank): every rank proposes the same drafts and takes rank 0's samples."""
    from tests.support.tp_threads import run_on_ranks

    runners = [
        runner_for(
            tiny_llama_path,
            max_total_tokens=512,
            max_running_requests=8,
            tp_rank=r,
            tp_size=2,
            attention_backend="torch_native",
        )
        for r in range(2)
    ]
    prompts = calls_for(runners[0].vocab_size, 4, seed=5)
    params = [{"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}] * 4

    def work(rank: int) -> dict[str, list[int]]:
        return ids(generate(runners[rank], prompts, params, spec=True, tp_rank=rank, tp_size=2))

    results = run_on_ranks(thread_tp_group, work)
    assert results[0] == results[1]
    assert results[0] == ids(generate(runner_for(tiny_llama_path, max_total_tokens=512), prompts, params, spec=False))


def test_constrained_requests_draft_what_their_grammar_takes(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts of a constrained request are cut to what its grammar accepts, and each verify row is
    masked by the grammar's state after the drafts before it: the output is plain decoding's and
    matches its grammar."""
    import re

    from runtime.text.grammar.matcher import RequestGrammar
    from runtime.text.tokenizer import load_tokenizer

    drafted: list[int] = []
    real_fill = RequestGrammar.fill_after

    def fill_after(self: RequestGrammar, tokens: Any, bitmask: Any, first_row: int) -> None:
        drafted.append(len(tokens))
        real_fill(self, tokens, bitmask, first_row)

    monkeypatch.setattr(RequestGrammar, "fill_after", fill_after)
    tokenizer = load_tokenizer(str(tiny_llama_path))
    pattern = r"(ab|cd)( (ab|cd)){4,9}\."
    prompts = ["ab cd ab cd ab", "Hello world", "cd cd cd"]

    def run(spec: bool) -> dict[str, list[int]]:
        args = ServerArgs(
            model_path=str(tiny_llama_path),
            device="cpu",
            dtype="float32",
            max_total_tokens=2048,
            disable_overlap_schedule=True,
            speculative_algorithm="ngram" if spec else None,
            speculative_max_step_tokens=1 << 20,
        )
        sched = Scheduler(args)
        for i, prompt in enumerate(prompts):
            sched.handle_message(
                TokenizedGenerateReq(
                    rid=str(i),
                    input_ids=tokenizer.encode(prompt),
                    sampling_params=SamplingParams(max_new_tokens=64, temperature=0.0, regex=pattern),
                )
            )
        sched.handle_message(
            TokenizedGenerateReq(
                rid="free",
                input_ids=tokenizer.encode(prompts[0] * 3),
                sampling_params=SamplingParams(max_new_tokens=24, temperature=0.0),
            )
        )
        out = ids(run_until_idle(sched))
        assert_idle_invariant(sched)
        return out

    off = run(False)
    drafted.clear()
    on = run(True)
    assert on == off
    assert any(drafted), "no constrained request drafted"
    for i in range(len(prompts)):
        text = tokenizer.decode(on[str(i)], skip_special_tokens=True)
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_cache_verifies_drafts_over_the_stored_values(tiny_llama_path: Path, kv_dtype: str) -> None:
    """A verify step's new tokens attend to their stored (quantized) values, as the decode steps they
    replace read them from the cache: greedy output with drafts is the output without, on the same
    quantized cache, with 8-token chunks and prefix hits."""
    runner = runner_for(tiny_llama_path, kv_cache_dtype=kv_dtype)
    prompts = calls_for(runner.vocab_size, 8, seed=6)
    prompts += [prompts[0] + [7, 8, 9]]  # a prefix hit on the first request's prompt
    params = [{"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}] * len(prompts)
    on = generate(runner, prompts, params, spec=True, chunked_prefill_size=8)
    assert ids(on) == ids(generate(runner, prompts, params, spec=False, chunked_prefill_size=8))
    assert on["stats"]["spec_draft_tokens"] > 0 and on["stats"]["cached_prompt_tokens"] > 0
