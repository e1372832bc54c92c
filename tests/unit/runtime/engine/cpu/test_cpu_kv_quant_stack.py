"""The one-call CPU decode stack over a quantized KV cache (csrc/decode_layers.c calling csrc/kv_quant.c and
csrc/attention_q8.c): decode steps run in the call, their logits bit for bit the layers' run one by one (the same
quantizing store, the same kernel over the same quantized mirror), for llama and qwen2, int8 and fp8, bf16 and fp32
models, with a shared prefix (the prefix kernel on its dequantized copy, then the quantized kernel) and a
speculative verify step; the kernel report names the cache's format and what reads it; and the whole C path gives
the torch reference path's tokens (``TINYSERVE_CPU_KERNELS=0``: the pool's own store, the dequantizing reads) on the
same quantized cache, logprobs within float rounding.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.engine.cpu import decode_layers, kernel_library
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import random_prompt
from tests.support.harness import Harness
from tests.unit.runtime.engine.cpu.test_cpu_decode_layers import DTYPES, needs_fp32_kernels
from tests.unit.runtime.engine.cpu.test_cpu_verify_one_call import _fed_logits, _same, _start, _verify

KV_FORMATS = ["int8", "fp8_e4m3"]


def _runner(path: Path, dtype: str, kv: str) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=8192, kv_cache_dtype=kv, load_progress=False)


def _decode_logits(runner: ModelRunner, modes: list[bool], shared_prefix: int = 0) -> list[torch.Tensor]:
    """Prefill five prompts (the first ``shared_prefix`` tokens common, cached once), then one decode step
    per entry of ``modes`` (True: the one-call path allowed); each step's logits."""
    h = Harness(runner)
    prefix = random_prompt(shared_prefix, runner.vocab_size, seed=3) if shared_prefix else []
    prompts = [prefix + random_prompt(2 + 3 * i, runner.vocab_size, seed=30 + i) for i in range(5)]
    reqs = h.prefill_sharing(prompts, shared_prefix)
    logits = []
    for on in modes:
        with decode_layers.use_decode_layers(on):
            logits.append(h.step(reqs, ForwardMode.DECODE).logits.clone())
    h.reset()
    return logits


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_one_call_equals_the_layers_bit_for_bit(
    name: str, dtype: str, kv: str, tiny_checkpoints, one_call_runs
) -> None:
    runner = _runner(tiny_checkpoints.path(name), dtype, kv)
    steps = 6
    layered = _decode_logits(runner, [False] * steps)
    one_call_runs.clear()
    in_call = _decode_logits(runner, [True] * steps)
    # two prefills, the mirror's rebuild (the layers' path), then every append step in the call
    assert one_call_runs == [False] * 3 + [True] * (steps - 1), one_call_runs
    assert runner.attn_backend.mirror.format == runner.token_to_kv_pool.format
    for step, (a, b) in enumerate(zip(layered, in_call)):
        assert torch.equal(a, b), f"{name} {kv}: decode step {step} differs"
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_call_with_a_shared_prefix_and_alternating_paths(
    dtype: str, kv: str, tiny_checkpoints, one_call_runs
) -> None:
    """head_dim 64: the shared prefix, dequantized once per rebuild, goes through the prefix kernel inside
    the call and the quantized kernel continues its softmax; the two paths alternate on one mirror."""
    runner = _runner(tiny_checkpoints.path("llama_hd64"), dtype, kv)
    layered = _decode_logits(runner, [False] * 6, shared_prefix=40)
    one_call_runs.clear()
    mixed = _decode_logits(runner, [True, True, False, True, False, True], shared_prefix=40)
    assert one_call_runs[-6:] == [False, True, False, True, False, True], one_call_runs
    mirror = runner.attn_backend.mirror
    assert mirror.prefix_slots is not None and mirror.prefix_slots.numel() == 40 and mirror.packed_prefix(0) is not None
    for step, (a, b) in enumerate(zip(layered, mixed)):
        assert torch.equal(a, b), f"decode step {step} differs"


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_verify_step_runs_in_the_call_on_the_quantized_copies(dtype: str, kv: str, tiny_checkpoints, one_call_runs):
    """A speculative verify: each request's input token and drafts share its quantized mirror row (the
    stored rows of all its new tokens copied in first); each row equals the decode step that fed the
    same tokens one at a time through the layers."""
    runner = _runner(tiny_checkpoints.path("llama"), dtype, kv)
    rng = random.Random(7)
    drafts = [[rng.randrange(3, runner.vocab_size) for _ in range(k)] for k in (3, 0, 2)]
    oracle = _fed_logits(runner, 0, drafts)
    one_call_runs.clear()
    h, reqs = _start(runner, 0, len(drafts))
    logits = _verify(h, reqs, drafts)
    assert one_call_runs[-1] is True, one_call_runs
    row = 0
    for i, draft in enumerate(drafts):
        for j in range(len(draft) + 1):
            assert _same(logits[row], oracle[i][j], dtype), f"request {i}, verify row {j} differs"
            row += 1
    h.reset()


@pytest.mark.parametrize("kv", ["auto", *KV_FORMATS])
def test_the_kernel_report_names_the_caches_format(tiny_llama_path: Path, kv: str) -> None:
    runner = _runner(tiny_llama_path, "float32", kv)
    report = runner.kernels
    cache = report["kv_cache"]
    assert cache["dtype"] == runner.kv_format.name == ("float32" if kv == "auto" else kv)
    assert cache["description"] in report["summary"]
    quantized_kernels = kv != "auto" and kernel_library.load() is not None
    assert ("csrc/attention_q8.c" in report["summary"]) == quantized_kernels
    assert (cache["kernels"] is not None) == quantized_kernels


@needs_fp32_kernels
@pytest.mark.parametrize("kv", KV_FORMATS)
def test_the_c_path_gives_the_torch_reference_paths_tokens(
    tiny_checkpoints, kv: str, one_call_runs: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32, the same quantized cache format: the C path (quantizing store, quantized mirror and kernel, the
    one call) against torch's (the pool's own store, each step's rows gathered and dequantized, the layers one
    by one). Both attend over the same stored values, so only float rounding differs (its K/V may round to a
    neighbouring code now and then): the same first tokens, logprobs within a small bound."""
    path = tiny_checkpoints.path("llama")
    steps = 10

    def generate() -> list[Any]:
        runner = _runner(path, "float32", kv)
        prompts = [random_prompt(5 + 9 * i, runner.vocab_size, seed=70 + i) for i in range(3)]
        return Harness(runner).generate(prompts, steps, return_logprob=True)

    c_path = generate()
    assert one_call_runs.count(True) == steps - 2, one_call_runs  # every decode step but the rebuild
    monkeypatch.setenv("TINYSERVE_CPU_KERNELS", "0")
    kernel_library.reset()
    try:
        one_call_runs.clear()
        torch_path = generate()
        assert not any(one_call_runs)
    finally:
        monkeypatch.delenv("TINYSERVE_CPU_KERNELS")
        kernel_library.reset()
    for a, b in zip(c_path, torch_path):
        assert a.output_ids[:6] == b.output_ids[:6]
        same = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), steps)
        drift = (torch.tensor(a.logprobs[:same]) - torch.tensor(b.logprobs[:same])).abs().max()
        assert drift < 1e-4, f"logprob drift {float(drift)}"
