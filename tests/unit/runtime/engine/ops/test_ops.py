"""The device-ops seam: which implementation each device and dtype gets, that a model's layers
all use the one the runner picked, that the CPU implementation sends work to the C kernels
exactly where they apply, and the plain torch backend (what torch_native is off the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_model_attention
import torch

from runtime.engine.attention import torch_native
from runtime.engine.attention.plan import CASCADE_MIN_PREFIX, AttnGroup
from runtime.engine.attention.registry import get_attention_backend_class
from runtime.engine.cpu import attention as cpu_attention
from runtime.engine.cpu import kernels as cpu_kernels
from runtime.engine.cpu.ops import CpuOps
from runtime.engine.cuda.ops import TritonOps
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.layers.rotary import RotaryEmbedding
from runtime.engine.model_runner import ModelRunner
from runtime.engine.ops import OPS_ENV, TorchOps, get_ops
from runtime.engine.rope_config import RopeConfig

BF16, FP32 = torch.bfloat16, torch.float32


def test_the_seam_picks_by_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPS_ENV, raising=False)
    for dtype in (BF16, torch.float16, FP32):
        assert type(get_ops("cpu", dtype)) is CpuOps
        assert type(get_ops("cuda", dtype)) is TritonOps  # picking needs no GPU; nothing is launched
        assert type(get_ops(torch.device("cuda", 1), dtype)) is TritonOps
    assert type(get_ops("cuda", torch.float64)) is TorchOps  # no Triton kernels for it
    assert get_ops("cpu", BF16) is get_ops(torch.device("cpu"), BF16)  # one shared object
    monkeypatch.setenv(OPS_ENV, "torch")
    assert type(get_ops("cpu", BF16)) is TorchOps and type(get_ops("cuda", BF16)) is TorchOps


def test_torch_native_is_the_cpu_wing_only_on_cpu() -> None:
    assert get_attention_backend_class("torch_native", torch.device("cpu")) is cpu_attention.CpuAttnBackend
    assert get_attention_backend_class("torch_native", torch.device("cuda")) is torch_native.TorchNativeAttnBackend
    assert (
        not torch_native.TorchNativeAttnBackend.plan_cascade
        and torch_native.TorchNativeAttnBackend.kv_copy_fraction == 0
    )


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_every_layer_uses_the_runners_ops(tiny_llama_path: Path, dtype: torch.dtype) -> None:
    runner = ModelRunner(tiny_llama_path, device="cpu", dtype=dtype, max_total_tokens=256, load_progress=False)
    assert runner.ops is get_ops("cpu", dtype)
    holders = [m for m in runner.model.modules() if hasattr(m, "ops")]
    assert len(holders) > 4 * runner.model_config.num_hidden_layers and all(m.ops is runner.ops for m in holders)
    assert runner.sampler._ops is runner.ops and runner.attn_backend._ops is runner.ops


def test_pool_sized_from_memory_leaves_room_for_the_decode_mirror(tiny_llama_path: Path) -> None:
    """The CPU backend's mirror may take kv_copy_fraction of the pool: budgeted inside the sizing."""
    runner = ModelRunner(tiny_llama_path, device="cpu", dtype="float32", max_total_tokens=256, load_progress=False)
    raw = runner.token_to_kv_pool.bytes_per_token()
    assert runner.kv_bytes_per_token() == int(raw * (1 + cpu_attention.CpuAttnBackend.kv_copy_fraction)) > raw


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """Record whether each call of ``cpu_kernels.<name>`` ran the kernel (returned a result)."""
    calls: list[bool] = []
    real = getattr(cpu_kernels, name)

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None and out is not False)
        return out

    monkeypatch.setattr(cpu_kernels, name, spy)
    return calls


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_cpu_ops_take_the_c_kernels_exactly_where_they_apply(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 and fp32 both go through the C kernels, and CpuOps equals the plain torch ops: in
    fp32 RMSNorm and rotary bit for bit, silu*mul within a few ulp; bf16 within its rounding."""
    assert cpu_kernels.available()
    ops, ref = CpuOps(), TorchOps()
    spies = {name: _spy(monkeypatch, name) for name in ("rms_norm", "silu_and_mul", "rotary_", "argmax_rows")}
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(64, generator=gen).to(dtype)
    res_ref = res.clone()
    exact = dict(atol=0, rtol=0) if dtype == FP32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, res), ref.rms_norm(x, w, 1e-6, res_ref), **exact)
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)
    gate_up = torch.randn(5, 2 * 48, generator=gen).to(dtype)
    close = dict(atol=1e-6, rtol=1e-6) if dtype == FP32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **close)
    cache = RotaryEmbedding(64, 128, RopeConfig(rope_type="default", theta=10000.0))
    positions = torch.tensor([0, 3, 9, 127, 64])
    qkv = torch.randn(5, 8 * 64, generator=gen).to(dtype)
    q, k = qkv[:, : 4 * 64].view(5, 4, 64), qkv[:, 4 * 64 : 6 * 64].view(5, 2, 64)
    want = qkv.clone()
    ref.rotary_(
        want[:, : 4 * 64].view(5, 4, 64), want[:, 4 * 64 : 6 * 64].view(5, 2, 64), ref.rope(cache, positions, dtype)
    )
    ops.rotary_(q, k, ops.rope(cache, positions, dtype))
    assert torch.equal(qkv, want)  # the C rotary is bit-identical to torch's
    logits = torch.randn(4, 300, generator=gen)
    assert torch.equal(ops.argmax_rows(logits), ref.argmax_rows(logits))
    assert spies["rms_norm"] == [True] and spies["silu_and_mul"] == [True]
    assert spies["rotary_"] == [True]  # q and k adjacent in qkv: one call for both
    assert spies["argmax_rows"] == [True]  # fp32 logits whatever the model dtype


def test_cpu_rotary_of_separate_q_and_k_calls_the_kernel_for_each(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch, "rotary_")
    cache = RotaryEmbedding(64, 16, RopeConfig(rope_type="default", theta=10000.0))
    q, k = torch.randn(3, 4, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16()
    want_q, want_k = q.clone(), k.clone()
    TorchOps().rotary_(want_q, want_k, TorchOps().rope(cache, torch.tensor([1, 2, 3]), BF16))
    CpuOps().rotary_(q, k, CpuOps().rope(cache, torch.tensor([1, 2, 3]), BF16))
    assert calls == [True, True] and torch.equal(q, want_q) and torch.equal(k, want_k)


def test_torch_rotary_in_place_is_bit_identical_to_transformers() -> None:
    """fp32: ``q * cos + rotate_half(q) * sin`` exactly, on strided views, including a partial rotary dim."""
    for rotary_dim in (32, 16):
        cache = RotaryEmbedding(32, 64, RopeConfig(rope_type="default", theta=10000.0), rotary_dim=rotary_dim)
        positions = torch.tensor([0, 7, 63, 30])
        qkv = torch.randn(4, 5 * 32)
        q, k = qkv[:, :96].view(4, 3, 32), qkv[:, 96:128].view(4, 1, 32)
        cos, sin = cache.cos_sin(positions, FP32)
        expected = []
        for x in (q, k):
            rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
            half = rotary_dim // 2
            rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
            full_cos, full_sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            expected.append(torch.cat([rot * full_cos + rotated * full_sin, rest], dim=-1))
        TorchOps().rotary_(q, k, TorchOps().rope(cache, positions, FP32))
        assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_plain_torch_backend_matches_the_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_native off the CPU: no cascade, no mirror, SDPA per group (here run on CPU tensors)."""
    monkeypatch.setattr(test_model_attention, "CpuAttnBackend", torch_native.TorchNativeAttnBackend)
    run = test_model_attention._run
    shared = CASCADE_MIN_PREFIX + 4
    for mode, prefix, ext in (
        (ForwardMode.EXTEND, [0, 5, 0], [9, 3, 1]),
        (ForwardMode.EXTEND, [0, 0], [6, 6]),
        (ForwardMode.DECODE, [12, 3, 7, 12], [1, 1, 1, 1]),
        (ForwardMode.DECODE, [shared] * 3, [1, 1, 1]),
        (ForwardMode.MIXED, [4, 0, 11], [4, 1, 2]),
    ):
        meta = run(mode, prefix, ext, dtype=dtype)
        assert all(type(g) is AttnGroup and g.shared_loc is None for g in meta.groups)  # no CPU plan fields


@pytest.mark.parametrize("ops", [TorchOps(), CpuOps(), TritonOps()], ids=lambda ops: ops.name)
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_layer_norm_and_gelu_are_their_formulas(ops: TorchOps, dtype: torch.dtype) -> None:
    """An encoder's LayerNorm and exact GELU on every device's ops, against the formulas in float64:
    ``(x - mean) / sqrt(var + eps) * w + b`` over the last dim (biased variance) and
    ``x / 2 * (1 + erf(x / sqrt(2)))``."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 96, generator=gen) * 3 + 1
    weight, bias = 1 + 0.2 * torch.randn(96, generator=gen), 0.2 * torch.randn(96, generator=gen)
    xd = x.to(dtype).double()
    mean, var = xd.mean(-1, keepdim=True), xd.var(-1, unbiased=False, keepdim=True)
    want_norm = (xd - mean) / torch.sqrt(var + 1e-12) * weight.to(dtype).double() + bias.to(dtype).double()
    want_gelu = xd / 2 * (1 + torch.erf(xd / 2**0.5))
    tol = 1e-5 if dtype == FP32 else 2e-2
    got_norm = ops.layer_norm(x.to(dtype), weight.to(dtype), bias.to(dtype), 1e-12)
    got_gelu = ops.gelu(x.to(dtype))
    assert got_norm.dtype == got_gelu.dtype == dtype
    torch.testing.assert_close(got_norm.double(), want_norm, atol=tol, rtol=tol)
    torch.testing.assert_close(got_gelu.double(), want_gelu, atol=tol, rtol=tol)
