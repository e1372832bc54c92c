"""A bf16 linear whose every product its CPU plan runs on the packed copy (our dot-product or AMX kernels
for a decode batch's rows, oneDNN's for the rest) lets that copy hold its only values
(``LinearWeightLayer.release_values``): the layer's tensor keeps its shape over one element, the
weights' bytes drop by the copy's, the values read back from the copy are the checkpoint's bit for bit,
a product off the plan raises instead of reading the released tensor, and a dropped plan (a reload
writing the weight) gives the values back, after which the layer plans and releases again with the
same results. oneDNN packs for our kernels only on CPUs with AVX512-BF16 or AMX: elsewhere nothing is
released, which the test checks too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.engine.cpu.prepacked import PackedCopy
from runtime.engine.cpu.weight_plan import layer_plan
from runtime.engine.model_runner import ModelRunner
from runtime.engine.ops.linear_weights import LinearWeightLayer, values_released


def _linears(runner: ModelRunner) -> dict[str, LinearWeightLayer]:
    return {n: m for n, m in runner.model.named_modules() if isinstance(m, LinearWeightLayer)}


def _ours_read_the_copy(layer: LinearWeightLayer) -> bool:
    plan = layer_plan(layer)
    return plan is not None and any(
        band.kernel in ("amx", "dp") and isinstance(band.operand, PackedCopy) for band in plan.bands
    )


def test_a_packed_copy_holds_the_only_values(tiny_llama_path: Path) -> None:
    runner = ModelRunner(tiny_llama_path, device="cpu", dtype="bfloat16", max_total_tokens=2048, load_progress=False)
    linears = _linears(runner)
    released = {n: m for n, m in linears.items() if values_released(m.weight)}
    assert all(_ours_read_the_copy(m) for m in released.values())
    assert all(n in released or not _ours_read_the_copy(m) or getattr(m, "tied_to", None) for n, m in linears.items())
    if not released:
        pytest.skip("needs AVX512-BF16 or AMX: oneDNN packs bf16 weights for our kernels only there")
    stored = load_file(str(tiny_llama_path / "model.safetensors"))
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert "model.layers.0.self_attn.qkv_proj" in released
    prefix = "model.layers.0.self_attn."
    want = torch.cat([stored[prefix + f"{p}_proj.weight"] for p in "qkv"]).bfloat16()
    assert torch.equal(qkv.weight_values(), want)
    assert qkv.weight.untyped_storage().nbytes() == 2  # (one element)
    x = torch.randn(3, qkv.weight.shape[1]).bfloat16()
    planned = runner.ops.linear(x, qkv.weight, None, qkv.plan)
    with pytest.raises(RuntimeError, match="packed copy"):
        runner.ops.linear(x, qkv.weight, None, None)  # (no plan: would have read the released tensor)
    qkv.drop_plan()  # as a weight loader does before writing
    assert not values_released(qkv.weight) and torch.equal(qkv.weight, want)
    runner.ops.prepare_model(runner.model)
    assert values_released(qkv.weight) and torch.equal(runner.ops.linear(x, qkv.weight, None, qkv.plan), planned)
    dense = sum(m.weight_values().numel() * 2 for m in released.values())
    assert runner.resident_weight_bytes() >= runner.weight_bytes() + dense  # (the copies are counted once, there)
