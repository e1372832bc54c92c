"""Each decoder layer class declares what it is made of (``LayerDescription``), and the CPU's one-call
decode stack takes a model's layers iff the C layer implements every declared choice, decided in one
place (``stack_description.c_layer_declines``). Opt-in by construction: a layer whose own class
declares nothing, a subclass that changes a layer without saying so included, never runs in one call.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.decode_layers import CpuLayerStack
from runtime.engine.cpu.stack_description import c_layer_declines
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from runtime.engine.models.llama import LlamaDecoderLayer
from runtime.engine.ops.layer_stack import LayerDescription, declared_description
from tests.support.checkpoints import MOE_CHECKPOINT_NAMES
from tests.support.harness import Harness

# family -> whether the C layer implements its tiny checkpoint's layers (gemma2: soft-capped attention;
# gemma3's four unit-offset norms, GELU and windows it runs; the sparse families: routed experts, and
# Qwen2-MoE's gated shared expert; Mixtral's window spans the whole served context: ModelConfig.layer_windows
# drops it)
TAKEN = {"llama": True, "qwen2": True, "phi3": True, "qwen3": True, "mistral": True, "gemma2": False, "gemma3": True}
TAKEN.update({"qwen3_moe": True, "olmoe": True, "mixtral": True, "qwen2_moe": True})
assert set(MOE_CHECKPOINT_NAMES) <= set(TAKEN)


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=512, load_progress=False)


class _ScaledMlpLayer(LlamaDecoderLayer):
    """A Llama layer that computes something else (its MLP output doubled) and declares nothing."""

    def forward(self, rope, hidden, residual, batch, backend):  # type: ignore[no-untyped-def]
        hidden, residual = super().forward(rope, hidden, residual, batch, backend)
        return hidden * 2, residual


class _RedeclaredLayer(LlamaDecoderLayer):
    """A Llama subclass that changes nothing it computes and says so: the parent's declaration."""

    describe = LlamaDecoderLayer.describe


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_every_family_declares_its_layers_and_the_stack_decides_from_the_declaration(
    name: str, tiny_checkpoints
) -> None:
    runner = _runner(tiny_checkpoints.path(name))
    layers = list(runner.model.decoder_layers())
    descriptions = [declared_description(layer) for layer in layers]
    assert layers and all(isinstance(d, LayerDescription) for d in descriptions), "a family's layers declare"
    stack = CpuLayerStack(runner.model)
    taken = all(d is not None and c_layer_declines(d) is None for d in descriptions)
    assert taken == TAKEN[name], (name, stack.declined)
    assert (stack.declined is None) == taken
    if not taken:
        assert stack.description(1) is None


def test_each_declared_choice_the_c_layer_lacks_is_declined() -> None:
    base = LayerDescription(
        norm="rms", norm_placement="pre", activation="silu", mlp="dense", rope_style="neox", rotary_dim=64, head_dim=64
    )
    assert c_layer_declines(base) is None
    assert c_layer_declines(dataclasses.replace(base, rotary_dim=32)) is None  # a partial rotary share is run
    gemma3 = {"norm": "rms_unit_offset", "norm_placement": "sandwich", "activation": "gelu_pytorch_tanh"}
    qwen2_moe = {"mlp": "experts", "experts_top_k": 2, "shared_expert": True}
    for change in ({"window": 4096}, {**gemma3, "qk_norm": "head", "window": 512}, qwen2_moe):  # (all run)
        assert c_layer_declines(dataclasses.replace(base, **change)) is None, change
    for change in (
        {"norm": "layer_norm"},
        {"norm_placement": "post"},
        {"activation": "gelu"},
        {"rope_style": "gptj"},
        {"attn_softcap": 50.0},
        {"o_bias": True},
        {"mlp_bias": True},
    ):
        assert c_layer_declines(dataclasses.replace(base, **change)) is not None, change
    assert c_layer_declines(dataclasses.replace(base, qkv_bias=True)) is None  # (Qwen2's biases: the C layer adds them)
    assert c_layer_declines(dataclasses.replace(base, qk_norm="head")) is None  # (Qwen3's: each q and k head normed)
    # routed experts (csrc/moe_mlp.c); OLMoE's norms over the whole q and k projections and its clamp
    assert c_layer_declines(dataclasses.replace(base, mlp="experts", experts_top_k=2)) is None
    assert c_layer_declines(dataclasses.replace(base, qk_norm="projection", qkv_clip=8.0)) is None


def test_a_subclass_that_changes_a_layer_without_saying_so_is_declined(tiny_checkpoints) -> None:
    """The same model with one layer's class swapped for a subclass that computes something else and
    declares nothing: the stack declines it (it would have run it as a plain Llama layer: wrong
    answers), and its decode steps still give the subclass's results through the layers one by one.
    The kernels' AVX2 build, which every x86 host this suite runs on has, is set for the test: the
    plain model's fp32 linears then have the panel kernel the one call runs."""
    with kernel_library.use_level("avx2"):
        _subclass_declined(tiny_checkpoints.path("llama"))


def _subclass_declined(path: Path) -> None:
    runner = _runner(path)
    assert CpuLayerStack(runner.model).description(1) is not None  # the plain model is taken
    layer = runner.model.decoder_layers()[0]
    layer.__class__ = _ScaledMlpLayer
    stack = CpuLayerStack(runner.model)
    assert stack.description(1) is None
    assert (
        stack.declined is not None
        and "_ScaledMlpLayer" in stack.declined
        and "declares no description" in stack.declined
    )

    h = Harness(runner)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    runner.layer_stack = stack
    reqs = h.prefill_sharing(prompts, 0)
    through_stack = h.step(reqs, ForwardMode.DECODE).logits.clone()
    h.reset()
    runner.layer_stack = None  # the model's layers one by one
    reqs = h.prefill_sharing(prompts, 0)
    assert torch.equal(h.step(reqs, ForwardMode.DECODE).logits, through_stack)

    layer.__class__ = _RedeclaredLayer  # a subclass that says what it is (its parent's choices) is taken
    assert CpuLayerStack(runner.model).description(1) is not None
