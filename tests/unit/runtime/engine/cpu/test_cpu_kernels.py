"""The C kernels of runtime/engine/cpu/kernels.py against fp32 / torch references.

Covers the AVX-512 register-blocked paths (group <= 8, head dim a multiple of 64; group <= 4
scores 32 keys per pass, then 16, then one at a time) and the
plain-C remainders (group 12, head dim 80, key counts that are not a multiple of 16 or of
the 128-key softmax block), padded keys through the bias, ``width`` below the buffer
capacity, strided query rows and the log-sum-exp output.
"""

from __future__ import annotations

import pytest
import torch

from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import kernel_library
from runtime.engine.cpu import kernels as cpu_kernels

pytestmark = pytest.mark.usefixtures("kernel_level")  # every build this CPU runs (tests/conftest.py)


def _reference(q, k_t, v, lens, scale):
    """fp32 softmax attention; keys >= lens[i] of request i are excluded."""
    scores = torch.matmul(q.float(), k_t.float()) * scale  # [n, Hkv, group, cap]
    valid = torch.arange(k_t.shape[-1])[None, :] < torch.tensor(lens)[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()), torch.logsumexp(scores, -1)


def _bias(lens: list[int], cap: int) -> torch.Tensor:
    valid = torch.arange(cap)[None, :] < torch.tensor(lens)[:, None]
    return torch.zeros(len(lens), 1, 1, cap).masked_fill_(~valid[:, None, None, :], float("-inf"))


def test_the_kernel_builds_here() -> None:
    assert cpu_kernels.available(), "gcc should build the kernel on every supported machine"


@pytest.mark.parametrize("group,d", [(1, 64), (3, 64), (4, 64), (8, 128), (2, 80), (12, 64)])
@pytest.mark.parametrize("lens", [[1, 1], [5, 17, 128], [129, 40, 300, 7], [178, 50, 3]])
def test_matches_fp32_attention(group: int, d: int, lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + d + len(lens))
    n, hkv = len(lens), 2
    width = max(lens)
    cap = width + 9  # keys past the widest request are padding the kernel must not read
    rows = torch.randn(n, hkv * group * d + 24, generator=gen).bfloat16()  # strided query rows
    q = rows[:, : hkv * group * d].view(n, hkv, group, d)
    k_t = torch.randn(n, hkv, d, cap, generator=gen).bfloat16()
    v = torch.randn(n, hkv, cap, d, generator=gen).bfloat16()
    k_t[..., width:] = float("nan")  # never read: width stops the kernel first
    v[:, :, width:] = float("nan")
    bias = _bias(lens, cap)
    assert attn_kernels.supports(q, k_t, v, bias)
    out, lse = attn_kernels.decode_attention(q, k_t, v, bias, d**-0.5, width, with_lse=True)
    expected, expected_lse = _reference(q, k_t[..., :width], v[:, :, :width], lens, d**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (n, hkv, group, d)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-4)


def test_without_bias_or_lse_reads_every_key() -> None:
    gen = torch.Generator().manual_seed(7)
    n, hkv, group, d, cap = 3, 4, 4, 64, 33
    q = torch.randn(n, hkv, group, d, generator=gen).bfloat16()
    k_t = torch.randn(n, hkv, d, cap, generator=gen).bfloat16()
    v = torch.randn(n, hkv, cap, d, generator=gen).bfloat16()
    out, lse = attn_kernels.decode_attention(q, k_t, v, None, 0.3, cap, with_lse=False)
    assert lse is None
    expected, _ = _reference(q, k_t, v, [cap] * n, 0.3)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_operands_it_does_not_take() -> None:
    q = torch.randn(2, 2, 4, 64).bfloat16()
    k_t = torch.randn(2, 2, 64, 8).bfloat16()
    v = torch.randn(2, 2, 8, 64).bfloat16()
    assert attn_kernels.supports(q, k_t, v, None)
    # fp32: its own kernels at the vector builds (test_cpu_attention_kernels_f32.py), torch in plain C
    assert attn_kernels.supports(q.float(), k_t.float(), v.float(), None) == (kernel_library.level() != "baseline")
    assert not attn_kernels.supports(q, k_t.transpose(-1, -2).contiguous().transpose(-1, -2), v, None)
    assert not attn_kernels.supports(q, k_t, v, torch.zeros(2, 1, 1, 8, dtype=torch.bfloat16))
    assert not attn_kernels.supports(torch.randn(2, 1, 32, 64).bfloat16(), k_t[:, :1], v[:, :1], None)  # group > 16


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYSERVE_CPU_KERNELS", "0")
    kernel_library.reset()
    try:
        assert not cpu_kernels.available()
    finally:
        monkeypatch.undo()
        kernel_library.reset()
    assert cpu_kernels.available()


@pytest.mark.parametrize("period,rows_per_position,first_position", [(0, 1, 0), (7, 1, 0), (12, 3, 0), (6, 2, 5)])
def test_row_softmax_in_place(period: int, rows_per_position: int, first_position: int) -> None:
    """Plain rows; causal blocks of one request's queries (group-major); position-major GQA
    folding (3 query heads per position); a run of queries starting at position 5."""
    gen = torch.Generator().manual_seed(period)
    rows = 3 * period if period else 21
    cols = first_position + period // rows_per_position if period else 300
    scores = (torch.randn(rows, cols, generator=gen) * 4).bfloat16()
    logits = scores.float() * 0.3
    if period:
        position = first_position + (torch.arange(rows) % period) // rows_per_position
        logits = logits.masked_fill(torch.arange(cols)[None, :] > position[:, None], float("-inf"))
    assert cpu_kernels.softmax_supported(scores)
    lse = cpu_kernels.softmax_rows(
        scores,
        0.3,
        causal_period=period,
        rows_per_position=rows_per_position,
        first_position=first_position,
        with_lse=True,
    )
    torch.testing.assert_close(scores.float(), logits.softmax(-1), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-4)
    assert cpu_kernels.softmax_rows(scores, 1.0) is None
    assert not cpu_kernels.softmax_supported(scores.float())
    assert not cpu_kernels.softmax_supported(torch.zeros(2, cpu_kernels.MAX_SOFTMAX_COLS + 1, dtype=torch.bfloat16))


def _ulp_close(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 1e-3) -> None:
    """bf16 results equal torch's except for rare one-ulp rounding differences."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)  # within one bf16 ulp
    assert (got != want).float().mean().item() <= max_mismatch


@pytest.mark.parametrize("inter", [7, 300, 2816])  # no 16-lane block, 18 blocks + a tail, whole blocks
def test_silu_and_mul_matches_torch_bf16(inter: int) -> None:
    gen = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(37, 2 * inter, generator=gen) * 6).bfloat16()
    specials = torch.tensor([0.0, -100.0, 100.0, -0.5, -90.0, float("inf"), float("-inf"), float("nan")])
    gate_up[0, : min(inter, 8)] = specials[: min(inter, 8)]  # zero, saturating tails, exp's cut-off
    gate_up[1, inter - 1] = float("nan")  # in the scalar tail where there is one
    out = cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert torch.equal(out.isnan(), want.isnan())
    finite = ~want.isnan()
    _ulp_close(out[finite], want[finite])
    assert cpu_kernels.silu_and_mul(gate_up.half()) is None  # fp32: test_cpu_kernels_f32.py


@pytest.mark.parametrize("n", [0, 5, 300])  # 300: the parallel loop
def test_store_kv_writes_the_rows_index_put_would(n: int) -> None:
    gen = torch.Generator().manual_seed(13)
    slots, hkv, d = 400, 2, 64
    k_buf, v_buf = (
        torch.randn(slots, hkv, d, generator=gen).bfloat16(),
        torch.randn(slots, hkv, d, generator=gen).bfloat16(),
    )
    qkv = torch.randn(n, 4 * hkv * d, generator=gen).bfloat16()  # k and v as strided views, as the model has them
    k, v = qkv[:, hkv * d : 2 * hkv * d].view(n, hkv, d), qkv[:, 2 * hkv * d : 3 * hkv * d].view(n, hkv, d)
    loc = torch.randperm(slots, generator=gen)[:n]
    want_k, want_v = k_buf.clone(), v_buf.clone()
    want_k[loc], want_v[loc] = k, v
    assert cpu_kernels.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


def test_store_kv_refuses_what_it_cannot_write() -> None:
    k_buf, v_buf = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    k = v = torch.ones(2, 2, 4)
    before = k_buf.clone()
    assert not cpu_kernels.store_kv(k_buf, v_buf, torch.tensor([1, 8]), k, v)  # slot past the pool
    assert not cpu_kernels.store_kv(k_buf, v_buf, torch.tensor([1, -1]), k, v)
    assert torch.equal(k_buf, before)
    assert not cpu_kernels.store_kv(k_buf, v_buf, torch.tensor([1, 2], dtype=torch.int32), k, v)
    assert not cpu_kernels.store_kv(k_buf, v_buf, torch.tensor([1, 2]), k.bfloat16(), v.bfloat16())  # dtype
    assert not cpu_kernels.store_kv(k_buf, v_buf, torch.tensor([1, 2]), k.transpose(1, 2), v)  # layout
    assert cpu_kernels.store_kv(k_buf, v_buf, torch.tensor([1, 2]), k, v)  # fp32 rows are bytes too
    assert torch.equal(k_buf[1:3], k) and torch.equal(v_buf[1:3], v)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_hf_recipe(with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(9, 1024, generator=gen) * 3).bfloat16()
    residual = torch.randn(9, 1024, generator=gen).bfloat16()
    weight = torch.randn(1024, generator=gen).bfloat16()
    source = (residual + x) if with_residual else x
    v = source.float()
    want = weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    res = residual.clone() if with_residual else None
    out = cpu_kernels.rms_norm(x, res, weight, 1e-6)
    _ulp_close(out, want, max_mismatch=2e-3)
    if with_residual:
        assert torch.equal(res, source)  # the sum is left in the residual buffer
    assert cpu_kernels.rms_norm(x.half(), None, weight.half(), 1e-6) is None  # fp32: test_cpu_kernels_f32.py
    assert cpu_kernels.rms_norm(x.t().contiguous().t(), None, weight, 1e-6) is None  # strided rows: torch path


def test_merge_attention_reads_strided_operands() -> None:
    """Two partial softmaxes merged by log-sum-exp equal one softmax over both key sets."""
    torch.manual_seed(3)
    t, hkv, group, d = 5, 2, 3, 64
    q = torch.randn(t, hkv, group, d)
    keys_a, keys_b = torch.randn(t, hkv, 7, d), torch.randn(t, hkv, 11, d)
    vals_a, vals_b = torch.randn(t, hkv, 7, d), torch.randn(t, hkv, 11, d)

    def part(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = q @ k.transpose(-1, -2)
        return scores.softmax(-1) @ v, scores.logsumexp(-1)

    o_a, lse_a = part(keys_a, vals_a)
    o_b, lse_b = part(keys_b, vals_b)
    expected = (q @ torch.cat([keys_a, keys_b], 2).transpose(-1, -2)).softmax(-1) @ torch.cat([vals_a, vals_b], 2)
    # o_a laid out head-major, as the cascade's prefix pass produces it: a strided [T, A, B, D] view
    o_a_strided = o_a.bfloat16().permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    lse_a_strided = lse_a.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    merged = cpu_kernels.merge_attention(o_a_strided, lse_a_strided, o_b.bfloat16(), lse_b)
    assert merged is not None and merged.is_contiguous() and merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged.float(), expected, atol=2e-2, rtol=2e-2)
    # a row with no keys on either side is 0, not NaN
    lse_a[0, 0, 0] = lse_b[0, 0, 0] = float("-inf")
    merged = cpu_kernels.merge_attention(o_a.bfloat16(), lse_a, o_b.bfloat16(), lse_b)
    assert merged is not None and bool((merged[0, 0, 0] == 0).all()) and not merged.isnan().any()
    # operands it does not take: fp32 outputs, fp16 lse
    assert cpu_kernels.merge_attention(o_a, lse_a, o_b, lse_b) is None
    assert cpu_kernels.merge_attention(o_a.bfloat16(), lse_a.half(), o_b.bfloat16(), lse_b) is None


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_in_place_is_bit_identical_to_torch(rotary_dim: int) -> None:
    """On the q and k heads of a fused qkv output (strided rows), including a partial rotary dim."""
    from runtime.engine.layers.rotary import RotaryEmbedding
    from runtime.engine.rope_config import RopeConfig

    torch.manual_seed(4)
    t, heads, kv_heads, d = 9, 4, 2, 64
    rope = RotaryEmbedding(d, 128, RopeConfig(rope_type="default", theta=10000.0), rotary_dim=rotary_dim)
    cos, sin = rope.cos_sin(torch.tensor([0, 5, 7, 1, 100, 3, 2, 8, 127]), torch.bfloat16)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).bfloat16()
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    expected = rope.rotate(qk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    assert cpu_kernels.rotary_(qk, cos, sin, rotary_dim)  # in place: q and k stay views of qkv
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched
    assert not cpu_kernels.rotary_(qk.float(), cos, sin, rotary_dim)  # fp32 keeps torch's path


def test_decode_attention_stores_the_appended_keys_first() -> None:
    torch.manual_seed(5)
    n, hkv, group, d, cap = 3, 2, 4, 64, 40
    lens = [7, 33, 20]
    q = torch.randn(n, hkv, group, d).bfloat16()
    k_t = torch.randn(n, hkv, d, cap).bfloat16()
    v = torch.randn(n, hkv, cap, d).bfloat16()
    kv_new = torch.randn(n, 2 * hkv, d).bfloat16()
    pos = torch.tensor([length - 1 for length in lens])
    stored_k, stored_v = k_t.clone(), v.clone()
    for b, p in enumerate(pos.tolist()):
        stored_k[b, :, :, p] = kv_new[b, :hkv]
        stored_v[b, :, p] = kv_new[b, hkv:]
        k_t[b, :, :, p] = float("nan")  # the kernel must overwrite these before reading them
        v[b, :, p] = float("nan")
    append = attn_kernels.KeyAppend(kv_new[:, :hkv], kv_new[:, hkv:], pos)
    assert attn_kernels.append_supported(append, k_t)
    out, lse = attn_kernels.decode_attention(q, k_t, v, _bias(lens, cap), d**-0.5, max(lens), True, append)
    assert torch.equal(k_t, stored_k) and torch.equal(v, stored_v)
    expected, expected_lse = _reference(q, stored_k, stored_v, lens, d**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, expected_lse, atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError):
        attn_kernels.decode_attention(
            q, k_t, v, None, 1.0, cap, False, attn_kernels.KeyAppend(append.k, append.v, pos + cap)
        )
    assert not attn_kernels.append_supported(attn_kernels.KeyAppend(append.k.float(), append.v, pos), k_t)


def test_argmax_rows_matches_torch_on_ties_nan_and_strided_rows() -> None:
    torch.manual_seed(6)
    x = torch.randn(5, 1000)
    x[1, 17] = x[1, 900] = 50.0  # a tie: the first one wins
    x[2, 3] = float("nan")  # torch.argmax answers the first NaN
    x[2, 700] = float("nan")
    x[3] = float("-inf")
    x[4, 999] = 99.0  # the max in the scalar tail (cols not a multiple of 16)
    for rows in (x, x[:, :999], torch.cat([x, x], 1)[:, 3:1003]):  # contiguous, shorter rows, offset rows
        out = cpu_kernels.argmax_rows(rows)
        assert out is not None and out.dtype == torch.int64
        assert torch.equal(out, rows.argmax(dim=-1))
    assert cpu_kernels.argmax_rows(x.bfloat16()) is None
    assert cpu_kernels.argmax_rows(x.t()) is None  # columns not unit-stride


@pytest.mark.parametrize("group,d,p", [(4, 64, 512), (1, 64, 37), (8, 128, 600), (3, 64, 33)])  # 600: two key blocks
def test_prefix_attention_then_own_keys_equals_one_softmax(group: int, d: int, p: int, amx: bool) -> None:
    """The shared prefix through the pair-packed BF16 kernel, then each request's own keys through
    the decode kernel continuing from it, against one fp32 softmax over both."""
    torch.manual_seed(7)
    n, hkv, cap = 5, 2, 24
    lens = [1, 24, 9, 17, 3]
    rows = torch.randn(n, hkv * group * d + 8).bfloat16()  # strided request rows
    q = rows[:, : hkv * group * d].view(n, hkv, group, d)
    k_pre, v_pre = torch.randn(p, hkv, d).bfloat16(), torch.randn(p, hkv, d).bfloat16()
    k_t, v = torch.randn(n, hkv, d, cap).bfloat16(), torch.randn(n, hkv, cap, d).bfloat16()
    scale = d**-0.5
    packed = attn_kernels.pack_prefix(k_pre, v_pre)
    assert (
        packed.k.shape[1] * attn_kernels.PREFIX_KEY_BLOCK
    ) % attn_kernels.PREFIX_KEY_ALIGN == 0 and packed.length == p
    if not attn_kernels.prefix_supported(torch.bfloat16, torch.device("cpu"), d):
        with pytest.raises(ValueError):  # built without AVX-512: it refuses, and the backend keeps the GEMM cascade
            attn_kernels.prefix_attention(q, packed, scale)
        return
    o_pre, lse_pre = attn_kernels.prefix_attention(q, packed, scale)
    qf = q.float()
    scores_pre = torch.einsum("nhgd,phd->nhgp", qf, k_pre.float()) * scale
    torch.testing.assert_close(lse_pre, scores_pre.logsumexp(-1), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(o_pre, scores_pre.softmax(-1) @ v_pre.float().transpose(0, 1), atol=2e-2, rtol=2e-2)
    out, lse = attn_kernels.decode_attention(q, k_t, v, _bias(lens, cap), scale, max(lens), True, init=(o_pre, lse_pre))
    own = torch.matmul(qf, k_t.float()) * scale
    own = own.masked_fill(
        torch.arange(cap)[None, None, None, :] >= torch.tensor(lens)[:, None, None, None], float("-inf")
    )
    scores = torch.cat([scores_pre, own], -1)
    values = torch.cat([v_pre.float().transpose(0, 1)[None].expand(n, -1, -1, -1), v.float()], 2)
    torch.testing.assert_close(out.float(), scores.softmax(-1) @ values, atol=2e-2, rtol=2e-2)
    assert lse is not None
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "n,length,group,d",
    [
        (3, 37, 4, 64),  # a 16-row block that ends mid-position, a partly padded 32-key tail
        (1, 600, 1, 64),  # two online-softmax key blocks (512 + 88), one position per row
        (2, 1, 8, 128),  # a single token: one key, half a row block
        (4, 17, 3, 64),  # a group that does not divide 16
    ],
)
def test_causal_attention_matches_fp32(n: int, length: int, group: int, d: int, amx: bool) -> None:
    """The prefill kernel (each request's keys packed once, rows read only the keys up to their
    position) against fp32 causal attention, out and log-sum-exp, on the strided token rows of a
    fused qkv output."""
    gen = torch.Generator().manual_seed(length * 10 + group)
    hkv = 2
    h = hkv * group
    qkv = torch.randn(n * length, (h + 2 * hkv) * d + 8, generator=gen).bfloat16()  # padded rows: strided
    q = qkv[:, : h * d].view(n, length, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(n, length, hkv, d)
    v = qkv[:, (h + hkv) * d : (h + 2 * hkv) * d].view(n, length, hkv, d)
    scale = d**-0.5
    result = attn_kernels.causal_attention(q, k, v, scale, with_lse=True)
    if not attn_kernels.prefix_supported(torch.bfloat16, torch.device("cpu"), d):
        assert result is None  # built without AVX-512: the matmul path runs instead
        return
    assert result is not None
    out, lse = result
    assert out.shape == (n * length, h, d) and out.dtype == torch.bfloat16 and lse is not None
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    scores = (qf @ kf.transpose(-1, -2) * scale).masked_fill(
        torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf")
    )
    expected = (scores.softmax(-1) @ vf).transpose(1, 2).reshape(n * length, h, d)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, scores.logsumexp(-1).transpose(1, 2).reshape(n * length, h), atol=2e-3, rtol=1e-3)
    again = attn_kernels.causal_attention(q, k, v, scale)
    assert again is not None and again[1] is None and torch.equal(again[0], out)


def test_causal_attention_refuses_what_it_cannot_read() -> None:
    q = torch.randn(2, 5, 4, 64).bfloat16()
    k = v = torch.randn(2, 5, 2, 64).bfloat16()
    fp32 = attn_kernels.causal_attention(q.float(), k.float(), v.float(), 0.1)
    assert (fp32 is None) == (kernel_library.level() == "baseline")  # fp32: its own kernel at the vector builds
    assert attn_kernels.causal_attention(q[..., :48], k[..., :48], v[..., :48], 0.1) is None  # head dim 48
    assert (
        attn_kernels.causal_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 0.1) is None
    )  # head-major
    assert attn_kernels.causal_attention(q, torch.randn(2, 5, 3, 64).bfloat16(), v, 0.1) is None  # 4 heads, 3 KV heads
    uneven = torch.randn(2, 7, 2, 64).bfloat16()[:, :5]  # requests 7 token rows apart, 5 used
    assert attn_kernels.causal_attention(q, uneven, v, 0.1) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mirror_gather_writes_the_pool_rows_in_the_mirrors_layouts(dtype) -> None:
    """Keys [0, w) of each request: pool rows into transposed K and into V, any w (not a multiple
    of the kernel's 16-key blocks), padding slot 0 repeated; columns from w on untouched; a slot
    outside the pool writes nothing."""
    gen = torch.Generator().manual_seed(8)
    slots, hkv, d, n, w, cap = 90, 2, 24, 3, 37, 48
    k_buf = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    v_buf = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    loc = torch.randint(0, slots, (n * w,), generator=gen)
    loc[w - 3 : w] = 0  # a shorter request's padding
    dense_k = torch.full((n, hkv, d, cap), 7.0, dtype=dtype)
    dense_v = torch.full((n, hkv, cap, d), 7.0, dtype=dtype)
    assert cpu_kernels.mirror_gather(k_buf, v_buf, loc, w, dense_k, dense_v)
    gathered_k, gathered_v = k_buf[loc].view(n, w, hkv, d), v_buf[loc].view(n, w, hkv, d)
    assert torch.equal(dense_k[..., :w], gathered_k.permute(0, 2, 3, 1))
    assert torch.equal(dense_v[:, :, :w], gathered_v.transpose(1, 2))
    assert (dense_k[..., w:] == 7).all() and (dense_v[:, :, w:] == 7).all()
    before_k, before_v = dense_k.clone(), dense_v.clone()
    bad = loc.clone()
    bad[-1] = slots
    assert not cpu_kernels.mirror_gather(k_buf, v_buf, bad, w, dense_k, dense_v)
    assert torch.equal(dense_k, before_k) and torch.equal(dense_v, before_v)
    assert not cpu_kernels.mirror_gather(k_buf, v_buf, loc.int(), w, dense_k, dense_v)  # int32 slots: torch's path
