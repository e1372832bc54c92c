"""The CPU attention backend's computations: stateless functions of tensors, one per fast path.

Why a module of its own: ``runtime.engine.cpu.attention.CpuAttnBackend`` decides, per group,
which path runs (from its plan and the decode-key mirror); these functions only compute, from
the tensors they are given, with no plan, batch or mirror state, so each can be checked against
a reference and timed on its own (tests/unit/runtime/engine/cpu/test_attention_fastpaths.py,
bench/cpu_attention_f32.py, bench/cpu_prefill_attention.py).

- ``few_query_attention``: a one-token group's queries (GQA folded) against each request's
  keys: the C decode kernel of ``runtime.engine.cpu.attention_kernels`` where it applies, else
  two batched matmuls around an fp32 softmax;
- ``cascade_attention`` (with ``_attend_prefix``): a one-token group's softmax over a prefix every
  member shares (one GEMM per KV head for all members' queries) and each member's own keys, merged
  by log-sum-exp (``merge_partial_attention``, which the backend's extend cascade also merges with);
- ``causal_prefill_attention`` (``matmul_prefill_applies`` says where): equal-length prompts'
  causal self-attention over their new tokens, through the C causal kernel or bf16 GEMMs around
  the C row softmax (``matmul_causal_attention``), in cache-sized chunks;
- ``attend_shared_keys``: many queries against one key set with no mask (the shared prefix of a
  prefill's cascade), bf16 GEMMs around ``cpu_kernels.softmax_rows`` or the flash op.

Soft-capped logits (``softcap``, Gemma 2's ``attn_logit_softcapping``): none of the C kernels nor
the flash op cap, so where a ``softcap`` is given these functions never call them and compute
the scores in torch (``runtime.engine.attention.softcap``: scale, cap, mask, fp32 softmax); the
cascade's merge by log-sum-exp stays exact, as the cap acts on each score alone.

The functions above are this module's public interface, because another module calls each: the
backend every one but ``matmul_causal_attention``, which the bench and the tests run on its own
(where the C causal kernel would otherwise take the call). The backend calls them through the
module (``fastpaths.name``), so a test's ``monkeypatch`` of one here reaches it. ``_attend_prefix``
and the chunk sizes stay private: only this module's functions use them.
"""

from __future__ import annotations

import torch

from runtime.engine.attention.softcap import cap_scores_, softcapped_attention
from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import kernels as cpu_kernels

_MATMUL_PREFILL_DTYPES = (torch.bfloat16, torch.float16)
# Longer prompts keep SDPA (the matmul path splits them into runs of query positions, each
# a GEMM against the keys before its end; far longer prompts make many small GEMMs).
_MATMUL_PREFILL_MAX_LEN = 4096
# Score bytes per chunk in matmul_causal_attention and attend_shared_keys (cache-sized).
_PREFILL_SCORE_BYTES = 4 << 20
# matmul_causal_attention splits prompts at least this long into at least two runs of query
# positions, so the first run's scores skip the keys after it (a quarter of the work).
_PREFILL_SPLIT_MIN_LEN = 256


def matmul_prefill_applies(q: torch.Tensor, q_len: int, head_dim: int) -> bool:
    """Whether prompts of ``q_len`` new tokens (no padding) go through ``causal_prefill_attention``:
    half precision up to ``_MATMUL_PREFILL_MAX_LEN`` tokens, fp32 where its causal kernel runs
    (``attn_kernels.causal_attention``: faster than the flash kernel at every length measured).
    The backend asks before it takes an extend group of new keys off the plan's SDPA path."""
    if q.dtype == torch.float32:
        return attn_kernels.prefix_supported(q.dtype, q.device, head_dim)
    return q.dtype in _MATMUL_PREFILL_DTYPES and q_len <= _MATMUL_PREFILL_MAX_LEN


def causal_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal self-attention of ``n`` equal-length prompts over their new tokens, as matmuls.

    ``q`` ``[n, L, H, D]``, ``k``/``v`` ``[n, Hkv, L, D]``; returns ``(out [n * L, H, D],
    lse [n * L, H] fp32 or None)`` (``with_lse``: for a cascade's merge with a cached
    prefix attended separately). bf16 with a head dim that is a multiple of 64 on an
    AVX-512 CPU, and fp32 on AVX2 / AVX-512 builds, go to ``attn_kernels.causal_attention``
    (the same work in one pass, fp32 scores: in bf16 ~2.3x faster at 64 x 128 tokens, ~1.8x
    at 512-2048). Otherwise
    (``matmul_causal_attention``) each KV head's query group is folded position-major into
    one ``[L * group, D]`` operand (one GEMM per request and KV head, no repeated keys), the
    bf16 scores go through the causal row softmax of ``cpu_kernels`` in place (torch ops in
    fp32 where it is unavailable). Work is cut into cache-sized chunks: several requests at
    a time for short prompts, runs of query positions for long ones (each run only reads the
    keys up to its last position, so the causal upper triangle is mostly skipped). On the
    bench model (64 prompts x 128 tokens, 16 heads, 4 KV heads, bf16, 2 cores) this takes
    ~12 ms per layer where the CPU flash kernel takes ~40 ms; precision is that of
    transformers' eager attention (bf16 scores and probabilities, fp32 softmax).

    The backend's path for such a group (``matmul_prefill_applies``), alone or as a cascade's
    own-keys half (``with_lse``).
    """
    fused = attn_kernels.causal_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale, with_lse)
    return fused if fused is not None else matmul_causal_attention(q, k, v, scale, with_lse)


def matmul_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``causal_prefill_attention`` as bf16 matmuls around the row softmax (see there).

    Public for the bench and the tests, which run this path on its own where the C causal kernel
    would take ``causal_prefill_attention``'s call.
    """
    n, length, h, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    out = q.new_empty(n, length, h, d)
    lse_out = torch.empty(n, length, hkv, group, dtype=torch.float32, device=q.device) if with_lse else None
    row_bytes = hkv * group * length * 2  # bf16 scores of one query position against every key
    runs = max(-(-row_bytes * length // _PREFILL_SCORE_BYTES), 2 if length >= _PREFILL_SPLIT_MIN_LEN else 1)
    run_len = -(-length // runs)
    per_chunk = max(1, _PREFILL_SCORE_BYTES // (row_bytes * run_len))  # requests per chunk
    q_fold = q.view(n, length, hkv, group, d).permute(0, 2, 1, 3, 4)  # [n, Hkv, L, group, D]
    for start in range(0, n, per_chunk):
        end = min(n, start + per_chunk)
        c = end - start
        for first in range(0, length, run_len):
            last = min(length, first + run_len)  # positions [first, last) see keys [0, last)
            m = (last - first) * group
            qg = q_fold[start:end, :, first:last].reshape(c, hkv, m, d)  # row = position * group + head
            scores = torch.matmul(qg, k[start:end, :, :last].transpose(-1, -2))  # [c, Hkv, m, last]
            if cpu_kernels.softmax_supported(scores):  # in place: scores become probs
                lse = cpu_kernels.softmax_rows(
                    scores, scale, causal_period=m, rows_per_position=group, first_position=first, with_lse=with_lse
                )
                probs = scores
            else:
                position = first + torch.arange(m, device=q.device) // group
                hidden = torch.arange(last, device=q.device)[None, :] > position[:, None]
                logits = scores.float().mul_(scale).masked_fill_(hidden, float("-inf"))
                lse = torch.logsumexp(logits, dim=-1) if with_lse else None
                probs = torch.softmax(logits, dim=-1).to(v.dtype)
            o = torch.matmul(probs, v[start:end, :, :last])  # [c, Hkv, m, D]
            out[start:end, first:last].view(c, last - first, hkv, group, d).copy_(
                o.view(c, hkv, last - first, group, d).transpose(1, 2)
            )
            if lse_out is not None:
                assert lse is not None
                lse_out[start:end, first:last] = lse.view(c, hkv, last - first, group).transpose(1, 2)
    return out.view(n * length, h, d), None if lse_out is None else lse_out.view(n * length, h)


def merge_partial_attention(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax over the union of two key sets from each set's output and log-sum-exp.

    ``o_*`` ``[..., D]`` in the model dtype, ``lse_*`` ``[...]`` fp32; computed in fp32.
    bf16 ``[T, A, B, D]`` operands (any strides) go through ``cpu_kernels.merge_attention``,
    which reads them in place and returns a contiguous result.

    The second pass of every cascade that attends its two key sets apart: ``cascade_attention``'s,
    and the backend's extend cascade (a group's own keys, then the cached prefix they share).
    """
    merged = cpu_kernels.merge_attention(o_a, lse_a, o_b, lse_b)
    if merged is not None:
        return merged
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (o_a.float() * w_a + o_b.float() * w_b).to(o_a.dtype)


def _attend_prefix(
    qg: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, scale: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every member's queries ``[n, Hkv, group, D]`` against one shared prefix ``[1, Hkv, P, D]``.

    The members' queries become one long query axis per KV head, so the prefix keys are
    read once. Returns ``(out [n, Hkv, group, D], lse [n, Hkv, group])``.
    """
    n, hkv, group, d = qg.shape
    q_all = qg.transpose(0, 1).reshape(1, hkv, n * group, d)
    out_p, lse_p = attend_shared_keys(q_all, kp, vp, scale, softcap)
    return out_p.view(hkv, n, group, d).transpose(0, 1), lse_p.view(hkv, n, group).transpose(0, 1)


def attend_shared_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many queries ``[1, Hkv, M, D]`` against one key set ``[1, Hkv, P, D]`` (no mask):
    ``(out [1, Hkv, M, D], lse [1, Hkv, M] fp32)``.

    bf16 on CPU: bf16 score GEMMs, ``cpu_kernels.softmax_rows`` in place, then the value
    GEMM, a few thousand query rows at a time (~2x faster than the flash kernel on the
    shared-prefix prefill: 8064 queries x 512 keys per KV head). Otherwise the flash op.
    With a ``softcap``: explicit capped scores in torch (neither caps).

    The backend's extend cascade attends the cached prefix with it (every real query of the group
    at once) where the prefix kernel does not apply; ``_attend_prefix`` runs it for the decode cascade.
    """
    if softcap is not None:
        out_c, lse_c = softcapped_attention(q, k, v, scale, softcap, with_lse=True)
        assert lse_c is not None
        return out_c, lse_c
    m, p = q.shape[2], k.shape[2]
    if not cpu_kernels.softmax_applies(q.device, q.dtype, p):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return flash(q, k.contiguous(), v, scale=scale)[:2]  # (the flash op wants unit-stride rows)
    hkv = q.shape[1]
    out = q.new_empty(q.shape)
    lse = torch.empty(1, hkv, m, dtype=torch.float32, device=q.device)
    step = max(1, _PREFILL_SCORE_BYTES // (hkv * p * 2))
    k_t = k.transpose(-1, -2)
    for start in range(0, m, step):
        end = min(m, start + step)
        scores = torch.matmul(q[:, :, start:end], k_t)  # bf16 [1, Hkv, rows, P], contiguous
        lse[:, :, start:end] = cpu_kernels.softmax_rows(scores, scale, with_lse=True)
        out[:, :, start:end] = torch.matmul(scores, v)
    return out, lse


def cascade_attention(
    qg: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    ks_t: torch.Tensor,
    vs: torch.Tensor,
    suffix_mask: torch.Tensor | None,
    scale: float,
    suffix_width: int | None = None,
    append: attn_kernels.KeyAppend | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[n, Hkv, group, D]`` queries: softmax over (shared prefix ++ own suffix), in two passes.

    ``kp``/``vp`` ``[1, Hkv, P, D]`` are the shared prefix, ``ks_t`` ``[n, Hkv, D, Ls]``
    (transposed) and ``vs`` ``[n, Hkv, Ls, D]`` each request's own keys (``suffix_mask``,
    a key bias ``[n, 1, 1, Ls]``, masks the padding).
    Each call returns its log-sum-exp; the two partial outputs are combined with weights
    ``exp(lse_part - lse_total)``. ``softcap``: both passes cap their logits (torch paths).

    The backend's path for a one-token group with a shared prefix where the two C kernels cannot
    continue one softmax (no packed prefix from the mirror, a capped layer, operands the decode
    kernel does not take).
    """
    out_p, lse_p = _attend_prefix(qg, kp, vp, scale, softcap)
    out_s, lse_s = few_query_attention(
        qg, ks_t, vs, suffix_mask, scale, with_lse=True, width=suffix_width, append=append, softcap=softcap
    )
    assert lse_s is not None
    return merge_partial_attention(out_p, lse_p, out_s, lse_s).contiguous()


def few_query_attention(
    qg: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    with_lse: bool,
    width: int | None = None,
    append: attn_kernels.KeyAppend | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[n, Hkv, group, D]`` queries (a decode step, GQA folded) against keys ``k_t``
    ``[n, Hkv, D, L]`` (transposed: a view of ``[..., D, cap]`` rows is a strided batched
    matmul operand, while the transpose of a ``[..., L, D]`` view is first copied) and
    values ``[n, Hkv, L, D]``.

    Two batched matmuls around an fp32 softmax, as transformers' eager attention computes
    it: with a handful of queries per (request, KV head) the CPU flash kernel's per-block
    setup dominates, and this is ~2.3x faster on the bench model's decode (64 requests,
    4 KV heads x 4 queries, 160 keys: 0.49 vs 1.15 ms per layer). bf16 on CPU, and fp32 on
    AVX2 / AVX-512 builds, go to the C kernel of ``attn_kernels`` instead when it is available
    (~0.45 ms in bf16, fp32 scores).

    ``mask`` is an fp32 key bias ``[n, 1, 1, L]`` (``_key_bias``: 0 for a real key, -inf
    for padding) or None; ``width``: keys at ``width`` and beyond are all padding (the
    kernel skips them); ``append`` (``kernel_append``, only given when the kernel runs): the
    new keys the kernel stores first. ``softcap``: the logits are capped (the kernel does not cap:
    the matmul path runs, and ``append`` must be None). Returns ``(out [n, Hkv, group, D],
    lse [n, Hkv, group] fp32 or None)``.

    The backend's path for a one-token group without a shared prefix, and ``cascade_attention``'s
    own-keys pass.
    """
    if softcap is None and attn_kernels.supports(qg, k_t, v, mask):
        return attn_kernels.decode_attention(qg, k_t, v, mask, scale, width or k_t.shape[-1], with_lse, append)
    assert append is None, "a deferred mirror append needs the decode kernel"

    scores = torch.matmul(qg, k_t).float().mul_(scale)  # [n, Hkv, group, L]
    if softcap is not None:
        cap_scores_(scores, softcap)
    if mask is not None:
        scores.add_(mask)
    if not with_lse:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v), None
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs.to(v.dtype), v), lse
