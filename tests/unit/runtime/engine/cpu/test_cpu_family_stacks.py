"""The families beyond Llama in the one-call CPU decode stack (csrc/decode_layers.c): Qwen2's q/k/v
biases with linear RoPE scaling, Qwen3's per-head q/k RMSNorm before RoPE (head_dim 32, not
hidden / heads), Phi-3's fused projections with a partial rotary share and LongRoPE, Gemma 3's
sandwich norms, unit-offset norms, gelu_tanh MLP, query_pre_attn_scalar, and windowed layers with
their own RoPE base (past the window of 16), and the sparse families' routed experts (csrc/moe_mlp.c:
Qwen3-MoE's renormalised top-4 of 16 beside a dense layer, Mixtral's renormalised top-2 with fp32
weights, OLMoE's top-2 not renormalised with its q/k norms over the whole projection and its q/k/v
clamp, Qwen2-MoE's top-2 of 8 with its always-on shared expert behind a sigmoid gate, after a dense
layer; their routers and that gate too small for a packed copy run on the plain dot kernel that the
layers run too, and the gate's sigmoid on the kernel both paths run). For each, in bf16 and fp32, one request and several: the greedy tokens through the call
equal the layers' run one by one (and in fp32 transformers'), every decode step after the mirror's
first runs in the call, and the kernel report says the stack takes the model; with GGUF weights kept
in their blocks the call's logits equal the layers' bit for bit. The per-head norm kernel both paths
run (csrc/head_norm.c) is each head's plain RMSNorm, and the gelu_tanh*mul kernel both paths run is
torch's formula within rounding, at every kernel level this CPU runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

from runtime.engine.cpu import decode_layers, kernel_library, kernels
from runtime.engine.cpu.kernel_report import describe
from runtime.engine.cpu.prepacked import fp32_panel_rows
from runtime.engine.model_runner import ModelRunner
from runtime.engine.ops.experts import route_experts
from tests.support.checkpoints import (
    GEMMA_WINDOW,
    PHI3_ORIGINAL_MAX,
    TinyCheckpoints,
    hf_greedy,
    load_hf_model,
    random_prompt,
)
from tests.support.gguf_files import gguf_test_folder, write_checkpoint_gguf
from tests.support.harness import Harness
from tests.unit.runtime.engine.cpu.test_cpu_decode_layers import DTYPES, _decode_logits, needs_fp32_kernels

FAMILIES = ["qwen2", "qwen3", "phi3_longrope", "gemma3", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe"]
# (family, dtype) cases: all but bf16 Mixtral, whose tiny experts' gate/up ([96, 64]: intermediate 48)
# no bf16 kernel set reads (oneDNN's own layout), so its bf16 layers run one by one
CASES = [
    pytest.param(name, dtype.values[0], marks=dtype.marks)
    for name in FAMILIES
    for dtype in DTYPES
    if (name, dtype.values[0]) != ("mixtral", "bfloat16")
]
# the GGUF files kept in Q8_0 blocks (not Mixtral's: its intermediate 48 is no multiple of the 32-value block)
KEPT_FAMILIES = ["qwen2", "qwen3", "gemma3", "qwen3_moe", "olmoe", "qwen2_moe"]
STEPS = 8  # decode tokens per request (phi3_longrope's prompts and outputs stay under PHI3_ORIGINAL_MAX)
# the first request's prompt length: gemma3's requests cross its window (GEMMA_WINDOW) while decoding
FIRST_PROMPT = {"gemma3": GEMMA_WINDOW - 4}
# the checkpoint a family's GGUF test writes: what a GGUF file of it loads back as (gemma3_gguf: the file keeps
# no layer types, so the default pattern, five windowed layers to one full, over six layers of head_dim 256)
GGUF_CHECKPOINT = {"gemma3": "gemma3_gguf"}


@pytest.fixture
def calls(one_call_runs: list[bool]) -> list[bool]:
    """Per forward that asked: whether ``decode_layers.run`` ran the layers (True) or declined."""
    return one_call_runs


def _runner(path: Path, dtype: str, **kwargs: Any) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=2048, load_progress=False, **kwargs)


def _greedy(runner: ModelRunner, prompts: list[list[int]], on: bool) -> list[list[int]]:
    h = Harness(runner)
    with decode_layers.use_decode_layers(on):
        reqs = h.generate(prompts, STEPS)
    h.reset()
    return [list(req.output_ids) for req in reqs]


@pytest.mark.parametrize("requests", [1, 4])
@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_the_call_takes_the_family_and_gives_the_layers_tokens(
    name: str, dtype: str, requests: int, tiny_checkpoints: TinyCheckpoints, calls: list[bool]
) -> None:
    if dtype == "float32" and requests not in fp32_panel_rows():
        pytest.skip(f"this build's fp32 panel kernel does not take {requests} rows (F.linear runs them)")
    path = tiny_checkpoints.path(name)
    runner = _runner(path, dtype)
    assert runner.kernels["decode_stack"] is not None, runner.kernels
    assert "decode step: one C call" in describe(runner.kernels)
    first = FIRST_PROMPT.get(name, 5)
    prompts = [random_prompt(first + 9 * i, runner.vocab_size, seed=900 + i) for i in range(requests)]
    assert max(map(len, prompts)) + STEPS < PHI3_ORIGINAL_MAX
    layered = _greedy(runner, prompts, on=False)
    calls.clear()
    one_call = _greedy(runner, prompts, on=True)
    # the prefill, the first decode step (it builds the mirror), then every decode step in the call
    assert calls == [False, False] + [True] * (STEPS - 2), calls
    assert one_call == layered
    if dtype == "float32":
        reference = load_hf_model(path)
        assert one_call == [hf_greedy(reference, prompt, STEPS)[0] for prompt in prompts]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with gguf_test_folder(tmp_path_factory, "family-stacks") as folder:
        yield folder


@needs_fp32_kernels
@pytest.mark.parametrize("name", KEPT_FAMILIES)
def test_kept_quantized_gguf_in_the_call_bit_for_bit(
    name: str, tiny_checkpoints: TinyCheckpoints, gguf_files: Path, calls: list[bool]
) -> None:
    """The family's GGUF file (Q8_0) served with its blocks kept: the call's quantized set (qf32)
    runs the biases, the q/k norms and Gemma 3's layers too (its requests past the window), bit for
    bit the layers."""
    gguf = write_checkpoint_gguf(
        tiny_checkpoints.path(GGUF_CHECKPOINT.get(name, name)),
        gguf_files / f"{name}-Q8_0.gguf",
        weight_type="Q8_0",
        tokenizer=False,
    )
    runner = _runner(gguf, "float32", quantization="gguf")
    first = FIRST_PROMPT.get(name, 2)
    layered = _decode_logits(runner, [False] * 4, requests=3, first_len=first)
    calls.clear()
    one_call = _decode_logits(runner, [True] * 4, requests=3, first_len=first)
    assert calls == [False] * 3 + [True] * 3, calls  # two prefills, the mirror's rebuild, then the call
    stack = runner.layer_stack
    assert isinstance(stack, decode_layers.CpuLayerStack)
    described = stack.description(3)
    assert described is not None and described.kernels == "qf32"
    for step, (a, b) in enumerate(zip(layered, one_call)):
        assert torch.equal(a, b), f"decode step {step} differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("level", kernel_library.host_levels())
def test_the_head_norm_kernel_is_each_heads_rmsnorm(level: str, dtype: torch.dtype) -> None:
    """The q and k parts of a fused qkv output (strided rows of packed heads): each head normed as the
    plain RMSNorm kernel norms a row of head_dim, bit for bit, and within rounding of torch's formula."""
    tokens, q_heads, kv_heads, head_dim, eps = 5, 6, 2, 32, 1e-6
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    weight = torch.randn(head_dim, generator=gen).to(dtype)
    with kernel_library.use_level(level):
        q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
        k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        for part in (q, k):
            normed = kernels.rms_norm(part, None, weight, eps)
            rows = kernels.rms_norm(part.reshape(-1, head_dim).contiguous(), None, weight, eps)
            assert normed is not None and rows is not None and normed.is_contiguous()
            assert torch.equal(normed.reshape(-1, head_dim), rows)
            x = part.float()
            expected = weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float()
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(normed.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_routing_kernels_choose_as_transformers_routers(dtype: torch.dtype) -> None:
    """The router product and routing that both paths run for a sparse layer (csrc/moe_mlp.c): the dot
    kernel within rounding of F.linear; the softmax's top-k the experts torch.topk picks, in its order,
    their weights within an ulp of torch's (renormalised to sum to 1 where asked), the lower id first
    among equal probabilities."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, 64, generator=gen).to(dtype)
    weight = torch.randn(6, 64, generator=gen).to(dtype)
    logits = kernels.router_logits(x, weight)
    assert logits is not None and logits.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits.float(), F.linear(x.float(), weight.float()), rtol=tol, atol=tol)
    for renormalize in (False, True):
        routed = kernels.moe_route(logits, 2, renormalize)
        assert routed is not None
        ids, weights = routed
        reference = route_experts(logits, 2, renormalize, in_model_dtype=False)
        assert torch.equal(ids, reference.ids)
        torch.testing.assert_close(weights, reference.weights, rtol=2e-7, atol=1e-7)
        sums = weights.sum(-1)
        assert torch.allclose(sums, torch.ones_like(sums)) == renormalize
    tied = torch.tensor([[0.5, 2.0, 2.0, 2.0, -1.0, 0.0]], dtype=dtype)
    routed = kernels.moe_route(tied, 2, False)
    assert routed is not None and routed[0].tolist() == [[1, 2]]
    # the shared expert's gate: torch's sigmoid within an fp32 ulp, then rounded to the dtype (bf16: an ulp)
    gate = kernels.sigmoid(logits)
    assert gate is not None and gate.dtype == dtype and gate.shape == logits.shape
    tol = 2e-7 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(gate.float(), torch.sigmoid(logits.float()), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("level", kernel_library.host_levels())
def test_the_gelu_tanh_kernel_is_torchs_gated_gelu(level: str, dtype: torch.dtype) -> None:
    """Gemma's gated MLP activation (csrc gelu_tanh_mul_*, which the layers and the call both run):
    torch's ``F.gelu(gate, approximate="tanh") * up`` within fp32 rounding (the kernel's x * sigmoid(z)
    form does not cancel where torch's 1 + tanh does: the far negative tail differs by a few 1e-7), and
    in bf16 within one rounding of the activation (a bf16 ulp of its result)."""
    gen = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(3, 2 * 80, generator=gen) * 3).to(dtype)  # (80: a 16-lane loop and a tail)
    gate, up = gate_up.float().chunk(2, dim=-1)
    with kernel_library.use_level(level):
        out = kernels.gelu_tanh_and_mul(gate_up)
    assert out is not None and out.shape == (3, 80) and out.dtype == dtype
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1e-5)
