"""Cases for the device ops' kernels, each checked against the plain torch implementation
(``TorchOps``) on copies of the same inputs. Shared by the interpreter tests (CPU, fp32) and
the compiled GPU tests (bf16 / fp16 / fp32); importing this module sets nothing up."""

from __future__ import annotations

import torch

from memory.kv_pool import MHATokenToKVPool
from runtime.engine.layers.rotary import RotaryEmbedding
from runtime.engine.ops import DeviceOps, TorchOps
from runtime.engine.rope_config import RopeConfig

REFERENCE = TorchOps()
LLAMA3_ROPE = RopeConfig(
    rope_type="llama3",
    theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def check_rms_norm(ops: DeviceOps, device: str, dtype: torch.dtype, hidden: int, residual: bool, tol: float) -> None:
    """Rows of odd and even widths, with and without the fused residual add (the residual
    stream must hold ``x + residual`` afterwards)."""
    gen = torch.Generator().manual_seed(hidden * 2 + residual)
    x = _randn(7, hidden, gen=gen, dtype=dtype, device=device) * 3
    weight = _randn(hidden, gen=gen, dtype=dtype, device=device)
    res = _randn(7, hidden, gen=gen, dtype=dtype, device=device) if residual else None
    want_res = None if res is None else res.clone()
    want = REFERENCE.rms_norm(x.clone(), weight, 1e-6, want_res)
    got = ops.rms_norm(x, weight, 1e-6, res)
    _close(got, want, tol)
    if res is not None:
        assert want_res is not None
        _close(res, want_res, tol)


def check_rms_norm_on_head_views(ops: DeviceOps, device: str, dtype: torch.dtype, tol: float) -> None:
    """Qwen3's per-head q norm: ``[T, H, D]`` views of a fused qkv output (strided token rows)."""
    gen = torch.Generator().manual_seed(5)
    t, heads, d = 5, 3, 48
    qkv = _randn(t, heads * d + 40, gen=gen, dtype=dtype, device=device)
    q = qkv[:, : heads * d].view(t, heads, d)
    weight = _randn(d, gen=gen, dtype=dtype, device=device)
    before = qkv.clone()
    _close(ops.rms_norm(q, weight, 1e-6), REFERENCE.rms_norm(q.clone(), weight, 1e-6), tol)
    assert torch.equal(qkv, before)  # the input is read only


def check_rotary(
    ops: DeviceOps,
    device: str,
    dtype: torch.dtype,
    head_dim: int,
    rotary_dim: int,
    llama3: bool,
    fused: bool,
    tol: float,
) -> None:
    """q and k rotated in place: as views of one fused qkv output (strided rows, v untouched) or
    as separate tensors (after a per-head norm); llama3 scaling at positions far past its
    original window."""
    gen = torch.Generator().manual_seed(head_dim + rotary_dim + 2 * llama3 + fused)
    t, hq, hkv, max_pos = 9, 4, 2, 512
    rope_cfg = LLAMA3_ROPE if llama3 else RopeConfig(rope_type="default", theta=10000.0)
    cache = RotaryEmbedding(head_dim, max_pos, rope_cfg, rotary_dim=rotary_dim).to(device)
    positions = torch.tensor([0, 1, 63, 64, 65, 200, 300, 511, 7], dtype=torch.int64, device=device)
    if fused:
        qkv = _randn(t, (hq + 2 * hkv) * head_dim, gen=gen, dtype=dtype, device=device)
        q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
        k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(t, hkv, head_dim)
        v_before = qkv[:, (hq + hkv) * head_dim :].clone()
    else:
        q = _randn(t, hq, head_dim, gen=gen, dtype=dtype, device=device)
        k = _randn(t, hkv, head_dim, gen=gen, dtype=dtype, device=device)
    want_q, want_k = q.clone(), k.clone()
    REFERENCE.rotary_(want_q, want_k, REFERENCE.rope(cache, positions, dtype))
    q_ptr = q.data_ptr()
    ops.rotary_(q, k, ops.rope(cache, positions, dtype))
    assert q.data_ptr() == q_ptr
    _close(q, want_q, tol)
    _close(k, want_k, tol)
    if fused:
        assert torch.equal(qkv[:, (hq + hkv) * head_dim :], v_before)


def check_silu_and_mul(ops: DeviceOps, device: str, dtype: torch.dtype, inter: int, tol: float) -> None:
    """2-D and 3-D inputs, odd widths and widths over one program's column block."""
    gen = torch.Generator().manual_seed(inter)
    for shape in ((5, 2 * inter), (2, 3, 2 * inter)):
        x = _randn(*shape, gen=gen, dtype=dtype, device=device) * 4
        _close(ops.silu_and_mul(x), REFERENCE.silu_and_mul(x.clone()), tol)


def check_store_kv(ops: DeviceOps, device: str, dtype: torch.dtype, head_dim: int) -> None:
    """New K/V rows as strided views of a fused output, written at scattered slots; every other
    slot untouched. A copy: exact in every dtype."""
    gen = torch.Generator().manual_seed(head_dim)
    n, hkv, slots = 6, 2, 32
    pool = MHATokenToKVPool(slots, 1, dtype, 1, hkv, head_dim, device)
    want = MHATokenToKVPool(slots, 1, dtype, 1, hkv, head_dim, device)
    for p in (pool, want):
        p.k_buffer[0].copy_(torch.arange(p.k_buffer[0].numel(), dtype=torch.float32).view_as(p.k_buffer[0]))
        p.v_buffer[0].copy_(-p.k_buffer[0])
    kv = _randn(n, 3 * hkv * head_dim, gen=gen, dtype=dtype, device=device)
    k = kv[:, hkv * head_dim : 2 * hkv * head_dim].view(n, hkv, head_dim)
    v = kv[:, 2 * hkv * head_dim :].view(n, hkv, head_dim)
    loc = (torch.randperm(slots, generator=gen)[:n] + 1).to(device)
    ops.store_kv(pool, 0, loc, k, v)
    REFERENCE.store_kv(want, 0, loc, k, v)
    assert torch.equal(pool.k_buffer[0], want.k_buffer[0]) and torch.equal(pool.v_buffer[0], want.v_buffer[0])
