"""The engine's weight reload in place (runtime/engine/loading/weight_reload.py) below the scheduler:
which config differences make another model, and the device copies a reload must keep or remake:
the CPU's packed copies are made again, and cuda's stacked experts (which captured CUDA graphs read)
stay the same tensors, the reload written through into them. The scheduler's side, and the model's
outputs against transformers, are tests/unit/scheduler_proc/test_weight_update.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.engine.cuda.ops import TritonOps
from runtime.engine.loading.weight_reload import WeightReloadError, check_reload, config_difference
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from runtime.engine.ops.experts import ExpertLayer
from tests.support.checkpoints import perturbed_copy


def test_only_what_does_not_shape_the_model_may_differ(tiny_checkpoints: Any) -> None:
    config = ModelConfig.from_pretrained(tiny_checkpoints.path("llama"))
    same = dataclasses.replace(config, path=Path("/elsewhere"), eos_token_ids=[7], checkpoint_dtype="bfloat16")
    assert config_difference(config, same) is None
    eps = dataclasses.replace(config, rms_norm_eps=config.rms_norm_eps * 2)
    assert (
        config_difference(config, eps)
        == f"its rms_norm_eps is {eps.rms_norm_eps!r}, the served model's {config.rms_norm_eps!r}"
    )
    rope = dataclasses.replace(config, rope=dataclasses.replace(config.rope, theta=1.0))
    assert (config_difference(config, rope) or "").startswith("its rope is")
    # a family's own keys shape its model too (Gemma 2's final soft-cap): compared by value
    gemma = ModelConfig.from_pretrained(tiny_checkpoints.path("gemma2"))
    assert gemma.family_config is not None
    copied = dataclasses.replace(gemma, family_config=dataclasses.replace(gemma.family_config))
    assert config_difference(gemma, copied) is None
    recapped = ModelConfig.from_dict({**gemma.raw, "final_logit_softcapping": 5.0}, gemma.path)
    assert (config_difference(gemma, recapped) or "").startswith("its family_config is")


def test_a_quantized_server_refuses_a_reload(tiny_checkpoints: Any) -> None:
    runner: Any = type("Runner", (), {"quantization": "int8"})()
    with pytest.raises(WeightReloadError, match="--quantization int8"):
        check_reload(runner, Path(tiny_checkpoints.path("llama")), None)


def test_stacked_experts_stay_the_same_tensors_across_a_reload(tiny_checkpoints: Any, tmp_path: Path) -> None:
    path = Path(tiny_checkpoints.path("qwen3_moe"))
    runner = ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=256, load_progress=False)
    ops = TritonOps()  # (cuda's ops; stacking itself needs no device)
    layers = [m for m in runner.model.modules() if isinstance(m, ExpertLayer)]
    ops.prepare_model(runner.model)
    stacks = {layer: ops._stacked[layer] for layer in layers}
    first = layers[0]
    before = first.expert_weights(first.local_experts[0])[0].detach().clone()
    runner.ops = ops  # (the reload remakes the device copies through these ops)
    runner.update_weights_from_disk(perturbed_copy(path, tmp_path / "moe_b", seed=3))
    for layer in layers:
        assert ops._stacked[layer] is stacks[layer]  # what a captured graph reads...
    gate_up = first.expert_weights(first.local_experts[0])[0]
    assert not torch.equal(gate_up, before)
    assert torch.equal(stacks[first].w13[0], gate_up)  # ...holds the new weights
