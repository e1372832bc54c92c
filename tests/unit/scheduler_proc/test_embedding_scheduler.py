"""An embedding server's scheduler over a real model: causal LMs pooled as transformers' hidden states say.

Each request is prefilled only (in chunks when long), pooled by the server's rule and answered with
one finished output carrying its vector; the memory invariant holds after. The oracle is transformers'
base model (``AutoModel``): its ``last_hidden_state`` (after the final norm), pooled and normalised by
the same rule, in fp32.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoints.pooling import PoolingSpec
from runtime.config.args import ServerArgs
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_scheduler import assert_idle_invariant, run_until_idle

FAMILIES = ("llama", "qwen3")


def pooling(method: str) -> PoolingSpec:
    return PoolingSpec(method, True, False, False, "test")


_RUNNERS: dict[tuple[str, str], ModelRunner] = {}


def runner_for(tiny_checkpoints: Any, family: str, method: str) -> ModelRunner:
    key = (family, method)
    if key not in _RUNNERS:
        _RUNNERS[key] = ModelRunner(
            tiny_checkpoints.path(family),
            device="cpu",
            dtype="float32",
            max_total_tokens=4096,
            max_running_requests=16,
            load_progress=False,
            pooling=pooling(method),
        )
    return _RUNNERS[key]


def reference(path: Path, prompt: list[int], method: str) -> torch.Tensor:
    from transformers import AutoModel

    model = _HF.get(path)
    if model is None:
        model = _HF[path] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    vector = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[method]
    return torch.nn.functional.normalize(vector, dim=0)


_HF: dict[Path, Any] = {}


def submit(sched: Scheduler, rid: str, prompt: list[int]) -> None:
    sched.handle_message(
        TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=0), embed=True)
    )


def prompts(n: int, seed: int, vocab: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 70))] for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["last", "mean", "cls"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_pooled_vectors_equal_transformers_hidden_states(
    tiny_checkpoints: Any, family: str, method: str, overlap: bool
) -> None:
    """Mixed lengths in one batch, prompts longer than a chunk split over several forwards."""
    runner = runner_for(tiny_checkpoints, family, method)
    args = ServerArgs(max_total_tokens=4096, chunked_prefill_size=24, disable_overlap_schedule=not overlap)
    sched = Scheduler(args, model_runner=runner)
    batch = prompts(6, seed=3, vocab=runner.vocab_size)
    for i, prompt in enumerate(batch):
        submit(sched, f"e{i}", prompt)
    results = run_until_idle(sched)
    for i, prompt in enumerate(batch):
        got = results[f"e{i}"]
        assert got["finished"] and got["ids"] == [] and got["reason"] == {"type": "stop", "matched": None}
        vector = torch.tensor(got["embedding"])
        expected = reference(tiny_checkpoints.path(family), prompt, method)
        assert torch.nn.functional.cosine_similarity(vector, expected, dim=0) > 0.9999, f"e{i}"
        torch.testing.assert_close(vector, expected, atol=2e-5, rtol=1e-4)
    assert_idle_invariant(sched)


def test_last_token_pooling_reuses_a_cached_prefix_and_gives_the_same_vector(tiny_checkpoints: Any) -> None:
    runner = runner_for(tiny_checkpoints, "llama", "last")
    sched = Scheduler(ServerArgs(max_total_tokens=4096, disable_overlap_schedule=True), model_runner=runner)
    first, second = prompts(2, seed=5, vocab=runner.vocab_size, shared=40)
    submit(sched, "a", first)
    a = run_until_idle(sched)["a"]
    submit(sched, "b", second)
    submit(sched, "a2", first)
    later = run_until_idle(sched)
    assert later["b"]["cached"] >= 40 and later["a2"]["cached"] >= len(first) - 1
    torch.testing.assert_close(torch.tensor(later["a2"]["embedding"]), torch.tensor(a["embedding"]), atol=1e-6, rtol=0)
    expected = reference(tiny_checkpoints.path("llama"), second, "last")
    torch.testing.assert_close(torch.tensor(later["b"]["embedding"]), expected, atol=2e-5, rtol=1e-4)
    assert_idle_invariant(sched)


@pytest.mark.parametrize("method", ["mean", "cls"])
def test_rules_that_read_the_first_tokens_serve_without_the_prefix_cache(tiny_checkpoints: Any, method: str) -> None:
    """A cached prefix has no hidden states left: mean and cls pooling turn the prefix cache off."""
    runner = runner_for(tiny_checkpoints, "llama", method)
    sched = Scheduler(ServerArgs(max_total_tokens=4096, disable_overlap_schedule=True), model_runner=runner)
    assert sched.args.disable_radix_cache
    prompt = prompts(1, seed=9, vocab=runner.vocab_size)[0]
    submit(sched, "a", prompt)
    submit(sched, "b", prompt)
    results = run_until_idle(sched)
    assert results["b"]["cached"] == 0
    expected = reference(tiny_checkpoints.path("llama"), prompt, method)
    for rid in "ab":
        torch.testing.assert_close(torch.tensor(results[rid]["embedding"]), expected, atol=2e-5, rtol=1e-4)
    assert_idle_invariant(sched)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_encoders_embed_and_score_whole_prompts_as_transformers_does(tiny_checkpoints: Any, overlap: bool) -> None:
    """The tiny BERT's folder says mean pooling, normalised (its sentence-transformers files); the
    classifiers answer their heads' logits. Prompts longer than the chunk size the flags ask for run
    whole (an encoder is never chunked), pairs with their token types, and nothing is cached."""
    from runtime.checkpoints.pooling import pooling_of
    from tests.support.checkpoints import load_hf_encoder

    for name in ("bert", "bert_classifier", "xlm_roberta_classifier"):
        path = tiny_checkpoints.path(name)
        spec = pooling_of(path)
        runner = ModelRunner(
            path, device="cpu", dtype="float32", max_total_tokens=2048, load_progress=False, pooling=spec
        )
        args = ServerArgs(max_total_tokens=2048, chunked_prefill_size=16, disable_overlap_schedule=not overlap)
        sched = Scheduler(args, model_runner=runner)
        assert sched.args.chunked_prefill_size is None and sched.args.disable_radix_cache
        batch = prompts(5, seed=11, vocab=runner.vocab_size)
        types = [None, [0] * 10 + [1] * (len(batch[1]) - 10), None, None, None] if name.startswith("bert") else None
        for i, prompt in enumerate(batch):
            sched.handle_message(
                TokenizedGenerateReq(
                    rid=f"{name}{i}",
                    input_ids=prompt,
                    sampling_params=SamplingParams(max_new_tokens=0),
                    embed=True,
                    token_type_ids=types[i] if types else None,
                )
            )
        results = run_until_idle(sched)
        hf = load_hf_encoder(path)
        for i, prompt in enumerate(batch):
            kwargs = {"token_type_ids": torch.tensor([types[i]])} if types and types[i] else {}
            with torch.no_grad():
                out = hf(torch.tensor([prompt]), **kwargs)
            if spec.classifier:
                expected = out.logits[0]
            else:
                expected = torch.nn.functional.normalize(out.last_hidden_state[0].mean(0), dim=0)
            got = torch.tensor(results[f"{name}{i}"]["embedding"])
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=f"{name} request {i}")
        assert_idle_invariant(sched)
