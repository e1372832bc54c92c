"""A GGUF file's blocks alone (``--quantization gguf``) with a long prefill in bf16 where the CPU has
native bf16 matmul (``quant.loading.bf16_prefill``): the rule follows the CPU class it is given, never
the host's; the runner marks every kept weight by it (``QuantizedWeight.bf16_prefill``); and a long
prefill's greedy tokens are gguf_dual's (whose prefill multiplies its dense bf16 values), on a Q8_0
file and on a Q4_K_M-like mix of Q4_K and Q6_K bands with Qwen2's biases. (The product itself against
its bf16 reference: tests/unit/runtime/engine/cpu/test_quant_kernels.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from runtime.engine.cpu.quant_kernels import BF16_DENSE_MIN_ROWS, DENSE_MIN_ROWS
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from runtime.engine.quant.loading import bf16_prefill
from runtime.engine.quant.weight import KEPT_WEIGHTS, KeptWeight
from tests.support.checkpoints import TinyCheckpoints, random_prompt
from tests.support.gguf_files import gguf_test_folder, write_checkpoint_gguf
from tests.support.harness import Harness

CPU = torch.device("cpu")
PROMPTS = 7  # of 40 to 46 tokens: one prefill batch of more than DENSE_MIN_ROWS rows


@pytest.fixture(scope="module")
def files(tiny_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with gguf_test_folder(tmp_path_factory, "quant-bf16-prefill") as folder:
        yield folder


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU class the runner decides by: native bf16 matmul, no AMX (this file's subject)."""
    from runtime.engine import model_runner

    monkeypatch.setattr(model_runner, "cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(model_runner, "cpu_has_amx", lambda: False)


def _file(tiny_checkpoints: TinyCheckpoints, files: Path, weight_type: str) -> Path:
    """A Q8_0 llama, or a Qwen2 (q/k/v biases) of 256-wide rows in Q4_K with Q4_K_M's Q6_K v (bands)."""
    name, types = ("llama", {}) if weight_type == "Q8_0" else ("qwen2_hd64", {"blk.0.attn_v.weight": "Q6_K"})
    return write_checkpoint_gguf(
        tiny_checkpoints.path(name), files / f"{name}-{weight_type}.gguf", weight_type=weight_type, types=types
    )


def _runner(path: Path, dtype: str, quantization: str) -> ModelRunner:
    return ModelRunner(
        path, device="cpu", dtype=dtype, quantization=quantization, max_total_tokens=2048, load_progress=False
    )


def _kept(runner: ModelRunner) -> list[KeptWeight]:
    return [m for m in runner.model.modules() if isinstance(m, KEPT_WEIGHTS)]


@pytest.mark.parametrize(
    ("method", "dtype", "device", "native", "expected"),
    [
        ("gguf", "auto", CPU, True, True),
        ("gguf", "auto", CPU, False, False),  # emulated bf16: the fp32 product is faster and exact
        ("gguf", "float32", CPU, True, False),  # a dtype asked for (the oracle's fp32)
        ("gguf", "bfloat16", CPU, True, False),
        ("gguf_dual", "auto", CPU, True, False),  # its prefills read its dense values
        ("int8", "auto", CPU, True, False),
        (None, "auto", CPU, True, False),
        ("gguf", "auto", torch.device("meta"), True, False),  # (not a CPU)
    ],
)
def test_the_rule_follows_the_cpu_class_given(
    method: str | None, dtype: str, device: torch.device, native: bool, expected: bool
) -> None:
    assert bf16_prefill(method, dtype, device, native) is expected


@pytest.mark.parametrize("native", [False, True])
def test_the_runner_marks_every_kept_weight_by_the_rule(
    tiny_checkpoints: TinyCheckpoints, files: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    from runtime.engine import model_runner

    monkeypatch.setattr(model_runner, "cpu_supports_bf16", lambda: native)
    path = _file(tiny_checkpoints, files, "Q8_0")
    runner = _runner(path, "auto", "gguf")
    assert runner.bf16_prefill is native and runner.dtype == (torch.bfloat16 if native else torch.float32)
    assert _kept(runner) and all(w.bf16_prefill is native for w in _kept(runner))
    assert ("long prefills in bf16" in runner.weight_info()["activations"]) is native
    exact = _runner(path, "float32", "gguf")  # the oracle's dtype keeps the fp32 product everywhere
    assert not exact.bf16_prefill and not any(w.bf16_prefill for w in _kept(exact))


def _prefill(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[int], torch.Tensor]:
    """Each prompt's greedy next token and the logits, the prompts prefilled as one batch."""
    h = Harness(runner)
    reqs = [h.add_request(prompt) for prompt in prompts]
    logits = h.step(reqs, ForwardMode.EXTEND).logits.float().clone()
    h.reset()
    return [req.output_ids[0] for req in reqs], logits


@pytest.mark.usefixtures("native_bf16")
@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K"])
def test_a_long_prefills_greedy_tokens_are_gguf_duals(
    tiny_checkpoints: TinyCheckpoints, files: Path, weight_type: str
) -> None:
    """A prefill of more than ``DENSE_MIN_ROWS`` rows, so every linear's product is the long one: the
    blocks-only model's greedy tokens are gguf_dual's wherever gguf_dual's top two logits lie further
    apart than its own error against the fp32 dense model (nearer, the two are a tie within bf16's
    rounding, which either may break); its logits are the bf16 product's (the same runner with the mark
    cleared answers otherwise) and no further from the fp32 dense model's than gguf_dual's (which
    rounds its activations to bf16 too). (Only the prefill's tokens: the decode steps that follow
    differ by design, the blocks' bf16 kernel against gguf_dual's.)"""
    path = _file(tiny_checkpoints, files, weight_type)
    blocks, dual = _runner(path, "auto", "gguf"), _runner(path, "auto", "gguf_dual")
    assert blocks.bf16_prefill and dual.quantization == "gguf_dual" and dual.dtype == torch.bfloat16
    prompts = [random_prompt(40 + i, blocks.vocab_size, seed=70 + i) for i in range(PROMPTS)]
    assert sum(map(len, prompts)) >= DENSE_MIN_ROWS
    tokens, logits = _prefill(blocks, prompts)
    want, dual_logits = _prefill(dual, prompts)
    _, oracle = _prefill(_runner(path, "float32", "none"), prompts)
    dual_error = float((dual_logits - oracle).abs().max())
    assert float((logits - oracle).abs().max()) <= dual_error
    top2 = dual_logits.topk(2).values
    clear = (top2[:, 0] - top2[:, 1] > 2 * dual_error).tolist()
    assert sum(clear) >= PROMPTS // 2, clear  # (most rows decide: the comparison is not empty)
    assert [t for t, c in zip(tokens, clear) if c] == [t for t, c in zip(want, clear) if c]
    for weight in _kept(blocks):
        weight.bf16_prefill = False
    _, fp32_logits = _prefill(blocks, prompts)
    assert not torch.equal(logits, fp32_logits)


@pytest.mark.usefixtures("native_bf16")
def test_blocks_take_few_rows_in_bf16_and_more_rows_the_dequantized_weight(
    tiny_checkpoints: TinyCheckpoints, files: Path
) -> None:
    """With native bf16, auto's blocks-only model runs bf16 activations: every kept weight's plan gives
    its blocks the rows below ``BF16_DENSE_MIN_ROWS`` (the few-row kernels, which the one-call decode
    stack's qbf16 set runs) and more rows the weight dequantized to bf16 (no set's linear: the stack
    declines such a step and the layers run it, on the same record)."""
    from runtime.engine.cpu.weight_plan import layer_plan
    from runtime.engine.ops.linear_weights import LinearWeightLayer

    runner = _runner(_file(tiny_checkpoints, files, "Q4_K"), "auto", "gguf")
    assert runner.dtype == torch.bfloat16
    plans = [layer_plan(m) for m in runner.model.modules() if isinstance(m, LinearWeightLayer)]
    kept = [p for p in plans if p is not None and isinstance(p.weight, KEPT_WEIGHTS)]
    assert kept
    for plan in kept:
        assert plan.band(BF16_DENSE_MIN_ROWS - 1, torch.bfloat16).kernel == "blocks"
        assert plan.band(BF16_DENSE_MIN_ROWS, torch.bfloat16).kernel == "dequantized_bf16"
    stack = runner.layer_stack
    assert stack is not None
    few = stack.description(BF16_DENSE_MIN_ROWS - 1)
    assert few is not None and few.kernels == "qbf16"
    assert stack.description(BF16_DENSE_MIN_ROWS) is None
    last = BF16_DENSE_MIN_ROWS - 1
    assert runner.kernels["decode_stack"] == f"qbf16 up to {last} rows, layer by layer above", runner.kernels
