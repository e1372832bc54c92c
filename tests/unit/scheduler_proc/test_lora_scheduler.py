"""Multi-LoRA serving through the real scheduler and model runner: greedy output equals peft + transformers.

Each family's tiny checkpoint gets three adapters made with peft (different ranks, alphas and target
modules, one with per-module rank and alpha patterns, one rsLoRA); a batch mixes requests on each
adapter and on the base model, and every request's greedy tokens must equal peft's
``generate(do_sample=False)`` of the same adapter (the base: transformers alone). The memory
invariant holds after each run.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from runtime.config.args import ServerArgs
from runtime.config.lora_args import LoraRef
from runtime.engine.lora.manager import LoraSettings
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.lora_slots import initial_adapters
from scheduler_proc.scheduler import Scheduler
from tests.support.checkpoints import hf_greedy
from tests.support.lora_adapters import AdapterSpec, build_adapter, peft_model
from tests.support.stub_scheduler import assert_idle_invariant, run_until_idle

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
SPECS = {
    "attn8": AdapterSpec(r=8, alpha=16, targets=ATTENTION, seed=1),
    "all4": AdapterSpec(
        r=4,
        alpha=8,
        targets=ATTENTION + MLP,
        seed=2,
        rank_pattern={"layers.1.mlp.down_proj": 2},
        alpha_pattern={"v_proj": 3},
    ),
    "mlp16": AdapterSpec(r=16, alpha=4, targets=MLP, seed=3, rslora=True),
}
FUSED = {
    "phi3": {
        "attn8": ("qkv_proj", "o_proj"),
        "all4": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        "mlp16": ("gate_up_proj", "down_proj"),
    }
}
MAX_NEW = 8


def adapters_for(tiny_checkpoints: Any, family: str) -> dict[str, Path]:
    base = tiny_checkpoints.path(family)
    out = {}
    for name, spec in SPECS.items():
        targets = FUSED.get(family, {}).get(name, spec.targets)
        fixed = AdapterSpec(**{**spec.__dict__, "targets": targets})
        if family in FUSED:
            fixed = AdapterSpec(**{**fixed.__dict__, "rank_pattern": {}, "alpha_pattern": {}})
        out[name] = build_adapter(base, tiny_checkpoints.root / f"{family}-lora-{name}", fixed)
    return out


def lora_runner(path: Path, adapters: dict[str, Path], **kwargs: Any) -> tuple[ModelRunner, list[LoraRef]]:
    refs = [LoraRef(name, str(p)) for name, p in adapters.items()]
    runner = ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        max_total_tokens=4096,
        max_running_requests=16,
        load_progress=False,
        lora=LoraSettings(slots=kwargs.pop("slots", 4), initial=initial_adapters(refs), **kwargs),
    )
    return runner, refs


def submit(sched: Scheduler, rid: str, prompt: list[int], adapter: str | None, max_new: int = MAX_NEW) -> None:
    sched.handle_message(
        TokenizedGenerateReq(
            rid=rid,
            input_ids=prompt,
            sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0),
            lora_name=adapter,
        )
    )


def prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma3"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_mixed_batch_of_adapters_equals_peft(tiny_checkpoints: Any, family: str, overlap: bool) -> None:
    path = tiny_checkpoints.path(family)
    adapters = adapters_for(tiny_checkpoints, family)
    runner, refs = lora_runner(path, adapters)
    args = ServerArgs(
        max_total_tokens=4096,
        chunked_prefill_size=16,
        disable_overlap_schedule=not overlap,
        lora_paths=[f"{r.name}={r.path}" for r in refs],
        max_loras_per_batch=4,
    )
    sched = Scheduler(args, model_runner=runner)
    names: list[str | None] = [None, *adapters]
    batch = prompts(8, seed=7, vocab=runner.vocab_size)
    for i, prompt in enumerate(batch):
        submit(sched, f"r{i}", prompt, names[i % len(names)])
    results = run_until_idle(sched)
    differs = 0
    for i, prompt in enumerate(batch):
        name = names[i % len(names)]
        reference = peft_model(path, adapters[name] if name else None)
        expected, _ = hf_greedy(reference, prompt, MAX_NEW)
        assert results[f"r{i}"]["ids"] == expected, (f"r{i}", name)
        if name is not None:
            base, _ = hf_greedy(peft_model(path, None), prompt, MAX_NEW)
            differs += base != expected
    assert differs >= 2, "the adapters must change the model's output for the test to mean anything"
    assert_idle_invariant(sched)
