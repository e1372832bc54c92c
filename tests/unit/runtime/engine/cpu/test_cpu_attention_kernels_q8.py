"""Decode attention over a quantized mirror (csrc/attention_q8.c through runtime/engine/cpu/attention_kernels_q8.py)
against a float64 reference computed over the dequantized values (``KVCacheFormat.dequantize``), at every build level
this CPU runs (16 lanes, 8 lanes with F16C, plain C).

Covers int8 (per-key scales), fp8 e4m3 (its subnormals, its 2^8 and layer scales folded in) and e5m2; bf16 and fp32
queries (strided request rows); GQA groups 1..16 (split into row chunks), head dims that are not a multiple of the
vector (72, 80); widths that are not a multiple of 16 or of the 128-key block, with keys past a request's length
masked by the bias and codes past the width that would poison a read (NaN scales, NaN codes); the append of the
pool's stored rows; the continuation from a shared prefix's (out, lse); a verify step's rows sharing mirror rows;
the log-sum-exp; and the bounds it refuses.
"""

from __future__ import annotations

import pytest
import torch

from memory.kv_format import KVCacheFormat
from runtime.engine.cpu import attention_kernels_q8 as q8
from runtime.engine.cpu.kv_quant_kernels import row_scales

pytestmark = pytest.mark.usefixtures("kernel_level")  # every build this CPU runs (tests/conftest.py)

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, scale: float):
    """float64 softmax attention: q [..., M, D] against k, v [..., L, D]; valid [..., 1, L] or None."""
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    return scores.softmax(-1) @ v.double(), scores.logsumexp(-1)


def _bias(lens: list[int], cap: int) -> torch.Tensor:
    valid = torch.arange(cap)[None, :] < torch.tensor(lens)[:, None]
    return torch.zeros(len(lens), 1, 1, cap).masked_fill_(~valid[:, None, None, :], float("-inf"))


def _queries(gen: torch.Generator, n: int, hkv: int, group: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    rows = torch.randn(n, hkv * group * d + 24, generator=gen).to(dtype)
    return rows[:, : hkv * group * d].view(n, hkv, group, d)  # (strided request rows)


def _mirror(
    gen: torch.Generator, name: str, rows: int, hkv: int, d: int, width: int, pad: int = 9, scales: tuple = (1.0, 1.0)
) -> tuple[q8.QuantizedKeys, torch.Tensor, torch.Tensor]:
    """Quantized copies of random keys and values (``[rows, Hkv, width, D]``) with poison past the width;
    returns the copies and the dequantized keys and values (fp32 ``[rows, Hkv, width, D]``)."""
    fmt = KVCacheFormat(name, torch.float32)
    k_scale, v_scale = scales if fmt.is_fp8 else (1.0, 1.0)
    k_vals = torch.randn(rows, hkv, width, d, generator=gen) * 3
    v_vals = torch.randn(rows, hkv, width, d, generator=gen) * torch.rand(rows, hkv, width, 1, generator=gen)
    if fmt.is_fp8:
        k_vals[..., :3] *= 1e-3  # e4m3's subnormals (and e5m2's) among the codes
    k_rows, v_rows = fmt.quantize(k_vals, k_scale), fmt.quantize(v_vals, v_scale)
    cap = width + pad
    codes_k = torch.full((rows, hkv, d, cap), 0x7F, dtype=torch.uint8).view(fmt.storage)  # NaN / 480 / 127
    codes_v = torch.full((rows, hkv, cap, d), 0x7F, dtype=torch.uint8).view(fmt.storage)
    codes_k[..., :width] = k_rows[..., :d].transpose(-1, -2)
    codes_v[:, :, :width] = v_rows[..., :d]
    k_sc = v_sc = None
    if name == "int8":
        k_sc, v_sc = torch.full((rows, hkv, cap), float("nan")), torch.full((rows, hkv, cap), float("nan"))
        k_sc[..., :width], v_sc[..., :width] = row_scales(k_rows), row_scales(v_rows)
    keys = q8.QuantizedKeys(fmt, codes_k, codes_v, k_sc, v_sc, k_scale, v_scale)
    return keys, fmt.dequantize(k_rows, k_scale, torch.float32), fmt.dequantize(v_rows, v_scale, torch.float32)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float):
    valid = (torch.arange(k.shape[2])[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    return _attention(q, k, v, valid, scale)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group,d", [(1, 64), (3, 64), (4, 80), (5, 72), (8, 128), (9, 64), (16, 32)])
def test_decode_matches_attention_over_the_dequantized_values(name: str, dtype: torch.dtype, group: int, d: int):
    gen = torch.Generator().manual_seed(group * 100 + d)
    lens = [1, 17, 300, 129] if group % 2 else [7, 161, 40]
    hkv, width = 2, max(lens)
    q = _queries(gen, len(lens), hkv, group, d, dtype)
    keys, k, v = _mirror(gen, name, len(lens), hkv, d, width, scales=(0.5, 3.0))
    bias = _bias(lens, keys.k.shape[-1])
    assert q8.supports(q, keys, bias)
    out, lse = q8.decode_attention(q, keys, bias, d**-0.5, width, with_lse=True)
    expected, expected_lse = _reference(q, k, v, lens, d**-0.5)
    assert out.dtype == dtype and out.shape == q.shape and lse is not None
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    torch.testing.assert_close(lse.double(), expected_lse, **TOL[dtype])


@pytest.mark.parametrize("name", FORMATS)
def test_without_bias_or_lse_and_one_key(name: str) -> None:
    gen = torch.Generator().manual_seed(3)
    for width in (1, 16, 33):
        q = _queries(gen, 2, 3, 3, 64, torch.float32)
        keys, k, v = _mirror(gen, name, 2, 3, 64, width, pad=0)
        out, lse = q8.decode_attention(q, keys, None, 0.125, width, with_lse=False)
        assert lse is None
        torch.testing.assert_close(out.double(), _attention(q, k, v, None, 0.125)[0], **TOL[torch.float32])


@pytest.mark.parametrize("name", FORMATS)
def test_the_append_copies_the_pools_stored_rows_first(name: str) -> None:
    gen = torch.Generator().manual_seed(7)
    hkv, group, d, lens = 3, 3, 64, [6, 19, 130]
    fmt = KVCacheFormat(name, torch.bfloat16)
    q = _queries(gen, len(lens), hkv, group, d, torch.bfloat16)
    keys, k, v = _mirror(gen, name, len(lens), hkv, d, max(lens) + 1, scales=(1.0, 2.0))
    slots = 50
    k_pool = fmt.quantize(torch.randn(slots, hkv, d, generator=gen), keys.k_scale)
    v_pool = fmt.quantize(torch.randn(slots, hkv, d, generator=gen), keys.v_scale)
    loc, pos = torch.tensor([4, 41, 17]), torch.tensor(lens)
    append = q8.PoolAppend(k_pool, v_pool, loc, pos)
    assert q8.append_supported(append, keys, len(lens))
    out, _ = q8.decode_attention(
        q, keys, _bias([n + 1 for n in lens], keys.k.shape[-1]), 0.1, max(lens) + 1, False, append
    )
    for b, p in enumerate(lens):
        assert torch.equal(keys.k[b, :, :, p], k_pool[loc[b], :, :d]) and torch.equal(
            keys.v[b, :, p], v_pool[loc[b], :, :d]
        )
        if name == "int8":
            assert keys.k_scales is not None and keys.v_scales is not None
            assert torch.equal(keys.k_scales[b, :, p], row_scales(k_pool[loc[b]]))
            assert torch.equal(keys.v_scales[b, :, p], row_scales(v_pool[loc[b]]))
        k[b, :, p] = fmt.dequantize(k_pool[loc[b]], keys.k_scale, torch.float32)
        v[b, :, p] = fmt.dequantize(v_pool[loc[b]], keys.v_scale, torch.float32)
    expected, _ = _reference(q, k, v, [n + 1 for n in lens], 0.1)
    torch.testing.assert_close(out.double(), expected, **TOL[torch.bfloat16])
    with pytest.raises(ValueError):  # a slot outside the pool, a position outside the copies
        q8.decode_attention(
            q, keys, None, 0.1, 3, False, q8.PoolAppend(k_pool, v_pool, torch.tensor([1, slots, 2]), pos)
        )
    with pytest.raises(ValueError):
        bad = q8.PoolAppend(k_pool, v_pool, loc, torch.tensor([0, keys.k.shape[-1], 0]))
        q8.decode_attention(q, keys, None, 0.1, 3, False, bad)


@pytest.mark.parametrize("name", FORMATS)
def test_continues_a_prefix_softmax(name: str) -> None:
    """``init``: the (out, lse) of the same queries over a prefix; the result covers prefix and own keys."""
    gen = torch.Generator().manual_seed(11)
    hkv, group, d, lens, p = 2, 4, 64, [3, 40], 70
    q = _queries(gen, len(lens), hkv, group, d, torch.float32)
    keys, k, v = _mirror(gen, name, len(lens), hkv, d, max(lens))
    kp, vp = torch.randn(1, hkv, p, d, generator=gen), torch.randn(1, hkv, p, d, generator=gen)
    o_pre, lse_pre = _attention(q, kp, vp, None, 0.2)
    init = (o_pre.float().contiguous(), lse_pre.float().contiguous())
    out, lse = q8.decode_attention(q, keys, _bias(lens, keys.k.shape[-1]), 0.2, max(lens), True, init=init)
    valid = (torch.arange(p + max(lens))[None, :] < torch.tensor([p + n for n in lens])[:, None])[:, None, None, :]
    k_all = torch.cat([kp.expand(len(lens), -1, -1, -1), k], dim=2)
    v_all = torch.cat([vp.expand(len(lens), -1, -1, -1), v], dim=2)
    expected, expected_lse = _attention(q, k_all, v_all, valid, 0.2)
    assert lse is not None
    torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])
    torch.testing.assert_close(lse.double(), expected_lse, **TOL[torch.float32])


@pytest.mark.parametrize("name", FORMATS)
def test_verify_rows_share_their_requests_mirror_row(name: str) -> None:
    """``kv_row``: a verify step's input token and drafts read their request's row, each up to itself, every
    row's new token copied in before any row attends."""
    gen = torch.Generator().manual_seed(13)
    hkv, group, d = 3, 3, 64
    fmt = KVCacheFormat(name, torch.float32)
    starts, drafts = [10, 33], [3, 2]  # request b's first new key index, its new tokens
    kv_row = torch.tensor([0, 0, 0, 1, 1])
    pos = torch.tensor([10, 11, 12, 33, 34])
    keys, k, v = _mirror(gen, name, 2, hkv, d, 40)
    k_pool = fmt.quantize(torch.randn(20, hkv, d, generator=gen))
    v_pool = fmt.quantize(torch.randn(20, hkv, d, generator=gen))
    loc = torch.tensor([5, 6, 7, 12, 13])
    q = _queries(gen, 5, hkv, group, d, torch.float32)
    cap = keys.k.shape[-1]
    bias = torch.zeros(5, 1, 1, cap).masked_fill_(
        (torch.arange(cap)[None, :] > pos[:, None])[:, None, None, :], float("-inf")
    )
    out, _ = q8.decode_attention(
        q, keys, bias, 0.125, 40, False, q8.PoolAppend(k_pool, v_pool, loc, pos), kv_row=kv_row
    )
    for i in range(5):
        b, at = int(kv_row[i]), int(pos[i])
        k[b, :, at] = fmt.dequantize(k_pool[loc[i]], 1.0, torch.float32)
        v[b, :, at] = fmt.dequantize(v_pool[loc[i]], 1.0, torch.float32)
    assert sum(drafts) == 5 and starts == [10, 33]
    for i in range(5):
        b, at = int(kv_row[i]), int(pos[i])
        expected, _ = _attention(q[i : i + 1], k[b : b + 1, :, : at + 1], v[b : b + 1, :, : at + 1], None, 0.125)
        torch.testing.assert_close(out[i : i + 1].double(), expected, **TOL[torch.float32])


def test_refuses_what_it_cannot_run() -> None:
    gen = torch.Generator().manual_seed(17)
    keys, _, _ = _mirror(gen, "int8", 2, 1, 64, 20)
    q = _queries(gen, 2, 1, 17, 64, torch.float32)
    assert not q8.supports(q, keys, None)  # a group past the kernel's bound
    with pytest.raises(ValueError):
        q8.decode_attention(q, keys, None, 0.1, 20, False)
    q = _queries(gen, 2, 1, 4, 64, torch.float32)
    assert q8.supports(q, keys, None)
    assert not q8.supports(q.half(), keys, None)  # queries of a dtype the kernel does not read
    no_scales = q8.QuantizedKeys(keys.format, keys.k, keys.v, None, None)
    assert not q8.supports(q, no_scales, None)  # int8 without its scales
    with pytest.raises(ValueError):  # a mirror row outside the copies
        q8.decode_attention(q, keys, None, 0.1, 20, False, kv_row=torch.tensor([0, 2]))
