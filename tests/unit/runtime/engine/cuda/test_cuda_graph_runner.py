"""CudaGraphRunner on CPU: padding, static buffers and the two-step attention plan in eager replay.

``replay="eager"`` runs the model on the graph runner's static buffers where a GPU would
call ``graph.replay()``, so everything but the capture itself is exercised here: the
Triton backend under TRITON_INTERPRET=1 in fp32 on the tiny Llama. Triton picks its mode
when first imported, so this module sets the variable before anything imports it and
falls back to a fresh process when triton was already loaded compiled (see triton_interp).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, see the module docstring

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.engine.cuda.triton_common import triton_loaded_interpreted  # noqa: E402
from runtime.engine.ops.linear_weights import LinearWeightLayer

IN_PROCESS = "triton" not in sys.modules or triton_loaded_interpreted()

from runtime.engine.cpu import prepacked  # noqa: E402
from runtime.engine.cuda import graph_runner as cgr  # noqa: E402
from runtime.engine.cuda.attention import TritonAttnBackend  # noqa: E402
from runtime.engine.cuda.attention_kernels import decode_attention as decode_mod  # noqa: E402
from runtime.engine.forward_batch import ForwardMode  # noqa: E402
from runtime.engine.model_runner import ModelRunner  # noqa: E402
from runtime.protocol.sampling_params import SamplingParams  # noqa: E402
from tests.support.harness import Harness  # noqa: E402
from tests.support.triton_interp import replace_tests_with_fresh_process_run  # noqa: E402

SIZES = [1, 2, 4, 8]


def _runner(path: Path, backend: str = "triton") -> ModelRunner:
    return ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        max_total_tokens=1024,
        max_running_requests=16,
        load_progress=False,
    )


def _prompts(n: int) -> list[list[int]]:
    return [[5 + i, 9, 11 + 2 * i, 3 * i + 7][: 2 + i % 3] for i in range(n)]


class ReplaySpy:
    """Counts replays per (batch size, padded size) by wrapping ``CudaGraphRunner.replay``."""

    def __init__(self, graph_runner: cgr.CudaGraphRunner) -> None:
        self.calls: list[tuple[int, int]] = []
        inner = graph_runner.replay

        def replay(batch: Any) -> torch.Tensor:
            self.calls.append((batch.batch_size, graph_runner.padded_size(batch.batch_size)))
            return inner(batch)

        graph_runner.replay = replay  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    return _runner(tiny_llama_path)


def test_eager_replay_greedy_equals_plain_eager(runner: ModelRunner) -> None:
    """Batch sizes on and between captured sizes (1, 3 -> 4, 5 -> 8): same tokens as without the runner."""
    graphs = cgr.setup_cuda_graphs(runner, batch_sizes=SIZES, replay="eager")
    assert graphs is not None and graphs.batch_sizes == SIZES
    spy = ReplaySpy(graphs)
    harness = Harness(runner)
    for bs in (1, 3, 5):
        harness.reset()
        runner.graph_runner = None
        expected = [r.output_ids for r in harness.generate(_prompts(bs), max_new_tokens=4)]
        harness.reset()
        runner.graph_runner = graphs
        spy.calls.clear()
        got = [r.output_ids for r in harness.generate(_prompts(bs), max_new_tokens=4)]
        assert got == expected, f"batch {bs}"
        assert spy.calls == [(bs, graphs.padded_size(bs))] * 3, "every decode step must go through the runner"
    runner.graph_runner = None
    harness.reset()


def test_replayed_decode_still_applies_a_logit_bias(runner: ModelRunner) -> None:
    """A replay computes logits only: a biased request's decode steps still reach the sampler, and the
    unbiased request beside it writes what it writes without graphs."""
    harness = Harness(runner)
    runner.graph_runner = None
    plain = harness.generate(_prompts(2)[1:], max_new_tokens=4)[0].output_ids
    harness.reset()
    forced = next(t for t in range(3, runner.vocab_size) if t not in plain)
    graphs = cgr.setup_cuda_graphs(runner, batch_sizes=[1, 2], replay="eager")
    assert graphs is not None
    spy = ReplaySpy(graphs)
    runner.graph_runner = graphs
    try:
        params = [SamplingParams(temperature=0.0, logit_bias={str(forced): 100.0}), SamplingParams(temperature=0.0)]
        got = [r.output_ids for r in harness.generate(_prompts(2), max_new_tokens=4, sampling_params=params)]
    finally:
        runner.graph_runner = None
        harness.reset()
    assert spy.calls == [(2, 2)] * 3, "every decode step must go through the runner"
    assert got == [[forced] * 4, plain]


@pytest.mark.parametrize("name", ["qwen2_swa", "gemma2", "gemma3", "phi3_longrope"])
def test_eager_replay_of_the_families_beyond_llama(tiny_checkpoints: Any, name: str) -> None:
    """A model served by a scheduler whose decode goes through the graph runner; same tokens as
    torch_native without graphs. The hybrid ones (Qwen2, Gemma: windowed layers in the SWA pool)
    have their per-window plan buffers rewritten in place and translated to SWA slots at every
    replay; Gemma 2 adds the soft-caps, Gemma 3 its windowed layers' own RoPE made inside the
    replayed forward, Phi-3 (not windowed) the LongRoPE table's rows chosen from the static batch."""
    from tests.support.checkpoints import random_prompt
    from tests.support.stub_scheduler import generate_greedy

    path = tiny_checkpoints.path(name)
    prompts = [random_prompt(n, 384, seed=n) for n in (30, 41, 27)]
    outputs = {}
    for backend in ("torch_native", "triton"):
        runner = ModelRunner(
            path,
            device="cpu",
            dtype="float32",
            attention_backend=backend,
            max_total_tokens=512,
            max_running_requests=8,
            swa_full_tokens_ratio=0.5,
            load_progress=False,
        )
        spy = None
        if backend == "triton":
            runner.graph_runner = cgr.setup_cuda_graphs(runner, batch_sizes=[4], replay="eager")
            assert runner.graph_runner is not None
            spy = ReplaySpy(runner.graph_runner)
        outputs[backend] = generate_greedy(runner, prompts, 8, chunked_prefill_size=16)
        if spy is not None:
            assert len(spy.calls) >= 6, "the decode steps go through the graph runner"
    assert outputs["triton"] == outputs["torch_native"]


def test_padded_rows_write_only_the_padding_slot(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of 3 in the graph of 4: the KV pool and req_to_token end up as after eager, but for slot 0."""
    # Padding changes the row count, and on CPU an fp32 linear's kernel (and, in MKL's sgemm, the
    # order of its sums) depends on it. The panel kernel's rows do not depend on the batch: with
    # every decode-sized call on it, real rows of eager and of the padded replay can be compared
    # bit for bit (where the kernel runs: a vector build, widths it takes).
    monkeypatch.setattr(prepacked, "FP32_PANEL_MIN_ROWS", dict.fromkeys(prepacked.FP32_PANEL_MIN_ROWS, 1))
    runner.ops.prepare_model(runner.model)  # the plans' bands as of the band above
    copy = prepacked.pack_weight(torch.zeros(32, 32))
    if copy is None or prepacked.panel_linear(torch.zeros(1, 32), copy.tensor, None, 32) is None:
        for layer in runner.model.modules():  # no panel kernel here: F.linear everywhere, one GEMM kind per call
            if isinstance(layer, LinearWeightLayer):
                monkeypatch.setattr(layer, "plan", None)
    graphs = cgr.CudaGraphRunner(runner, SIZES, replay="eager")
    graphs.capture()
    harness = Harness(runner)
    reqs = [harness.add_request(p) for p in _prompts(3)]
    harness.prefill(reqs)
    pool = runner.token_to_kv_pool
    # a previous, larger batch left real rows in the static columns the padding now owns
    graphs.inputs.rows[:, 3].fill_(5)
    batch, _ = harness.build_batch(reqs, ForwardMode.DECODE)
    before = [t.clone() for t in pool.k_buffer + pool.v_buffer]
    table_before = runner.req_to_token_pool.req_to_token.clone()

    expected = cgr.eager_forward(runner, batch)
    eager_kv = [t.clone() for t in pool.k_buffer + pool.v_buffer]
    for buf, saved in zip(pool.k_buffer + pool.v_buffer, before):
        buf.copy_(saved)
    written: list[list[int]] = []
    store = runner.ops.store_kv  # the backend writes K/V through the runner's device ops
    monkeypatch.setattr(
        runner.ops,
        "store_kv",
        lambda pool_, layer_id, loc, k, v: (written.append(loc.tolist()), store(pool_, layer_id, loc, k, v))[1],
    )
    got = graphs.replay(batch)

    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got.shape[0] == 3
    assert written == [batch.out_cache_loc.tolist() + [cgr.PAD_SLOT]] * runner.model_config.num_hidden_layers
    assert torch.equal(graphs.inputs.rows[:, 3], graphs.inputs.pad[:, 0]), "padding column not reset"
    for buf, eager in zip(pool.k_buffer + pool.v_buffer, eager_kv):
        assert torch.equal(buf[1:], eager[1:]), "a real slot differs from the eager step"
    assert torch.equal(runner.req_to_token_pool.req_to_token, table_before)
    harness.reset()


def test_replay_plan_equals_the_eager_plan(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture-then-replay planning writes the same kv_indptr/kv_indices/num_kv_splits as the eager plan."""
    monkeypatch.setattr(decode_mod, "device_core_count", lambda device: 132)  # a GPU's split-K plan
    backend = runner.attn_backend
    assert isinstance(backend, TritonAttnBackend) and backend.supports_cuda_graph
    graphs = cgr.CudaGraphRunner(runner, [4], replay="eager")
    graphs.capture()
    harness = Harness(runner)
    reqs = [harness.add_request(list(range(10, 10 + n))) for n in (40, 3, 17, 25)]
    harness.prefill(reqs)
    batch, _ = harness.build_batch(reqs, ForwardMode.DECODE)
    backend.init_forward_metadata(batch)
    eager = batch.attn_metadata
    graphs.inputs.load(batch, 4)
    static = graphs.batches[4]
    static.seq_lens_cpu = list(batch.seq_lens_cpu)
    backend.init_forward_metadata_replay_cuda_graph(static)
    meta = static.attn_metadata
    total = sum(batch.seq_lens_cpu)
    assert torch.equal(meta.kv_indptr, eager.kv_indptr)
    assert torch.equal(meta.kv_indices[:total], eager.kv_indices)
    assert torch.equal(meta.num_kv_splits, eager.num_kv_splits) and int(meta.num_kv_splits.max()) > 1
    assert meta.attn_logits.data_ptr() == backend._graph_state.attn_logits.data_ptr()  # the fixed buffers
    harness.reset()


def test_self_check_mismatch_logs_and_serves_eager(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    inner = cgr.CudaGraphRunner.replay
    monkeypatch.setattr(cgr.CudaGraphRunner, "replay", lambda self, batch: inner(self, batch) + 0.5)
    table = runner.req_to_token_pool.req_to_token
    table[:3] = 7  # the self-check borrows rows 0..2 (free at start-up) and must clear them again
    with caplog.at_level(logging.INFO, logger="runtime.engine.cuda.graph_runner"):
        assert cgr.setup_cuda_graphs(runner, batch_sizes=SIZES, replay="eager") is None
    failed = [r for r in caplog.records if "self-check failed" in r.getMessage()]
    assert failed and failed[0].levelno == logging.WARNING
    assert "batch 3 padded to 4" in failed[0].getMessage() and "serving eager" in failed[0].getMessage()
    assert not table[:3].any(), "the self-check must give back its request rows cleared"
    runner.graph_runner = None  # what ModelRunner keeps after a failed check: eager still serves
    harness = Harness(runner)
    out = harness.generate(_prompts(3), max_new_tokens=2)
    assert all(len(r.output_ids) == 2 for r in out)
    harness.reset()


def test_capture_error_falls_back_to_eager(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: Any, batch: Any) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(TritonAttnBackend, "init_forward_metadata_capture_cuda_graph", broken)
    with caplog.at_level(logging.WARNING, logger="runtime.engine.cuda.graph_runner"):
        assert cgr.setup_cuda_graphs(runner, batch_sizes=SIZES, replay="eager") is None
    assert "capture failed: operation not permitted" in caplog.text


def test_out_of_memory_captures_what_fits(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Capture that runs out of memory retries with the largest size halved (16 -> 8 -> 4 here)."""
    inner = cgr.CudaGraphRunner.capture

    def capture(self: cgr.CudaGraphRunner) -> None:
        if self.max_bs > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        inner(self)

    monkeypatch.setattr(cgr.CudaGraphRunner, "capture", capture)
    with caplog.at_level(logging.INFO, logger="runtime.engine.cuda.graph_runner"):
        graphs = cgr.setup_cuda_graphs(runner, replay="eager")  # default sizes up to max_running_requests 16
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4]
    assert "retrying up to 8" in caplog.text and "retrying up to 4" in caplog.text
    monkeypatch.setattr(
        cgr.CudaGraphRunner, "capture", lambda self: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory"))
    )
    with caplog.at_level(logging.WARNING, logger="runtime.engine.cuda.graph_runner"):
        assert cgr.setup_cuda_graphs(runner, replay="eager") is None
    assert "out of memory capturing batch size 1" in caplog.text and "serving eager" in caplog.text


def test_unsupported_setups_say_why(tiny_llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    native = _runner(tiny_llama_path, backend="torch_native")
    with caplog.at_level(logging.INFO, logger="runtime.engine.cuda.graph_runner"):
        assert cgr.setup_cuda_graphs(native, replay="eager") is None
        assert cgr.setup_cuda_graphs(native, replay="cuda") is None
    assert "torch_native attention backend cannot run in a graph" in caplog.text
    assert "device is cpu" in caplog.text
    assert native.graph_runner is None  # ModelRunner never sets graphs up on cpu


def test_can_run_only_decode_batches_that_fit(runner: ModelRunner) -> None:
    graphs = cgr.CudaGraphRunner(runner, [1, 2], replay="eager")
    graphs.capture()
    harness = Harness(runner)
    reqs = [harness.add_request(p) for p in _prompts(5)]
    extend, _ = harness.build_batch(reqs, ForwardMode.EXTEND)
    assert not graphs.can_run(extend)
    runner.forward(extend)
    for r in reqs:  # the extend ran every prompt token: each request now has its first output pending
        r.output_ids.append(1)
    assert not graphs.can_run(harness.build_batch(reqs[:3], ForwardMode.DECODE)[0])  # 3 > largest size 2
    two, _ = harness.build_batch(reqs[3:], ForwardMode.DECODE)
    assert graphs.can_run(two)
    two.seq_lens_cpu = []  # no host lengths: planning would need a device sync, so run eagerly
    assert not graphs.can_run(two)
    harness.reset()


if not IN_PROCESS:
    replace_tests_with_fresh_process_run(globals(), __file__)
