"""The KV cache's formats (memory/kv_format.py) and the pools that hold them.

What is exact: each format's round trip within its rounding bound, the int8 row's layout (its scale's
bytes after the values), saturation instead of NaN, the bytes every pool (device, SWA, host tier)
takes per token, and that whatever moves slots moves the scales with the values.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from memory.host_pool import HostKVPool
from memory.kv_format import INT8_MAX, SCALE_BYTES, kv_cache_format
from memory.kv_pool import MHATokenToKVPool
from memory.swa_kv_pool import SWAKVPool
from runtime.config.memory_args import KV_CACHE_DTYPE_CHOICES
from runtime.engine.loading.kv_scales import checkpoint_kv_scales

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")
# Largest relative error of one rounding to nearest: half an ulp of a 3 (e4m3) or 2 (e5m2) bit mantissa.
FP8_RELATIVE = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}


def _values(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 8


def test_every_flag_choice_names_a_format() -> None:
    for choice in KV_CACHE_DTYPE_CHOICES:
        for dtype in (torch.float32, torch.bfloat16):
            fmt = kv_cache_format(choice, dtype)
            assert fmt.compute == dtype
    assert kv_cache_format("auto", torch.float32).name == "float32"
    assert kv_cache_format("auto", torch.bfloat16).storage == torch.bfloat16
    assert kv_cache_format("bfloat16", torch.float32).storage == torch.bfloat16
    assert not kv_cache_format("bf16", torch.float32).quantized
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        kv_cache_format("fp4", torch.float32)


def test_int8_rows_hold_their_scale_after_the_values() -> None:
    fmt = kv_cache_format("int8", torch.float32)
    x = _values((5, 3, 16))
    rows = fmt.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 16 + SCALE_BYTES)
    scale = rows[..., 16:].contiguous().view(torch.float32)[..., 0]
    torch.testing.assert_close(scale, x.abs().amax(-1) / INT8_MAX, rtol=0, atol=0)
    codes = rows[..., :16].float()
    assert codes.abs().amax() == INT8_MAX  # each row's largest value takes the full range
    # the round trip is within half a step of each row's scale
    err = (fmt.dequantize(rows) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-6)).all()


def test_int8_of_an_all_zero_head_is_zero_with_scale_zero() -> None:
    fmt = kv_cache_format("int8", torch.bfloat16)
    x = torch.zeros(2, 1, 8, dtype=torch.bfloat16)
    x[1, 0, 3] = -2.5
    back = fmt.dequantize(fmt.quantize(x))
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)  # (-2.5 is the row's amax: exact)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_fp8_round_trip_and_saturation(name: str, scale: float) -> None:
    fmt = kv_cache_format(name, torch.float32)
    x = _values((4, 2, 32), seed=1)
    rows = fmt.quantize(x, scale)
    assert rows.dtype == torch.uint8 and rows.shape == x.shape
    back = fmt.dequantize(rows, scale)
    tiny = torch.finfo(fmt.fp8_dtype).smallest_normal * scale  # below it the spacing is absolute
    assert ((back - x).abs() <= FP8_RELATIVE[name] * x.abs() + tiny).all()
    big = torch.tensor([[[1e9, -1e9, float(torch.finfo(fmt.fp8_dtype).max) * 4]]])
    saturated = fmt.dequantize(fmt.quantize(big, scale), scale)
    limit = torch.finfo(fmt.fp8_dtype).max * scale
    assert torch.equal(saturated, torch.tensor([[[limit, -limit, limit]]]))  # never NaN or inf


@pytest.mark.parametrize("name", ["float32", "bfloat16", *QUANTIZED])
def test_pool_stores_and_reads_the_format(name: str) -> None:
    fmt = kv_cache_format("bf16" if name == "bfloat16" else ("auto" if name == "float32" else name), torch.float32)
    pool = MHATokenToKVPool(16, 1, torch.float32, 2, 3, 8, "cpu", fmt)
    assert pool.dtype == fmt.storage and pool.k_buffer[0].shape == (17, 3, fmt.row_width(8))
    loc = torch.tensor([3, 7, 9])
    k, v = _values((3, 3, 8), 2), _values((3, 3, 8), 3)
    pool.set_kv_buffer(1, loc, k, v)
    k_rows, v_rows = pool.kv_rows(1)
    torch.testing.assert_close(k_rows.gather(loc), fmt.dequantize(fmt.quantize(k)), rtol=0, atol=0)
    torch.testing.assert_close(v_rows.gather(loc), fmt.dequantize(fmt.quantize(v)), rtol=0, atol=0)
    # what an extend's new tokens attend to is what the cache will give back for them
    k_read, v_read = pool.stored_values(1, k, v)
    assert torch.equal(k_read, k_rows.gather(loc)) and torch.equal(v_read, v_rows.gather(loc))
    # copy-on-write moves the rows whole: the int8 scales travel with their values
    pool.copy_slots(loc[:1], torch.tensor([12]))
    assert torch.equal(k_rows.gather(torch.tensor([12])), k_rows.gather(loc[:1]))


def test_bytes_per_token_per_format() -> None:
    """A bf16 model, 2 layers, 3 KV heads of D 64: bf16 128 B a head, int8 68, fp8 64."""
    expected = {"auto": 128, "int8": 68, "fp8_e4m3": 64, "fp8_e5m2": 64}
    for name, head in expected.items():
        pool = MHATokenToKVPool(32, 1, torch.bfloat16, 2, 3, 64, "cpu", kv_cache_format(name, torch.bfloat16))
        assert pool.bytes_per_token() == 2 * 2 * 3 * head
        host = HostKVPool(pool, 32)  # the host tier holds the same rows: as few bytes a token
        assert host.bytes_per_token() == pool.bytes_per_token() and host.k_buffer[0].dtype == pool.dtype
        assert host.k_buffer[0].shape[1:] == pool.k_buffer[0].shape[1:]
        assert pool.describe()["dtype"] == pool.format.name


def test_swa_pool_takes_the_format() -> None:
    fmt = kv_cache_format("int8", torch.float32)
    pool = SWAKVPool(32, 8, 1, torch.float32, (None, 4), 2, 8, "cpu", fmt)
    assert all(b.shape[-1] == 8 + SCALE_BYTES and b.dtype == torch.int8 for b in pool.k_buffer)
    assert pool.k_buffer[1].shape[0] == 9  # the windowed layer's own, smaller pool
    assert pool.layer_bytes_per_token() == 2 * 2 * (8 + SCALE_BYTES)


def test_fp8_layer_scales_divide_the_stored_values() -> None:
    fmt = kv_cache_format("fp8_e4m3", torch.float32)
    pool = MHATokenToKVPool(8, 1, torch.float32, 2, 1, 4, "cpu", fmt)
    pool.set_layer_scales([1.0, 100.0], [1.0, 0.5])
    k = torch.full((1, 1, 4), 1000.0)  # past e4m3's 448: saturated at scale 1, held at scale 100
    pool.set_kv_buffer(0, torch.tensor([1]), k, k)
    pool.set_kv_buffer(1, torch.tensor([1]), k, k)
    assert float(pool.kv_rows(0)[0].gather(torch.tensor([1]))[0, 0, 0]) == 448.0
    assert float(pool.kv_rows(1)[0].gather(torch.tensor([1]))[0, 0, 0]) == 1000.0  # stored as 10.0
    with pytest.raises(ValueError, match="need 2"):
        pool.set_layer_scales([1.0], [1.0])


def test_checkpoint_kv_scales_are_read_by_their_names(tmp_path: torch.Tensor) -> None:
    tensors = {
        "model.layers.0.self_attn.k_scale": torch.tensor(2.0),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.5),
        "model.layers.2.self_attn.kv_scale": torch.tensor(4.0),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert checkpoint_kv_scales(tmp_path, 3) == ([2.0, 1.0, 4.0], [0.5, 1.0, 4.0])
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    assert checkpoint_kv_scales(tmp_path, 3) is None
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="k_scale"):
        checkpoint_kv_scales(tmp_path, 3)
