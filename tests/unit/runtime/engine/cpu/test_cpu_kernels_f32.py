"""The fp32 elementwise kernels (csrc/elementwise_f32.c) against torch's fp32 ops, at every
build level this CPU runs: RMSNorm and rotary bit-identical, silu*mul within a few ulp.

Sizes cover whole vectors, vector remainders (odd sizes: the masked tail of 8 or 16 lanes),
rows shorter than one vector, and row counts on both sides of the kernels' threading cut-off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.engine.cpu import kernels as cpu_kernels
from runtime.engine.layers.rotary import RotaryEmbedding
from runtime.engine.rope_config import RopeConfig

pytestmark = pytest.mark.usefixtures("kernel_level")  # every build this CPU runs (tests/conftest.py)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units in the last place of fp32 (bit patterns mapped onto one integer line)."""

    def line(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int32).long()
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return (line(got) - line(want)).abs()


def _hf_rms_norm(v: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in fp32."""
    return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows,inter", [(37, 7), (5, 300), (3, 2816), (64, 5632 + 5)])
def test_silu_and_mul_within_a_few_ulp_of_torch(rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 8
    specials = torch.tensor([0.0, -100.0, 100.0, -87.5, -88.9, 88.5, float("inf"), float("-inf")])
    gate_up[0, : min(inter, 8)] = specials[: min(inter, 8)]  # zero, exp's overflow and cut-off, infinities
    gate_up[1, inter - 1] = float("nan")  # in the masked tail where there is one
    gate_up[2, 2 * inter - 1] = float("nan")  # an up value
    out = cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert out is not None and out.dtype == torch.float32 and out.shape == (rows, inter)
    assert torch.equal(out.isnan(), want.isnan())
    finite = ~want.isnan()
    assert int(_ulps(out[finite], want[finite]).max()) <= 4


def test_silu_over_the_whole_exp_range() -> None:
    """silu(x) * 1 for x from far below exp's underflow to far above its overflow."""
    x = torch.linspace(-120.0, 120.0, 48_001)
    out = cpu_kernels.silu_and_mul(torch.cat([x, torch.ones_like(x)])[None])
    assert out is not None
    assert int(_ulps(out[0], F.silu(x)).max()) <= 4


@pytest.mark.parametrize("hidden", [1, 7, 8, 13, 64, 100, 1024, 1029, 4096, 5000, 9000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_bit_identical_to_hf(hidden: int, with_residual: bool) -> None:
    """The sum of squares is taken in torch's order, so every output bit matches (hidden 9000:
    past the bf16 kernel's row buffer, which the fp32 one does not have)."""
    gen = torch.Generator().manual_seed(hidden)
    rows = 2 if hidden > 4096 else 33
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    source = residual + x if with_residual else x
    res = residual.clone() if with_residual else None
    out = cpu_kernels.rms_norm(x, res, weight, 1e-6)
    assert out is not None and out.dtype == torch.float32
    assert torch.equal(out, _hf_rms_norm(source, weight, 1e-6))
    if with_residual:
        assert torch.equal(res, source)  # the sum is left in the residual buffer


def test_rms_norm_of_a_decode_batch_and_a_prefill() -> None:
    """Row counts on both sides of the threading cut-off, with 3-d activations."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(1024, generator=gen)
    for tokens in (1, 64, 700):
        x = torch.randn(tokens, 1, 1024, generator=gen)
        assert torch.equal(cpu_kernels.rms_norm(x, None, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("rotary_dim", [64, 32, 6])  # halves of 32, 16 and 3 (a lane remainder only)
@pytest.mark.parametrize("tokens", [1, 9, 300])
def test_rotary_in_place_is_bit_identical_to_torch(rotary_dim: int, tokens: int) -> None:
    """On the q and k heads of a fused qkv output (strided rows): v and the unrotated dims stay."""
    gen = torch.Generator().manual_seed(rotary_dim + tokens)
    heads, kv_heads, d = 4, 2, 64
    rope = RotaryEmbedding(d, 512, RopeConfig(rope_type="default", theta=10000.0), rotary_dim=rotary_dim)
    cos, sin = rope.cos_sin(torch.randint(0, 512, (tokens,), generator=gen), torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 4
    qk = qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)
    expected = rope.rotate(qk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    assert cpu_kernels.rotary_(qk, cos, sin, rotary_dim)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)


def test_what_the_fp32_kernels_refuse() -> None:
    """Mixed dtypes and non-contiguous operands go back to torch, untouched."""
    x, w = torch.randn(4, 64), torch.randn(64)
    assert cpu_kernels.rms_norm(x, None, w.bfloat16(), 1e-6) is None
    assert cpu_kernels.rms_norm(x, torch.randn(4, 64).bfloat16(), w, 1e-6) is None
    assert cpu_kernels.rms_norm(x.t().contiguous().t(), None, w, 1e-6) is None
    assert cpu_kernels.rms_norm(x.double(), None, w.double(), 1e-6) is None
    assert cpu_kernels.silu_and_mul(torch.randn(4, 64).t()) is None
    assert cpu_kernels.silu_and_mul(torch.randn(4, 63)) is None
    empty = cpu_kernels.silu_and_mul(torch.randn(0, 64))
    assert empty is not None and empty.shape == (0, 32)
    rope = RotaryEmbedding(64, 16, RopeConfig(rope_type="default", theta=10000.0))
    cos, sin = rope.cos_sin(torch.tensor([1, 2]), torch.float32)
    q = torch.randn(2, 3, 64)
    before = q.clone()
    assert not cpu_kernels.rotary_(q, cos.bfloat16(), sin.bfloat16(), 64)  # cos/sin of another dtype
    assert not cpu_kernels.rotary_(q.transpose(1, 2).contiguous().transpose(1, 2), cos, sin, 64)  # heads not packed
    assert torch.equal(q, before)
