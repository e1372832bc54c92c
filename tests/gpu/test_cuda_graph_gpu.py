"""CUDA graphs on a GPU: greedy tokens equal eager in bf16, and a decode step never waits on the GPU.

Compiled Triton is needed here, so when this session set TRITON_INTERPRET=1 (the CPU
kernel tests do, for the whole process) the tests run in a fresh process without it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from tests.support.triton_interp import run_compiled_when_interpreting


def _runner(path: Path, **kwargs: Any) -> Any:
    from runtime.engine.model_runner import ModelRunner

    kwargs.setdefault("dtype", "bfloat16")
    return ModelRunner(
        path,
        device="cuda",
        attention_backend="triton",
        max_total_tokens=4096,
        max_running_requests=16,
        load_progress=False,
        **kwargs,
    )


def _prompts(n: int) -> list[list[int]]:
    return [[5 + i, 9, 11 + 2 * i, 3 * i + 7, 40 + i][: 2 + i % 4] for i in range(n)]


def test_graph_decode_matches_eager_in_bf16(tiny_llama_path: Path) -> None:
    from tests.support.harness import Harness

    graphs = _runner(tiny_llama_path)
    eager = _runner(tiny_llama_path, disable_cuda_graph=True)
    assert graphs.graph_runner is not None and graphs.graph_runner.replay_mode == "cuda"
    assert graphs.graph_runner.batch_sizes == [1, 2, 4, 8, 16] and eager.graph_runner is None
    replays: list[int] = []
    inner = graphs.graph_runner.replay
    graphs.graph_runner.replay = lambda batch: (replays.append(batch.batch_size), inner(batch))[1]
    with_graphs, without = Harness(graphs), Harness(eager)
    for bs in (1, 3, 5, 8, 13):  # 3, 5 and 13 run padded (to 4, 8, 16)
        want = [r.output_ids for r in without.generate(_prompts(bs), max_new_tokens=8)]
        replays.clear()
        got = [r.output_ids for r in with_graphs.generate(_prompts(bs), max_new_tokens=8)]
        assert got == want, f"batch {bs}"
        assert replays == [bs] * 7
        with_graphs.reset()
        without.reset()


def test_decode_step_syncs_only_to_read_its_tokens(tiny_llama_path: Path) -> None:
    """The forward queues work and returns; reading the sampled ids is the step's one sync."""
    from runtime.engine.forward_batch import ForwardMode
    from tests.support.harness import Harness

    runner = _runner(tiny_llama_path)
    harness = Harness(runner)
    reqs = [harness.add_request(p) for p in _prompts(3)]
    harness.prefill(reqs)
    for _ in range(2):
        batch, _ = harness.build_batch(reqs, ForwardMode.DECODE)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = runner.forward(batch)
                in_forward = len(caught)
                ids = out.next_token_ids.tolist()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert in_forward == 0, [str(w.message) for w in caught]
        assert len(caught) == 1, [str(w.message) for w in caught]
        for req, token in zip(reqs, ids):
            req.output_ids.append(token)


def test_moe_decode_is_captured_and_matches_eager_and_transformers(tiny_checkpoints: Any) -> None:
    """Mixtures of experts (the fused expert kernel on stacked experts) decode in CUDA graphs: bf16
    tokens equal eager's; in fp32 both equal transformers' greedy ``generate``."""
    from tests.support.checkpoints import hf_greedy, load_hf_model
    from tests.support.harness import Harness

    for name in ("qwen3_moe", "mixtral"):
        path = tiny_checkpoints.path(name)
        graphs, eager = _runner(path), _runner(path, disable_cuda_graph=True)
        assert graphs.graph_runner is not None, name
        for bs in (1, 3, 8):
            want = [r.output_ids for r in Harness(eager).generate(_prompts(bs), max_new_tokens=8)]
            assert [r.output_ids for r in Harness(graphs).generate(_prompts(bs), max_new_tokens=8)] == want
        fp32 = _runner(path, dtype="float32")
        hf = load_hf_model(path)
        prompts = _prompts(4)
        got = [r.output_ids for r in Harness(fp32).generate(prompts, max_new_tokens=8)]
        assert got == [hf_greedy(hf, p, 8)[0] for p in prompts], name


run_compiled_when_interpreting(globals(), __file__)
