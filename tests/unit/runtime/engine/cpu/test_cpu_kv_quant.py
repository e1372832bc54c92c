"""The quantized KV cache's C writes (csrc/kv_quant.c through runtime/engine/cpu/kv_quant_kernels.py) against
the reference, ``KVCacheFormat.quantize``, byte for byte, at every build level this CPU runs: random rows from
bf16 and fp32 sources (strided token rows, as views of a fused qkv output are), rows of zeros, huge and tiny
values, exact rounding ties, every fp32 exponent with a dense sweep of mantissas through fp8's cast
(subnormals, saturation and NaN included), fp8 layer scales; and the quantized mirror gather against torch's
gather of the same codes.
"""

from __future__ import annotations

import pytest
import torch

from memory.kv_format import KVCacheFormat
from memory.kv_pool import MHATokenToKVPool
from runtime.engine.cpu import kv_quant_kernels
from runtime.engine.cpu.ops import CpuOps

pytestmark = pytest.mark.usefixtures("kernel_level")  # every build this CPU runs (tests/conftest.py)

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]


def _pool(name: str, slots: int, hkv: int, d: int) -> tuple[KVCacheFormat, torch.Tensor, torch.Tensor]:
    fmt = KVCacheFormat(name, torch.float32)
    shape = (slots, hkv, fmt.row_width(d))
    return fmt, torch.zeros(shape, dtype=fmt.storage), torch.zeros(shape, dtype=fmt.storage)


def _strided_rows(values: torch.Tensor, pad: int = 8) -> torch.Tensor:
    """``values [n, Hkv, D]`` as a view with token rows ``pad`` elements longer (a fused qkv output's)."""
    n, hkv, d = values.shape
    rows = torch.zeros(n, hkv * d + pad, dtype=values.dtype)
    rows[:, : hkv * d] = values.reshape(n, -1)
    return rows[:, : hkv * d].view(n, hkv, d)


def _store_and_check(name: str, k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store k/v at shuffled slots; the slots written hold quantize()'s bytes, every other one zeros."""
    n, hkv, d = k.shape
    slots = n + 5
    fmt, k_buf, v_buf = _pool(name, slots, hkv, d)
    loc = torch.randperm(slots - 1, generator=torch.Generator().manual_seed(n))[:n] + 1
    assert kv_quant_kernels.store_kv(k_buf, v_buf, fmt, k_scale, v_scale, loc, _strided_rows(k), _strided_rows(v))
    k_want, v_want = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    k_want[loc], v_want[loc] = fmt.quantize(k, k_scale), fmt.quantize(v, v_scale)
    for got, want in ((k_buf, k_want), (v_buf, v_want)):
        diff = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
        assert diff.numel() == 0, f"{name}: {diff.shape[0]} bytes differ, first at {diff[0].tolist()}"


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_random_rows_store_the_reference_bytes(name: str, dtype: torch.dtype, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    k = (torch.randn(300, 3, d, generator=gen) * 4).to(dtype)
    v = (torch.randn(300, 3, d, generator=gen) * torch.rand(300, 3, 1, generator=gen) * 50).to(dtype)
    _store_and_check(name, k, v)
    if name != "int8":  # fp8's layer scales divide first
        _store_and_check(name, k, v, k_scale=0.37, v_scale=3.1)


@pytest.mark.parametrize("name", FORMATS)
def test_zero_huge_tiny_and_non_finite_rows(name: str) -> None:
    d = 64
    rows = torch.randn(10, d, generator=torch.Generator().manual_seed(1))
    rows[0] = 0.0  # an all-zero head: scale 0, codes 0
    rows[1, 5] = 3.0e38  # one huge value (the others round to 0 against it)
    rows[2] *= 1e30
    rows[3] *= 1e-39  # fp32 subnormals: 1 / amax overflows to inf (int8), fp8 rounds them to 0
    rows[4, :4] = torch.tensor([float("inf"), -float("inf"), 448.0, -57344.0])
    rows[5, 7] = float("nan")
    rows[6] = torch.finfo(torch.float32).max
    rows[7] = -torch.finfo(torch.float32).tiny
    rows[8, ::2] = 0.0
    rows[9] = torch.linspace(-500.0, 500.0, d)  # past e4m3's largest value: saturated
    k = rows.view(10, 1, d)
    _store_and_check(name, k, k.flip(0).contiguous())


def test_int8_rounding_ties_go_to_even() -> None:
    """Values whose product with 127 / amax is exactly k + 0.5: torch's round-half-even."""
    d = 64
    gen = torch.Generator().manual_seed(2)
    amax = torch.rand(4000, 1, generator=gen) * 10 + 0.1
    inv = amax.reciprocal() * 127.0  # the reference's 127 / amax
    half = torch.randint(-127, 127, (4000, d - 1), generator=gen).float() + 0.5
    x = (half.double() / inv.double()).float()
    ties = (x * inv) == half
    assert ties.sum() > 10_000  # most products land on the tie exactly
    rows = torch.cat([amax, x], dim=1).view(4000, 1, d)
    _store_and_check("int8", rows, -rows)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cast_on_every_exponent_and_every_tie(name: str) -> None:
    """Every fp32 sign and exponent with 11 leading mantissa bits (NaN and inf too): covers each fp8
    value's midpoints with its neighbours (ties to even), one fp32 step either side of them, fp8's
    subnormals and the saturation."""
    bits = torch.arange(1 << 20, dtype=torch.int64) << 12
    values = bits.to(torch.int32).view(torch.float32)
    values = torch.cat([values, -values])
    fmt = KVCacheFormat(name, torch.float32)
    codes = torch.arange(1, 127 if name == "fp8_e4m3" else 124, dtype=torch.uint8)
    exact = codes.view(fmt.fp8_dtype).float()
    mids = (exact[:-1] + exact[1:]) / 2
    steps = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)), exact / 2])
    values = torch.cat([values, steps, -steps])
    values = torch.cat([values, values.new_zeros(-values.numel() % 64)])
    rows = values.view(-1, 1, 64)
    _store_and_check(name, rows, rows.flip(0).contiguous())
    _store_and_check(name, rows, rows, k_scale=0.75, v_scale=2.0**-9)


def test_refuses_what_it_cannot_write() -> None:
    fmt, k_buf, v_buf = _pool("int8", 8, 2, 64)
    k = torch.randn(2, 2, 64)
    assert not kv_quant_kernels.store_kv(k_buf, v_buf, fmt, 1.0, 1.0, torch.tensor([1, 8]), k, k)  # past the pool
    assert not kv_quant_kernels.store_kv(k_buf, v_buf, fmt, 1.0, 1.0, torch.tensor([-1, 2]), k, k)
    assert not kv_quant_kernels.store_kv(k_buf, v_buf, fmt, 1.0, 1.0, torch.tensor([1, 2]), k.half(), k.half())
    assert not kv_quant_kernels.store_kv(k_buf, v_buf, fmt, 1.0, 1.0, torch.tensor([1, 2]), k.transpose(1, 2), k)
    wrong = KVCacheFormat("fp8_e4m3", torch.float32)  # buffers of another format's row width
    assert not kv_quant_kernels.store_kv(k_buf, v_buf, wrong, 1.0, 1.0, torch.tensor([1, 2]), k, k)
    assert not k_buf.any() and not v_buf.any()


@pytest.mark.parametrize("name", FORMATS)
def test_cpu_ops_store_is_the_pools_store(name: str) -> None:
    """``CpuOps.store_kv`` on a quantized pool gives the bytes of the pool's own ``set_kv_buffer``;
    a slot outside the pool still raises (the pool's own write, after the kernel refused)."""
    fmt = KVCacheFormat(name, torch.bfloat16)
    pools = [MHATokenToKVPool(30, 1, torch.bfloat16, 2, 3, 64, "cpu", fmt) for _ in range(2)]
    for pool in pools:
        pool.set_layer_scales([1.0, 0.5], [2.0, 1.0])
    k = torch.randn(7, 3, 64).bfloat16()
    v = torch.randn(7, 3, 64).bfloat16()
    loc = torch.tensor([3, 9, 1, 20, 4, 5, 30])
    for layer in range(2):
        CpuOps().store_kv(pools[0], layer, loc, k, v)
        pools[1].set_kv_buffer(layer, loc, k, v)
        assert torch.equal(pools[0].k_buffer[layer], pools[1].k_buffer[layer])
        assert torch.equal(pools[0].v_buffer[layer], pools[1].v_buffer[layer])
    with pytest.raises(IndexError):
        CpuOps().store_kv(pools[0], 0, torch.tensor([1, 99, 2, 3, 4, 5, 6]), k, v)


@pytest.mark.parametrize("name", FORMATS)
def test_mirror_gather_moves_the_codes_and_scales(name: str) -> None:
    n, hkv, d, width, cap = 3, 2, 80, 37, 48
    gen = torch.Generator().manual_seed(4)
    fmt, k_buf, v_buf = _pool(name, 200, hkv, d)
    k_buf.copy_(fmt.quantize(torch.randn(200, hkv, d, generator=gen) * 3))
    v_buf.copy_(fmt.quantize(torch.randn(200, hkv, d, generator=gen)))
    loc = torch.randint(0, 200, (n * width,), generator=gen)
    codes_k = torch.full((n, hkv, d, cap), 7, dtype=fmt.storage)
    codes_v = torch.full((n, hkv, cap, d), 7, dtype=fmt.storage)
    int8 = name == "int8"
    scales_k = torch.full((n, hkv, cap), -1.0) if int8 else None
    scales_v = torch.full((n, hkv, cap), -1.0) if int8 else None
    assert kv_quant_kernels.mirror_gather(k_buf, v_buf, fmt, loc, width, codes_k, codes_v, scales_k, scales_v)
    rows_k = k_buf.index_select(0, loc).view(n, width, hkv, -1)
    rows_v = v_buf.index_select(0, loc).view(n, width, hkv, -1)
    assert torch.equal(codes_k[..., :width], rows_k[..., :d].permute(0, 2, 3, 1))
    assert torch.equal(codes_v[:, :, :width], rows_v[..., :d].transpose(1, 2))
    assert (codes_k[..., width:] == 7).all() and (codes_v[:, :, width:] == 7).all()  # past the width: untouched
    if int8:
        assert scales_k is not None and scales_v is not None
        assert torch.equal(scales_k[..., :width], kv_quant_kernels.row_scales(rows_k).transpose(1, 2))
        assert torch.equal(scales_v[..., :width], kv_quant_kernels.row_scales(rows_v).transpose(1, 2))
        assert (scales_k[..., width:] == -1).all()
    bad = loc.clone()
    bad[5] = 200
    assert not kv_quant_kernels.mirror_gather(k_buf, v_buf, fmt, bad, width, codes_k, codes_v, scales_k, scales_v)
