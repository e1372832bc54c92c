"""The one-call CPU decode stack with LoRA adapters (csrc/decode_layers.c calling csrc/lora.c): decode
steps whose requests use adapters run in the call, bit for bit the layers run one by one (whose adapted
linears add the same kernel's products), in fp32 and bf16; and fp32 greedy tokens equal peft's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from runtime.config.lora_args import LoraRef
from runtime.engine.cpu import decode_layers
from runtime.engine.forward_batch import ForwardBatch, ForwardMode, LoraBatch
from runtime.engine.lora.manager import LoraSettings
from runtime.engine.model_runner import ModelRunner
from scheduler_proc.lora_slots import initial_adapters
from tests.support.checkpoints import hf_greedy, random_prompt
from tests.support.harness import Harness, HarnessRequest
from tests.support.lora_adapters import AdapterSpec, build_adapter, peft_model
from tests.unit.runtime.engine.cpu.test_cpu_decode_layers import DTYPES, needs_fp32_kernels

SPECS = {
    "attn": AdapterSpec(r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=31),
    "all": AdapterSpec(
        r=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=32
    ),
}
SLOTS = [-1, 0, 1, 0, -1]  # the requests' adapter slots (slot 0: "attn", slot 1: "all"; -1: the base)


class LoraHarness(Harness):
    """The test harness with each request's adapter slot in every batch (adapters written once)."""

    def __init__(self, runner: ModelRunner, uids: Sequence[str]) -> None:
        super().__init__(runner)
        self.pending_loads = list(enumerate(uids))
        self.slot_of: dict[int, int] = {}

    def build_batch(self, reqs: Sequence[HarnessRequest], *args: Any, **kwargs: Any) -> tuple[ForwardBatch, list[int]]:
        batch, counts = super().build_batch(reqs, *args, **kwargs)
        batch.lora = LoraBatch(slots=[self.slot_of[r.rid] for r in reqs], loads=self.pending_loads)
        self.pending_loads = []
        return batch, counts


def lora_runner(tiny_checkpoints: Any, dtype: str) -> tuple[ModelRunner, dict[str, Path]]:
    base = tiny_checkpoints.path("llama")
    paths = {name: build_adapter(base, tiny_checkpoints.root / f"stack-lora-{name}", s) for name, s in SPECS.items()}
    initial = initial_adapters([LoraRef(name, str(path)) for name, path in paths.items()])
    runner = ModelRunner(
        base,
        device="cpu",
        dtype=dtype,
        max_total_tokens=8192,
        load_progress=False,
        lora=LoraSettings(slots=4, initial=initial),
    )
    return runner, paths


def run_steps(runner: ModelRunner, one_call: bool, steps: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    h = LoraHarness(runner, list(runner.lora.adapters) if runner.lora is not None else [])
    prompts = [random_prompt(3 + 4 * i, runner.vocab_size, seed=90 + i) for i in range(len(SLOTS))]
    reqs = [h.add_request(p) for p in prompts]
    h.slot_of = {r.rid: slot for r, slot in zip(reqs, SLOTS)}
    h.prefill(reqs)
    logits = []
    with decode_layers.use_decode_layers(one_call):
        for _ in range(steps):
            logits.append(h.step(reqs, ForwardMode.DECODE).logits.clone())
    outputs = [list(r.output_ids) for r in reqs]
    h.reset()
    return logits, outputs


@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_with_adapters_run_in_the_call_bit_for_bit(
    tiny_checkpoints: Any, dtype: str, one_call_runs: list[bool]
) -> None:
    runner, _ = lora_runner(tiny_checkpoints, dtype)
    steps = 5
    layered, _ = run_steps(runner, False, steps)
    one_call_runs.clear()
    in_call, _ = run_steps(runner, True, steps)
    assert one_call_runs[-(steps - 1) :] == [True] * (steps - 1), one_call_runs  # (the first builds the mirror)
    for step, (a, b) in enumerate(zip(layered, in_call)):
        assert torch.equal(a, b), f"decode step {step} differs"


@needs_fp32_kernels
def test_fp32_greedy_tokens_through_the_call_equal_peft(tiny_checkpoints: Any, one_call_runs: list[bool]) -> None:
    runner, paths = lora_runner(tiny_checkpoints, "float32")
    steps = 6
    _, outputs = run_steps(runner, True, steps)
    assert any(one_call_runs), "no decode step ran in the call"
    names = list(paths)
    base = tiny_checkpoints.path("llama")
    prompts = [random_prompt(3 + 4 * i, runner.vocab_size, seed=90 + i) for i in range(len(SLOTS))]
    for prompt, slot, output in zip(prompts, SLOTS, outputs):
        reference = peft_model(base, paths[names[slot]] if slot >= 0 else None)
        assert output == hf_greedy(reference, prompt, steps + 1)[0], slot
