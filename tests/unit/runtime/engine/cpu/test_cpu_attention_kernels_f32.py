"""The fp32 attention kernels (csrc/attention_f32.c through runtime/engine/cpu/attention_kernels.py) against
float64 torch references, at every build level this CPU runs (16 lanes, 8 lanes, plain C).

Covers the register tiles and their remainders: group sizes 1..12 (split into row chunks),
head dims 64, 128 and 80 (not a multiple of the 2-vector tile), key counts that are not a
multiple of the vector width, the 16-key pack or the softmax blocks, strided query and token
rows, padded keys through the bias, the mirror append, the continuation from a prefix's
(out, lse), and the log-sum-exp outputs.
"""

from __future__ import annotations

import pytest
import torch

from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import attention_kernels_f32, kernel_library

pytestmark = pytest.mark.usefixtures("kernel_level")  # every build this CPU runs (tests/conftest.py)

TOL = dict(atol=1e-5, rtol=1e-5)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, scale: float):
    """float64 softmax attention: q [..., M, D] against k, v [..., L, D]; valid [..., 1, L] or None."""
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    return scores.softmax(-1) @ v.double(), scores.logsumexp(-1)


def _bias(lens: list[int], cap: int) -> torch.Tensor:
    valid = torch.arange(cap)[None, :] < torch.tensor(lens)[:, None]
    return torch.zeros(len(lens), 1, 1, cap).masked_fill_(~valid[:, None, None, :], float("-inf"))


def _mirror(gen: torch.Generator, lens: list[int], hkv: int, group: int, d: int, pad: int = 9):
    """Strided query rows [n, hkv, group, d] and a mirror K^T / V with NaN past the widest request."""
    n, width = len(lens), max(lens)
    cap = width + pad
    rows = torch.randn(n, hkv * group * d + 24, generator=gen)
    q = rows[:, : hkv * group * d].view(n, hkv, group, d)
    k_t, v = torch.randn(n, hkv, d, cap, generator=gen), torch.randn(n, hkv, cap, d, generator=gen)
    k_t[..., width:] = float("nan")  # never read: width stops the kernel first
    v[:, :, width:] = float("nan")
    return q, k_t, v, _bias(lens, cap), width


def _own_reference(q, k_t, v, lens, width, scale):
    valid = (torch.arange(width)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    return _attention(q, k_t[..., :width].transpose(-1, -2), v[:, :, :width], valid, scale)


def test_the_fp32_kernels_apply_where_vectorised(kernel_level: str) -> None:
    """They take fp32 attention at the vector builds only (torch's own kernels beat plain C)."""
    vectorised = kernel_level != "baseline"
    assert attention_kernels_f32.applies() == vectorised
    assert attn_kernels.prefix_supported(torch.float32, torch.device("cpu"), 80) == vectorised
    q, k_t, v, bias, _ = _mirror(torch.Generator().manual_seed(0), [3, 5], 2, 4, 64)
    assert attn_kernels.supports(q, k_t, v, bias) == vectorised
    assert not attn_kernels.supports(q, k_t.bfloat16(), v.bfloat16(), bias)  # one dtype throughout
    assert not attn_kernels.prefix_supported(torch.float32, torch.device("cpu"), 320)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 12])
@pytest.mark.parametrize("d", [64, 128, 80])
def test_decode_matches_attention(group: int, d: int) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + d)
    lens = [1, 17, 300, 129] if group % 2 else [7, 161, 40]
    q, k_t, v, bias, width = _mirror(gen, lens, 2, group, d)
    out, lse = attn_kernels.decode_attention(q, k_t, v, bias, d**-0.5, width, with_lse=True)
    expected, expected_lse = _own_reference(q, k_t, v, lens, width, d**-0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape and lse is not None
    torch.testing.assert_close(out.double(), expected, **TOL)
    torch.testing.assert_close(lse.double(), expected_lse, **TOL)


def test_decode_without_bias_or_lse_and_large_groups() -> None:
    gen = torch.Generator().manual_seed(5)
    for group, d in ((16, 64), (16, 256), (9, 32)):
        q, k_t, v, _, width = _mirror(gen, [33, 33], 1, group, d, pad=0)
        out, lse = attn_kernels.decode_attention(q, k_t, v, None, 0.3, width, with_lse=False)
        assert lse is None
        torch.testing.assert_close(out.double(), _own_reference(q, k_t, v, [33, 33], width, 0.3)[0], **TOL)
    q, k_t, v, bias, width = _mirror(gen, [4], 1, 17, 64)
    with pytest.raises(ValueError):  # past the kernel's bounds: refused, nothing written
        attn_kernels.decode_attention(q, k_t, v, bias, 0.1, width, with_lse=False)


def test_decode_stores_the_append_first() -> None:
    """KeyAppend: each request's new key and value land at pos[b] of its mirror rows (strided
    sources, as views of a fused qkv output are) before attention reads them."""
    gen = torch.Generator().manual_seed(7)
    hkv, group, d = 2, 4, 80
    lens = [6, 19, 1]
    q, k_t, v, bias, width = _mirror(gen, [length + 1 for length in lens], hkv, group, d)
    kv_new = torch.randn(len(lens), 2 * hkv * d + 8, generator=gen)
    k_new = kv_new[:, : hkv * d].view(-1, hkv, d)
    v_new = kv_new[:, hkv * d : 2 * hkv * d].view(-1, hkv, d)
    pos = torch.tensor(lens, dtype=torch.int64)
    append = attn_kernels.KeyAppend(k_new, v_new, pos)
    assert attn_kernels.append_supported(append, k_t)
    k_expect, v_expect = k_t.clone(), v.clone()
    for b, p in enumerate(lens):
        k_expect[b, :, :, p], v_expect[b, :, p] = k_new[b], v_new[b]
    out, _ = attn_kernels.decode_attention(q, k_t, v, bias, d**-0.5, width, False, append)
    assert torch.equal(k_t.nan_to_num(), k_expect.nan_to_num()) and torch.equal(v.nan_to_num(), v_expect.nan_to_num())
    expected, _ = _own_reference(q, k_expect, v_expect, [length + 1 for length in lens], width, d**-0.5)
    torch.testing.assert_close(out.double(), expected, **TOL)
    with pytest.raises(ValueError):  # a position outside the mirror
        attn_kernels.decode_attention(
            q,
            k_t,
            v,
            bias,
            1.0,
            width,
            False,
            attn_kernels.KeyAppend(k_new, v_new, torch.tensor([0, k_t.shape[-1], 0])),
        )


@pytest.mark.parametrize("group,d,p", [(4, 64, 1), (1, 64, 15), (3, 80, 17), (4, 128, 300), (12, 64, 513)])
def test_prefix_then_decode_continues_the_softmax(group: int, d: int, p: int) -> None:
    """Cascade: every query against a packed shared prefix (out, lse), then each request's own keys
    continuing that softmax (init) equals attention over prefix ++ own keys."""
    gen = torch.Generator().manual_seed(p + group)
    hkv, lens, scale = 2, [0, 5, 40, 1, 17], d**-0.5
    q, k_t, v, bias, width = _mirror(gen, [max(length, 1) for length in lens], hkv, group, d)
    bias[0] = float("-inf")  # request 0 has no own keys yet: only the prefix
    k_pre, v_pre = torch.randn(p, hkv, d, generator=gen), torch.randn(p, hkv, d, generator=gen)
    packed = attn_kernels.pack_prefix(k_pre, v_pre)
    o_pre, lse_pre = attn_kernels.prefix_attention(q, packed, scale)
    expected_pre, expected_lse_pre = _attention(q, k_pre.transpose(0, 1), v_pre.transpose(0, 1), None, scale)
    torch.testing.assert_close(o_pre.double(), expected_pre, **TOL)
    torch.testing.assert_close(lse_pre.double(), expected_lse_pre, **TOL)

    out, lse = attn_kernels.decode_attention(q, k_t, v, bias, scale, width, True, None, (o_pre, lse_pre))
    keys = torch.cat([k_pre.transpose(0, 1).expand(len(lens), -1, -1, -1), k_t[..., :width].transpose(-1, -2)], 2)
    values = torch.cat([v_pre.transpose(0, 1).expand(len(lens), -1, -1, -1), v[:, :, :width]], 2)
    valid = torch.cat(
        [torch.ones(len(lens), p, dtype=torch.bool), torch.arange(width)[None, :] < torch.tensor(lens)[:, None]], 1
    )[:, None, None, :]
    expected, expected_lse = _attention(q, keys, values, valid, scale)
    assert lse is not None
    torch.testing.assert_close(out.double(), expected, **TOL)
    torch.testing.assert_close(lse.double(), expected_lse, **TOL)


def test_decode_continues_an_empty_prefix() -> None:
    """init rows with lse -inf (no prefix key seen) leave the result to the request's own keys."""
    gen = torch.Generator().manual_seed(11)
    q, k_t, v, bias, width = _mirror(gen, [3, 70], 1, 4, 64)
    init = (torch.zeros(q.shape), torch.full(q.shape[:3], float("-inf")))
    out, _ = attn_kernels.decode_attention(q, k_t, v, bias, 0.125, width, False, None, init)
    torch.testing.assert_close(out.double(), _own_reference(q, k_t, v, [3, 70], width, 0.125)[0], **TOL)


@pytest.mark.parametrize(
    "n,length,heads,kv_heads,d",
    [(3, 37, 8, 2, 64), (2, 1, 4, 4, 64), (1, 300, 3, 1, 80), (2, 18, 12, 1, 128), (4, 16, 4, 2, 32)],
)
def test_causal_prefill_matches_attention(n: int, length: int, heads: int, kv_heads: int, d: int) -> None:
    """q, k, v as strided views of one fused qkv output (the model's layout), with the lse."""
    gen = torch.Generator().manual_seed(length * heads + d)
    qkv = torch.randn(n * length, (heads + 2 * kv_heads) * d + 4, generator=gen)
    q = qkv[:, : heads * d].view(n, length, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, length, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d : (heads + 2 * kv_heads) * d].view(n, length, kv_heads, d)
    token_strides = [t.stride(0) // length for t in (q, k, v)]  # (stride(1) is arbitrary when length is 1)
    result = attn_kernels.causal_attention(q, k, v, d**-0.5, with_lse=True)
    if not attention_kernels_f32.applies():
        assert result is None and kernel_library.level() == "baseline"  # plain C: the backend keeps torch's
        result = attention_kernels_f32.causal(q, k, v, token_strides, d**-0.5, True)
    assert result is not None
    out, lse = result
    group = heads // kv_heads
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    expected, expected_lse = _attention(
        q.transpose(1, 2),
        k.transpose(1, 2).repeat_interleave(group, 1),
        v.transpose(1, 2).repeat_interleave(group, 1),
        causal,
        d**-0.5,
    )
    assert lse is not None and out.shape == (n * length, heads, d)
    torch.testing.assert_close(out.double(), expected.transpose(1, 2).reshape(n * length, heads, d), **TOL)
    torch.testing.assert_close(lse.double(), expected_lse.transpose(1, 2).reshape(n * length, heads), **TOL)
    no_lse = attention_kernels_f32.causal(q, k, v, token_strides, d**-0.5, False)
    assert no_lse is not None and no_lse[1] is None and torch.equal(no_lse[0], out)
