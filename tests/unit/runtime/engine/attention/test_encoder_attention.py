"""``AttentionBackend.forward_encoder``: an encoder's attention, every backend's alike, against a float64
reference over the whole packed batch with a mask that lets each token see exactly its own request's
tokens (both ways)."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.engine.attention.torch_native import TorchNativeAttnBackend
from runtime.engine.cpu.attention import CpuAttnBackend
from runtime.engine.forward_batch import ForwardBatch, ForwardMode

# requests 0 and 2 share a length (one SDPA call for both), 1 and 4 too, 3 is alone (its rows as views)
LENS = [3, 5, 3, 1, 5]
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # GQA: two query heads per KV head


def _batch(lens: list[int], prefix: list[int] | None = None) -> ForwardBatch:
    t = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    prefix = prefix or [0] * len(lens)
    total = sum(lens)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=t([1] * total),
        positions=t([i for n in lens for i in range(n)]),
        req_pool_indices=t(range(len(lens))),
        seq_lens=t([p + n for p, n in zip(prefix, lens)]),
        prefix_lens=t(prefix),
        extend_lens=t(lens),
        out_cache_loc=t([0] * total),
        req_to_token_pool=None,  # type: ignore[arg-type]  # (never read: an encoder keeps no KV)
        token_to_kv_pool=None,  # type: ignore[arg-type]
        seq_lens_cpu=[p + n for p, n in zip(prefix, lens)],
        prefix_lens_cpu=prefix,
        extend_lens_cpu=lens,
    )


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in float64 over all packed tokens, the mask true within a request."""
    request = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    same = request[:, None] == request[None, :]
    group = q.shape[1] // k.shape[1]
    kd, vd = (x.double().repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))  # [H, T, D]
    scores = (q.double().transpose(0, 1) @ kd.transpose(1, 2)) * scale
    weights = torch.softmax(scores.masked_fill(~same, float("-inf")), dim=-1)
    return (weights @ vd).transpose(0, 1)  # [T, H, D]


@pytest.mark.parametrize("backend_class", [TorchNativeAttnBackend, CpuAttnBackend])
def test_each_token_attends_to_its_own_request_both_ways(backend_class: type[AttentionBackend]) -> None:
    gen = torch.Generator().manual_seed(3)
    total = sum(LENS)
    # q, k and v as the encoder layer hands them: strided views of one fused projection's rows
    qkv = torch.randn(total, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    q = qkv[:, : HEADS * HEAD_DIM].view(total, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(total, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(total, KV_HEADS, HEAD_DIM)
    spec = AttentionLayerSpec(layer_id=0, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scaling=0.3)
    out = backend_class().forward_encoder(q, k, v, spec, _batch(LENS))
    assert out.shape == (total, HEADS, HEAD_DIM) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(q, k, v, LENS, 0.3), atol=1e-5, rtol=1e-5)


def test_a_cached_prefix_and_windows_are_refused() -> None:
    x = torch.zeros(4, 2, 8)
    spec = AttentionLayerSpec(layer_id=0, num_heads=2, num_kv_heads=2, head_dim=8, scaling=1.0)
    with pytest.raises(ValueError, match="cannot follow a cached prefix"):
        TorchNativeAttnBackend().forward_encoder(x, x, x, spec, _batch([4], prefix=[2]))
    windowed = AttentionLayerSpec(layer_id=0, num_heads=2, num_kv_heads=2, head_dim=8, scaling=1.0, sliding_window=2)
    with pytest.raises(NotImplementedError, match="no window"):
        TorchNativeAttnBackend().forward_encoder(x, x, x, windowed, _batch([4]))
